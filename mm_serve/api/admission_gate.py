"""The API's admission checks per call: image bytes before decoding, then work and queues.

Every refusal is a :class:`~mm_serve.admission.rejection.Rejection`, answered by the
error handlers (:func:`mm_serve.api.errors.from_rejection`) in OpenAI's error JSON.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

from mm_serve.admission.bounds import check_queues, check_work
from mm_serve.admission.byte_budget import ByteBudget
from mm_serve.admission.predictor import Prediction
from mm_serve.admission.rejection import Rejection
from mm_serve.admission.tiers import Tier
from mm_serve.api.schemas import ChatMessage
from mm_serve.config import ServiceConfig
from mm_serve.engine.engine_client import EngineClient
from mm_serve.inputs.input_processor import ProcessedInputs
from mm_serve.media.image_loading import declared_size
from mm_serve.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from mm_serve.api.context import ServerContext


DEFAULT_PRECHECK_TOKENS = 16  # max_tokens assumed by the early admission check when the call sets none
PRECHECK_TEXT_CHARS = 8192  # of each text part, tokenized by the early check (a lower bound: the front end's loop must not stall)
BYTES_PER_DECLARED_PIXEL = 16  # decoded pixels and the copies made while making them upright RGB
PREPROCESS_BYTES = 4 << 20  # the resized, normalised tensor and its intermediates, per image


def image_urls(messages: Sequence[ChatMessage]) -> Iterator[str]:
    """The URL of each ``image_url`` part of the messages, in order."""
    for message in messages:
        if isinstance(message.content, list):
            yield from (part.image_url.url for part in message.content if part.type == "image_url")


DeclaredImage = tuple[str, tuple[int, int] | None]  # an image_url part's URL and the size its data-URI header declares


def declared_images(messages: Sequence[ChatMessage]) -> list[DeclaredImage]:
    """Each ``image_url`` part's URL, in order, with the (width, height) its data-URI header
    declares (:func:`~mm_serve.media.image_loading.declared_size`; None for a URL or an unreadable
    header): read once per call, for both :func:`image_reservation` and :func:`media_size`."""
    return [(url, declared_size(url)) for url in image_urls(messages)]


def image_reservation(messages: Sequence[ChatMessage], config: ServiceConfig,
                      images: Sequence[DeclaredImage] | None = None) -> tuple[int, int]:
    """(images, bytes to reserve) for the images of a chat call before any is fetched
    (``images``: its :func:`declared_images`, read from ``messages`` when not given).

    Each image reserves its encoded size (a data URI's length; ``api.max_image_fetch_bytes``
    for an http(s) or file URL) plus what decoding and preprocessing it may take:
    ``admission.image_decode_reserve_bytes``, or less for a data URI whose header declares a
    small image (:data:`BYTES_PER_DECLARED_PIXEL` per pixel plus :data:`PREPROCESS_BYTES`), so
    small images do not each hold the reserve sized for large ones.
    """
    images = declared_images(messages) if images is None else images
    total = 0
    for url, size in images:
        decode = config.admission.image_decode_reserve_bytes
        if url.lstrip()[:5].lower() == "data:":
            encoded = len(url)
            if size is not None:
                decode = min(decode, BYTES_PER_DECLARED_PIXEL * size[0] * size[1] + PREPROCESS_BYTES)
        else:
            encoded = config.api.max_image_fetch_bytes
        total += encoded + decode
    return len(images), total


UNDECLARED_IMAGE_MEGAPIXELS = 1.0  # media work assumed for an image whose size is not declared (a URL, a bad header)
CALL_MEGAPIXELS = 0.05  # media work of templating and tokenizing one prompt, in megapixels of image decoding


def media_size(images: Sequence[DeclaredImage] = (), prompts: int = 1) -> float:
    """The media work of a call (:class:`~mm_serve.admission.media_load.MediaLoad`), in megapixel
    equivalents: the declared megapixels of its images (:func:`declared_images`;
    :data:`UNDECLARED_IMAGE_MEGAPIXELS` for one that declares none) plus :data:`CALL_MEGAPIXELS`
    per prompt."""
    total = CALL_MEGAPIXELS * max(1, prompts)
    for _, size in images:
        total += UNDECLARED_IMAGE_MEGAPIXELS if size is None else size[0] * size[1] / 1e6
    return total


def uncached_text_floor(messages: Sequence[ChatMessage], unseen: Sequence[bool], tokenizer: Any) -> int:
    """A lower bound on the prompt tokens, without the chat template's own, that no prefix cache
    can hold: those of the text after the first image whose ``unseen`` flag (one per
    ``image_url`` part, in order) is set (a cached prefix ends before it), each text part's first
    :data:`PRECHECK_TEXT_CHARS` characters tokenized alone, one token less per part (a merge
    across a part's edge may save one). 0 when no image is unseen."""
    total, images, after = 0, 0, False
    for message in messages:
        content = message.content
        parts = [("text", content)] if isinstance(content, str) else [
            ("text", p.text) if p.type == "text" else ("image", "") for p in content or ()]
        for kind, text in parts:
            if kind == "image":
                after = after or unseen[images]
                images += 1
            elif after and text:
                total += max(0, len(tokenizer.encode(text[:PRECHECK_TEXT_CHARS], add_special_tokens=False)) - 1)
    return total


def hold_images(budget: ByteBudget, messages: Sequence[ChatMessage], config: ServiceConfig,
                images: Sequence[DeclaredImage] | None = None) -> AbstractContextManager[None]:
    """A context manager holding the call's image bytes (see :func:`image_reservation`).

    Raises (on entry):
        Rejection: 503 ``image_bytes`` when they do not fit the budget.
    """
    count, nbytes = image_reservation(messages, config, images)
    return budget.hold(nbytes, f"{count} image(s)")


def check_call_work(config: ServiceConfig, prepared: Sequence[tuple[ProcessedInputs, SamplingParams]]) -> None:
    """The work limit for a call of ``prepared`` prompts (each run ``params.n`` times).

    Raises:
        Rejection: 400 ``work_limit``.
    """
    if prepared:
        prompt_tokens = [len(inputs.prompt_token_ids) for inputs, _ in prepared]
        check_work(prompt_tokens, [params.max_tokens for _, params in prepared], prepared[0][1].n, config.admission)


def check_call_queues(client: EngineClient, config: ServiceConfig,
                      prepared: Sequence[tuple[ProcessedInputs, SamplingParams]],
                      held: tuple[int, int] = (0, 0)) -> None:
    """The queue caps for a call of ``prepared`` prompts (each run ``params.n`` times), with
    ``held`` (requests, prompt tokens) waiting in the dispatch hold counted as queued.

    Raises:
        Rejection: 429 ``queued_requests`` or ``queued_tokens`` when a cap would be passed.
    """
    if not prepared:
        return
    prompt_tokens = [len(inputs.prompt_token_ids) for inputs, _ in prepared]
    n = prepared[0][1].n
    queued_requests, queued_tokens = client.queued()
    check_queues(queued_requests + held[0], queued_tokens + held[1], n * len(prepared), n * sum(prompt_tokens), config.admission)


def _check_caps(ctx: ServerContext, client: EngineClient, tier: Tier,
                prepared: Sequence[tuple[ProcessedInputs, SamplingParams]]) -> None:
    """:func:`check_call_queues` for a call of ``tier``: calls waiting in the dispatch hold count
    for their own tier only (held to give way to tighter tiers, they must not get those refused)."""
    held = ctx.dispatch_hold.queued() if ctx.admission.holds(tier) else (0, 0)
    check_call_queues(client, ctx.config, prepared, held)


def admit_call(ctx: ServerContext, client: EngineClient, tier: Tier,
               prepared: Sequence[tuple[ProcessedInputs, SamplingParams]], arrival: float | None = None,
               committed: bool = False) -> Prediction | None:
    """The queue caps, then the latency prediction, for a call of ``prepared`` prompts that arrived
    at ``arrival`` (``time.monotonic()`` seconds: the time since then, decoding its images, waiting
    in the dispatch hold or for a busy front end, is part of its TTFT and of the prediction); counts
    the admission in the tier metrics. Returns the prediction of its first request (None when none
    could be made: a role has no ready worker). A ``committed`` call (admitted at its decision
    deadline, :mod:`mm_serve.api.decision_deadline`) is predicted but not refused on it.

    Raises:
        Rejection: 429 from a queue cap or (unless ``committed``) a predicted SLO miss.
    """
    waited = 0.0 if arrival is None else max(0.0, time.monotonic() - arrival)
    with counted(ctx, tier):
        _check_caps(ctx, client, tier, prepared)
        inputs, params = prepared[0]
        prediction = ctx.admission.admit(client, tier, len(inputs.prompt_token_ids), inputs.num_images,
                                         params.max_tokens, inputs, waited, refuse=not committed)
    if ctx.tier_metrics is not None:
        ctx.tier_metrics.observe_admission(tier.name, None)
    return prediction


async def hold_call(ctx: ServerContext, client: EngineClient, tier: Tier,
                    prepared: Sequence[tuple[ProcessedInputs, SamplingParams]],
                    gone: Callable[[], Awaitable[bool]] | None = None) -> float:
    """Let a call of the never-refused tier wait, in arrival order, until dispatching it hurts no
    tighter request (:meth:`AdmissionController.hold_reason` on its first prompt) or it has waited
    half its TTFT SLO or half ``api.timeout_ms``, whichever is less (then it goes, to still meet
    that SLO and leave the request its time); at once for other tiers, with prediction off, or
    with nothing to wait for. The queue caps of later calls of its tier count it while it waits.
    Returns the seconds it waited.

    Raises:
        Rejection: 429 from a queue cap (checked before it waits).
        ConnectionAbortedError: ``gone()`` (its client's disconnect check) said the client left.
    """
    if not prepared or not ctx.admission.holds(tier):
        return 0.0
    with counted(ctx, tier):  # a call past the caps is refused, not held
        _check_caps(ctx, client, tier, prepared)
    inputs, params = prepared[0]
    n = params.n
    requests, tokens = n * len(prepared), n * sum(len(i.prompt_token_ids) for i, _ in prepared)

    def ready() -> bool:
        return ctx.admission.hold_reason(client, tier, len(inputs.prompt_token_ids), inputs.num_images,
                                         params.max_tokens, inputs) is None

    longest = min(tier.slo.ttft_ms / 2000.0, ctx.config.api.timeout_ms / 2000.0)
    return await ctx.dispatch_hold.wait(ready, requests, tokens, longest, gone)


def precheck_call(ctx: ServerContext, tier: Tier, max_tokens: int, messages: Sequence[ChatMessage] = (),
                  arrival: float | None = None) -> Callable[[float], None]:
    """Refuse a call on its tier, ``max_tokens``, the image tokens of its images that no
    cache can hold (data URIs this process has not been sent before,
    :class:`~mm_serve.admission.seen_images.SeenImages`) and a lower bound on the tokens of its
    text after the first of them (:func:`uncached_text_floor`), before its images are fetched or decoded, when the queues
    already rule it out (:meth:`AdmissionController.precheck`); nothing while the engine is not
    up (the later checks answer that). The call's image URLs are remembered as seen either way.

    Returns the same check, to be made again at the call's decision deadline
    (:mod:`mm_serve.api.decision_deadline`) with the seconds still expected before its prompt is
    ready; it counts its outcome in ``mm_serve_tier_decided_at_deadline_total`` and leaves the
    refusal count to its caller.

    Raises:
        Rejection: 429 from a predicted SLO miss.
    """
    urls = list(image_urls(messages))
    data = [url.lstrip()[:5].lower() == "data:" for url in urls]
    fresh = iter(ctx.seen_images.unseen_flags(url for url, is_data in zip(urls, data, strict=True) if is_data))
    flags = [is_data and next(fresh) for is_data in data]  # one per image: a data URI not sent before
    unseen = sum(flags)
    tokens, images = 0, 0
    if ctx.holder.started:
        vision = ctx.holder.model_config.vision
        per_image = 0 if vision is None else vision.num_image_tokens
        tokens, images = unseen * per_image, unseen if per_image else 0
        if tokens:
            tokens += uncached_text_floor(messages, flags, ctx.holder.inputs.tokenizer)

    def check(expected_s: float = 0.0) -> None:
        if not ctx.holder.started or ctx.holder.draining.is_set():
            return
        waited = 0.0 if arrival is None else max(0.0, time.monotonic() - arrival)
        ctx.admission.precheck(ctx.holder.client, tier, max_tokens, tokens, images, waited + expected_s)

    def at_deadline(expected_s: float) -> None:
        try:
            check(expected_s)
        except Rejection:
            if ctx.tier_metrics is not None:
                ctx.tier_metrics.at_deadline.labels(tier=tier.name, outcome="refused").inc()
            raise
        if ctx.tier_metrics is not None:
            ctx.tier_metrics.at_deadline.labels(tier=tier.name, outcome="committed").inc()

    with counted(ctx, tier):
        check()
    return at_deadline


@contextmanager
def counted(ctx: ServerContext, tier: Tier) -> Iterator[None]:
    """Count a :class:`Rejection` raised in the body in the tier metrics (and re-raise it)."""
    try:
        yield
    except Rejection as rejection:
        if ctx.tier_metrics is not None:
            ctx.tier_metrics.observe_admission(tier.name, rejection.reason)
        raise


PREDICTION_HEADER = "x-mm-serve-predicted-ttft-ms"
TPOT_PREDICTION_HEADER = "x-mm-serve-predicted-tpot-ms"


def prediction_header(prediction: Prediction | None) -> dict[str, str]:
    """The predicted TTFT and TPOT in milliseconds, for a stream's response headers (none
    without a prediction)."""
    if prediction is None:
        return {}
    return {PREDICTION_HEADER: f"{1000 * prediction.ttft_s:.1f}", TPOT_PREDICTION_HEADER: f"{1000 * prediction.tpot_s:.2f}"}
