"""The admission steps a call passes through, in order, and the gate of a job without admission.

:class:`AdmissionGate` (the server's): the early check before the images are decoded, the image
budget and the decision deadline around the media work, the work limit, the dispatch hold of the
never-refused tier, the queue caps and the latency prediction. Every refusal is a
:class:`~mm_serve.admission.rejection.Rejection`, counted per tier in the metrics. :class:`OpenGate`
(the caption job's in-process engine): no step refuses, nothing is predicted.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, contextmanager, nullcontext
from typing import Protocol, TypeVar

from mm_serve.admission.bounds import check_queues, check_work
from mm_serve.admission.byte_budget import Hold
from mm_serve.admission.media_load import MediaWork
from mm_serve.admission.predictor import Prediction
from mm_serve.admission.rejection import Rejection
from mm_serve.config import ServiceConfig
from mm_serve.ground.tiers import Tier
from mm_serve.inputs.input_processor import ProcessedInputs
from mm_serve.media.media_runner import RunCPU
from mm_serve.media.video_loading import Reserve
from mm_serve.models.llava_next.anyres import grid_shape
from mm_serve.models.model_config import VisionConfig
from mm_serve.pipeline.call import Call
from mm_serve.pipeline.chat_prompt import DeclaredImage
from mm_serve.pipeline.context import ServerContext
from mm_serve.pipeline.decision_deadline import within_deadline
from mm_serve.protocol.errors import STOPPED_MESSAGE, STOPPED_RETRY_AFTER_S, unavailable
from mm_serve.runtime.sampling_params import SamplingParams

T = TypeVar("T")
Prepared = Sequence[tuple[ProcessedInputs, SamplingParams]]  # a call's prompts, each with its parameters
MediaWorkFn = Callable[[Reserve | None, RunCPU], Awaitable[T]]  # a call's media work: (video reserve, CPU runner)

BYTES_PER_DECLARED_PIXEL = 16  # decoded pixels and the copies made while making them upright RGB
PREPROCESS_COPIES = 2  # the float32 tensor the image processor returns and its one intermediate copy at a time
UNDECLARED_IMAGE_MEGAPIXELS = 1.0  # media work assumed for an image whose size is not declared (a URL, a bad header)
MEDIA_HOLD_BUDGET_SHARE = 0.5  # of admission.max_image_bytes_in_flight, the most the bodies of calls held before their media work hold
BUDGET_WAIT_LEARNED_S = 0.005  # a call that waited longer for the image byte budget does not teach the media fit
VIDEO_SURVEY_BYTES = 4 << 20  # a video's demuxer buffers while its packets are walked, before its frames are known


def preprocessed_bytes(vision: VisionConfig, width: int, height: int) -> int:
    """Bytes of the float32 pixel tensor the model's image processor makes of one ``width`` x ``height`` image:
    a fixed-size tower's one ``image_size``-square tile; an any-resolution tower's (LLaVA-NeXT, OneVision)
    tiles of the best resolution for the image (transformers' ``select_best_resolution``) plus its base tile;
    a dynamic-resolution tower's (Qwen2-VL) image resized within its pixel bounds, ``temporal_patch_size``
    copies of it (an upper bound: the resize rounds each side to whole merged patches)."""
    channels_bytes = 3 * 4
    if vision.dynamic_resolution:
        floor, ceiling = vision.pixel_bounds
        factor = vision.patch_size * vision.merge_size
        pixels = min(max(width * height, floor), ceiling)
        side = math.isqrt(pixels) + factor  # rounded up to whole merged patches
        return side * side * channels_bytes * vision.temporal_patch_size
    tiles = 1
    if vision.any_resolution:
        rows, columns = grid_shape((height, width), vision.grid_pinpoints, vision.image_size)
        tiles += rows * columns
    return tiles * vision.image_size ** 2 * channels_bytes


def image_reservation(images: Sequence[DeclaredImage], config: ServiceConfig, vision: VisionConfig | None) -> int:
    """Bytes to reserve for a call's ``images`` before any is fetched.

    Each image reserves its encoded size (a data URI's length; ``api.max_image_fetch_bytes``
    for an http(s) or file URL) plus what decoding and preprocessing it will hold: for a data URI whose
    header declares its size, :data:`BYTES_PER_DECLARED_PIXEL` per pixel plus :data:`PREPROCESS_COPIES` of
    the model's preprocessed tensor for it (:func:`preprocessed_bytes`), at most
    ``admission.image_decode_reserve_bytes``; else that reserve. A video reserves its encoded size
    (``api.max_video_fetch_bytes`` for a URL) plus :data:`VIDEO_SURVEY_BYTES` for walking its packets; what
    its frames will hold is added once they are known (:meth:`AdmissionGate.media`).
    """
    total = 0
    for image in images:
        if image.is_video:
            total += (len(image.url) if image.is_data else config.api.max_video_fetch_bytes) + VIDEO_SURVEY_BYTES
            continue
        decode = config.admission.image_decode_reserve_bytes
        if image.is_data:
            encoded = len(image.url)
            if image.size is not None and vision is not None:
                width, height = image.size
                decode = min(decode, BYTES_PER_DECLARED_PIXEL * width * height
                             + PREPROCESS_COPIES * preprocessed_bytes(vision, width, height))
        else:
            encoded = config.api.max_image_fetch_bytes
        total += encoded + decode
    return total


def media_size(images: Sequence[DeclaredImage] = (), prompts: int = 1, video_megapixels: float = 0.0) -> MediaWork:
    """The media work of a call (:class:`~mm_serve.admission.media_load.MediaLoad`): its prompts and
    the declared megapixels of its images (:data:`UNDECLARED_IMAGE_MEGAPIXELS` for one that declares
    none), ``video_megapixels`` per video (the frames it may sample at their largest); known when every
    image declared its size (:attr:`MediaWork.known`)."""
    total, known = 0.0, True
    for image in images:
        if image.is_video:
            total, known = total + video_megapixels, False
        elif image.size is None:
            total, known = total + UNDECLARED_IMAGE_MEGAPIXELS, False
        else:
            total += image.size[0] * image.size[1] / 1e6
    return MediaWork(max(1, prompts), total, known)


def prompt_work(prepared: Prepared) -> tuple[int, int]:
    """(engine requests, prompt tokens) of a call: each prompt runs ``n`` times."""
    n = prepared[0][1].n
    return n * len(prepared), n * sum(len(inputs.prompt_token_ids) for inputs, _ in prepared)


class Gate(Protocol):
    """The admission steps of :func:`~mm_serve.pipeline.pipeline.admit_call`, in the order it takes them."""

    def refuse_if_draining(self) -> None: ...

    def precheck(self, call: Call) -> Callable[[float], None]: ...

    async def hold_media(self, call: Call, gone: Callable[[], Awaitable[bool]]) -> None: ...

    async def media(self, call: Call, recheck: Callable[[float], None], load: MediaWorkFn[T],
                    release_body: Callable[[], None]) -> tuple[T, bool]: ...

    def check_work(self, call: Call, prepared: Prepared) -> None: ...

    async def hold(self, call: Call, prepared: Prepared, gone: Callable[[], Awaitable[bool]]) -> None: ...

    def admit(self, call: Call, prepared: Prepared, committed: bool) -> Prediction | None: ...


class OpenGate:
    """The gate of the caption job's own engine: nothing is refused, held or predicted."""

    def refuse_if_draining(self) -> None:
        """Nothing: the job stops its own engine."""

    def precheck(self, call: Call) -> Callable[[float], None]:
        """Nothing to check; the returned re-check does nothing."""
        return lambda _: None

    async def hold_media(self, call: Call, gone: Callable[[], Awaitable[bool]]) -> None:
        """Nothing: no hold."""

    async def media(self, call: Call, recheck: Callable[[float], None], load: MediaWorkFn[T],
                    release_body: Callable[[], None]) -> tuple[T, bool]:
        """Run the media work (no budget, no deadline; its CPU steps on ``asyncio.to_thread``)."""
        release_body()
        return await load(None, asyncio.to_thread), False

    def check_work(self, call: Call, prepared: Prepared) -> None:
        """Nothing: no work limit."""

    async def hold(self, call: Call, prepared: Prepared, gone: Callable[[], Awaitable[bool]]) -> None:
        """Nothing: no dispatch hold."""

    def admit(self, call: Call, prepared: Prepared, committed: bool) -> Prediction | None:
        """No prediction."""
        return None


class AdmissionGate:
    """The server's admission steps for the calls of ``ctx``."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.config = ctx.config

    def refuse_if_draining(self) -> None:
        """Raises:
            APIError: 503 while the service is shutting down."""
        self.ctx.refuse_if_draining()

    @contextmanager
    def counted(self, tier: Tier) -> Iterator[None]:
        """Count a :class:`Rejection` raised in the body in the tier metrics (and re-raise it)."""
        try:
            yield
        except Rejection as rejection:
            if self.ctx.tier_metrics is not None:
                self.ctx.tier_metrics.observe_admission(tier, rejection.reason)
            raise

    def precheck(self, call: Call) -> Callable[[float], None]:
        """Refuse a call on its tier, ``max_tokens``, the image tokens of its images that no cache can
        hold (data URIs this process has not been sent before,
        :class:`~mm_serve.admission.seen_images.SeenImages`) and a lower bound on the tokens of its
        text after the first of them (:meth:`ChatPrompt.uncached_text_floor`), before its images are
        fetched or decoded, when the queues already rule it out (:meth:`AdmissionController.precheck`);
        nothing while the engine is not up (the later checks answer that). The call's image URLs
        are remembered as seen either way.

        Returns the same check, to be made again at the call's decision deadline
        (:mod:`mm_serve.pipeline.decision_deadline`) with the seconds still expected before its prompt
        is ready; it counts its outcome in ``mm_serve_tier_decided_at_deadline_total`` and leaves the
        refusal count to its caller.

        Raises:
            Rejection: 429 from a predicted SLO miss.
        """
        ctx, tier = self.ctx, call.tier
        images = call.chat.images if call.chat is not None else []
        fresh = iter(ctx.seen_images.unseen_flags(image.url for image in images if image.is_data))
        flags = [image.is_data and next(fresh) for image in images]  # one per image: a data URI not sent before
        tokens, count = 0, 0
        if ctx.holder.started:
            vision = ctx.holder.model_config.vision
            # before an image is decoded its size is unknown: the fewest tokens and tower passes any image
            # makes (a tiling family's whole-image tile alone), so this check refuses only sure misses
            per_image = 0 if vision is None else vision.num_image_tokens
            tokens, count = sum(flags) * per_image, sum(flags) if per_image else 0
            if tokens and call.chat is not None:
                tokens += call.chat.uncached_text_floor(flags, ctx.holder.inputs.tokenizer)

        def check(expected_s: float = 0.0) -> None:
            if not ctx.holder.started or ctx.holder.draining.is_set():
                return
            waited = max(0.0, time.monotonic() - call.arrival)
            ctx.admission.precheck(ctx.holder.client, tier, call.precheck_max_tokens, tokens, count,
                                   waited + expected_s)

        def at_deadline(expected_s: float) -> None:
            try:
                check(expected_s)
            except Rejection:
                if ctx.tier_metrics is not None:
                    ctx.tier_metrics.observe_decided_at_deadline(tier, committed=False)
                raise
            if ctx.tier_metrics is not None:
                ctx.tier_metrics.observe_decided_at_deadline(tier, committed=True)

        with self.counted(tier):
            check()
        return at_deadline

    async def hold_media(self, call: Call, gone: Callable[[], Awaitable[bool]]) -> None:
        """Let a call of the never-refused tier that brings images or videos wait before its media work,
        in arrival order, until dispatching it would hurt no tighter request
        (:meth:`AdmissionController.hold_reason` on the fewest tokens its images make) or it has waited
        its longest hold (:meth:`hold`): decoding its images takes a core from the workers, and its image
        bytes from the tighter tiers' calls. It still holds its body's bytes while it waits, so it is not
        held when the data URIs of the calls held would pass :data:`MEDIA_HOLD_BUDGET_SHARE` of
        ``admission.max_image_bytes_in_flight`` with its own (the rest stays for the tighter tiers' calls;
        it then waits in the dispatch hold, after its media work). At once for other tiers, calls without
        images, with prediction off, or before the engine is up. The queue caps count it while it waits,
        and are checked before it does.

        Raises:
            Rejection: 429 from a queue cap (checked before it waits).
            ConnectionAbortedError: ``gone()`` said the client left.
            APIError: 503 once the service starts shutting down while the call is held (its images not yet
                decoded: nothing done for it is lost, as for a call that arrives during the drain).
        """
        ctx, tier = self.ctx, call.tier
        images = call.chat.images if call.chat is not None else []
        if not images or not ctx.admission.holds(tier) or not ctx.holder.started:
            return
        vision = ctx.holder.model_config.vision
        tokens = max(1, len(images) * (0 if vision is None else vision.num_image_tokens))  # the fewest they make
        client, max_tokens = ctx.holder.client, call.precheck_max_tokens

        def ready() -> bool:
            return ctx.admission.hold_reason(client, tier, tokens, len(images), max_tokens) is None

        body = sum(len(image.url) for image in images if image.is_data)
        if ctx.media_held_bytes + body > ctx.image_budget.capacity * MEDIA_HOLD_BUDGET_SHARE:
            return
        with self.counted(tier):  # a call past the caps is refused, not held
            self._check_caps(tier, call.num_prompts, tokens)
        ctx.media_held_bytes += body
        try:  # refused once the drain starts: nothing is done for it yet, as for a call that arrives then
            await ctx.media_hold.wait(ready, call.num_prompts, tokens, self._longest_hold(call),
                                      _gone_or_refused(gone, ctx.refuse_if_draining))
        finally:
            ctx.media_held_bytes -= body

    def _longest_hold(self, call: Call) -> float:
        """Seconds a never-refused call may still be held: half its TTFT SLO or half ``api.timeout_ms``,
        whichever is less, less what it has waited since it arrived."""
        longest = min(self.config.slo.of(call.tier).ttft_s / 2, self.config.api.timeout_ms / 2000.0)
        return max(0.0, longest - (time.monotonic() - call.arrival))

    def _refuse_if_stopped(self) -> None:
        """Raises:
            APIError: the stopping 503 once the service's drain has ended (the grace passed, or a second
                signal): a held call is not dispatched then."""
        if self.ctx.holder.drain_ended.is_set():
            raise unavailable(STOPPED_MESSAGE, STOPPED_RETRY_AFTER_S)

    def hold_images(self, call: Call) -> AbstractAsyncContextManager[Hold | None]:
        """An async context manager holding the call's image bytes (see :func:`image_reservation`), waiting
        up to ``admission.image_wait_s`` for room; it gives the
        :class:`~mm_serve.admission.byte_budget.Hold` (None for a call without messages).

        Raises (on entry):
            Rejection: 429 ``image_bytes`` when they did not fit the budget in time.
        """
        if call.chat is None:
            return nullcontext()
        videos = call.chat.num_videos
        what = f"{len(call.chat.images) - videos} image(s)" + (f" and {videos} video(s)" if videos else "")
        vision = self.ctx.holder.model_config.vision
        return self.ctx.image_budget.hold(image_reservation(call.chat.images, self.config, vision), what,
                                          self.config.admission.image_wait_s)

    async def media(self, call: Call, recheck: Callable[[float], None], load: MediaWorkFn[T],
                    release_body: Callable[[], None]) -> tuple[T, bool]:
        """Run the call's media work ``load(reserve, run)`` under its image bytes' hold (taken over from its
        body's, ``release_body``; ``reserve`` grows it by what each video's frames will hold, once known), its
        CPU steps by ``run``: for a call with images or videos, its turns on the server's
        :class:`~mm_serve.media.media_runner.MediaRunner` at its tier's rank (``asyncio.to_thread`` for one
        without); decided by its decision deadline with ``recheck``
        (:func:`~mm_serve.pipeline.decision_deadline.within_deadline`; a call refused there is abandoned: its
        steps not yet begun never run; one still waiting for its image bytes there is decided after its media
        work); returns (its result, committed: decided at the deadline). The media fit learns from it unless
        it waited :data:`BUDGET_WAIT_LEARNED_S` or more for its image bytes (or never got them).

        Raises:
            Rejection: 429 ``image_bytes`` (no room in time), or 429 at the deadline.
        """
        waited: list[float | None] = [None]  # seconds it waited for the image byte budget (None: not got them)
        asking = [False]  # waiting for the image byte budget now
        images = call.chat.images if call.chat is not None else []
        turns = self.ctx.media_runner.turns(int(call.tier)) if images else None
        run: RunCPU = asyncio.to_thread if turns is None else turns

        async def held() -> T:
            release_body()  # the images' own reservation takes over from the body's
            asked, asking[0] = time.monotonic(), bool(images)
            try:
                async with self.hold_images(call) as hold:
                    waited[0], asking[0] = time.monotonic() - asked, False
                    return await load(None if hold is None else lambda nbytes: hold.grow(nbytes, "a video's frames"),
                                      run)
            finally:
                asking[0] = False

        api = self.config.api
        video_megapixels = api.max_video_frames * api.max_video_frame_pixels / 1e6
        with self.counted(call.tier):
            return await within_deadline(held(), self.ctx.decision_deadline(call.arrival, call.tier), recheck,
                                         self.ctx.media_load, media_size(images, call.num_prompts, video_megapixels),
                                         lambda: waited[0] is not None and waited[0] < BUDGET_WAIT_LEARNED_S,
                                         None if turns is None else turns.abandon,
                                         None if turns is None else turns.rank, lambda: asking[0])

    def check_work(self, call: Call, prepared: Prepared) -> None:
        """The work limit for the call's ``prepared`` prompts (each run ``params.n`` times).

        Raises:
            Rejection: 400 ``work_limit``.
        """
        with self.counted(call.tier):
            if prepared:
                prompt_tokens = [len(inputs.prompt_token_ids) for inputs, _ in prepared]
                check_work(prompt_tokens, [params.max_tokens for _, params in prepared], prepared[0][1].n,
                           self.config.admission, call.max_tokens_field)

    def _check_caps(self, tier: Tier, requests: int, tokens: int) -> None:
        """The queue caps for a call of ``requests`` engine requests and ``tokens`` prompt tokens, with the
        calls waiting in the holds counted as queued for their own tier only (held to give way to tighter
        tiers, they must not get those refused).

        Raises:
            Rejection: 429 ``queued_requests`` or ``queued_tokens`` when a cap would be passed.
        """
        held = self.ctx.held() if self.ctx.admission.holds(tier) else (0, 0)
        queued_requests, queued_tokens = self.ctx.holder.client.queued()
        check_queues(queued_requests + held[0], queued_tokens + held[1], requests, tokens, self.config.admission)

    async def hold(self, call: Call, prepared: Prepared, gone: Callable[[], Awaitable[bool]]) -> None:
        """Let a call of the never-refused tier wait, in arrival order, until dispatching it hurts no
        tighter request (:meth:`AdmissionController.hold_reason` on its first prompt) or it has waited
        half its TTFT SLO or half ``api.timeout_ms``, whichever is less, since it arrived (its wait before
        its media work, :meth:`hold_media`, included; then it goes, to still meet that SLO and leave the
        request its time); at once for other tiers, with prediction off, or with nothing to wait for. The
        queue caps of later calls of its tier count it while it waits.

        Raises:
            Rejection: 429 from a queue cap (checked before it waits).
            ConnectionAbortedError: ``gone()`` (its client's disconnect check) said the client left.
            APIError: 503 when the service's drain ends while the call is held (within
                :data:`~mm_serve.admission.dispatch_hold.GONE_POLL_S` seconds; uvicorn would cancel it 5 s later).
        """
        ctx, tier = self.ctx, call.tier
        if not prepared or not ctx.admission.holds(tier):
            return
        with self.counted(tier):  # a call past the caps is refused, not held
            self._check_caps(tier, *prompt_work(prepared))
        inputs, params = prepared[0]
        client = ctx.holder.client

        def ready() -> bool:
            return ctx.admission.hold_reason(client, tier, len(inputs.prompt_token_ids), inputs.num_tiles,
                                             params.max_tokens, inputs) is None

        await ctx.dispatch_hold.wait(ready, *prompt_work(prepared), self._longest_hold(call),
                                     _gone_or_refused(gone, self._refuse_if_stopped))

    def admit(self, call: Call, prepared: Prepared, committed: bool) -> Prediction | None:
        """The queue caps, then the latency prediction, for the call's ``prepared`` prompts (the
        time since its arrival, decoding its images, waiting in the dispatch hold or for a busy front
        end, is part of its TTFT and of the prediction); counts the admission in the tier metrics.
        Returns the prediction of its first request (None when none could be made: a role has no
        ready worker). A ``committed`` call (admitted at its decision deadline) is predicted but not
        refused on it.

        Raises:
            Rejection: 429 from a queue cap or (unless ``committed``) a predicted SLO miss.
        """
        ctx, tier = self.ctx, call.tier
        waited = max(0.0, time.monotonic() - call.arrival)
        with self.counted(tier):
            self._check_caps(tier, *prompt_work(prepared))
            inputs, params = prepared[0]
            prediction = ctx.admission.admit(ctx.holder.client, tier, len(inputs.prompt_token_ids),
                                             inputs.num_tiles, params.max_tokens, inputs, waited,
                                             refuse=not committed, grammar_s=call.grammar_compile_s)
        if ctx.tier_metrics is not None:
            ctx.tier_metrics.observe_admission(tier, None)
        return prediction


def _gone_or_refused(gone: Callable[[], Awaitable[bool]], refuse: Callable[[], None]) -> Callable[[], Awaitable[bool]]:
    """A held call's check: ``refuse()`` (which raises to end the hold with its error), then ``gone()``."""
    async def check() -> bool:
        refuse()
        return await gone()
    return check
