"""Turn OpenAI request bodies into engine inputs and sampling parameters (validating as it goes)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from PIL import Image

from mm_serve.api.errors import APIError, bad_request
from mm_serve.api.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
from mm_serve.config import APIConfig
from mm_serve.inputs.input_processor import InputProcessor, InvalidRequestError, ProcessedInputs
from mm_serve.media.errors import ImageError
from mm_serve.media.fetch import MediaPolicy, load_image_urls
from mm_serve.media.offline import image_outside_user_message
from mm_serve.runtime.sampling_params import MAX_SEED, SamplingParams


def media_policy(api: APIConfig) -> MediaPolicy:
    """The image-fetch policy of the service."""
    return MediaPolicy(
        max_pixels=api.max_image_pixels, max_fetch_bytes=api.max_image_fetch_bytes,
        fetch_timeout_s=api.image_fetch_timeout_s,
        allowed_local_media_path=Path(api.allowed_local_media_path) if api.allowed_local_media_path else None,
        allowed_media_domains=tuple(api.allowed_media_domains),
    )


async def chat_messages(messages: list[ChatMessage], api: APIConfig) -> list[dict[str, Any]]:
    """Template-ready messages with images loaded (``{"type": "image", "image": PIL.Image}`` parts).

    Raises:
        APIError: 400 for an image outside a user message (before any image is fetched), too many
            images, or an image that cannot be loaded.
    """
    for number, message in enumerate(messages):
        if message.role != "user" and isinstance(message.content, list) and any(
                part.type == "image_url" for part in message.content):
            # the engine refuses these too (media.offline.normalize_messages); say so before fetching
            raise bad_request(image_outside_user_message(number, message.role), "messages")
    urls = [part.image_url.url for m in messages if isinstance(m.content, list)
            for part in m.content if part.type == "image_url"]
    if len(urls) > api.max_images_per_request:
        raise bad_request(f"{len(urls)} images in one request; the limit is {api.max_images_per_request}",
                          "messages", "too_many_images")
    try:
        images: list[Image.Image] = await load_image_urls(urls, media_policy(api)) if urls else []
    except ImageError as exc:
        raise bad_request(str(exc), "messages", "invalid_image") from None
    out: list[dict[str, Any]] = []
    index = 0
    for message in messages:
        role = "system" if message.role == "developer" else message.role
        if message.content is None or isinstance(message.content, str):
            out.append({"role": role, "content": message.content or ""})
            continue
        parts: list[dict[str, Any]] = []
        for part in message.content:
            if part.type == "text":
                parts.append({"type": "text", "text": part.text})
            else:
                parts.append({"type": "image", "image": images[index]})
                index += 1
        out.append({"role": role, "content": parts})
    return out


def engine_seed(seed: int | None) -> int | None:
    """The engine seed of an API ``seed`` (any signed 64-bit integer).

    Choice ``i`` of ``n`` (at most 16) draws with seed + ``i``, which must stay within
    ``MAX_SEED``: seeds in ``[0, MAX_SEED - 15]`` are used as they are, others wrap modulo
    ``MAX_SEED - 14`` (so ``-1`` and ``MAX_SEED - 15`` draw alike).
    """
    return None if seed is None else seed % (MAX_SEED - 14)


def sampling_params(body: ChatCompletionRequest | CompletionRequest, prompt_len: int, context_len: int,
                    logprobs: int | None, vocab_size: int) -> SamplingParams:
    """Sampling parameters; ``max_tokens`` defaults to the rest of the context (as vLLM).

    Raises:
        APIError: 400 when prompt plus ``max_tokens`` exceeds the context (both numbers given), or a
            ``stop_token_ids`` entry is outside ``[0, vocab_size)``.
    """
    max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
    if max_tokens is None:
        max_tokens = max(1, context_len - prompt_len)  # a prompt that fills the context has no room: refused below
    if prompt_len + max_tokens > context_len:
        raise bad_request(
            f"this model's context length is {context_len} tokens; the prompt has {prompt_len} tokens "
            f"(image tokens included) and max_tokens is {max_tokens}, {prompt_len + max_tokens} in all",
            "max_tokens", "context_length_exceeded",
        )
    stop = body.stop if isinstance(body.stop, list) else ([body.stop] if body.stop else [])
    if any(not s for s in stop):
        raise bad_request("stop strings must be non-empty", "stop")
    stop_ids = body.stop_token_ids or []
    bad_ids = [t for t in stop_ids if not 0 <= t < vocab_size]
    if bad_ids:
        raise bad_request(f"stop_token_ids must be token ids in [0, {vocab_size}) (the vocabulary), got {bad_ids[:5]}",
                          "stop_token_ids")
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_k=max(0, body.top_k or 0),
            seed=engine_seed(body.seed), stop=tuple(stop), stop_token_ids=tuple(stop_ids), ignore_eos=body.ignore_eos, logprobs=logprobs, n=body.n,
        )
    except ValueError as exc:
        raise bad_request(str(exc)) from None


async def process_inputs(inputs: InputProcessor, request: dict[str, Any], max_request_length: int) -> ProcessedInputs:
    """Tokenize and preprocess off the event loop; enforce ``api.max_request_length``.

    Raises:
        APIError: 400 for an invalid prompt or one over the prompt cap.
    """
    param = "messages" if "messages" in request else "prompt"
    chars = _text_chars(request)
    if chars > max_request_length * MAX_CHARS_PER_TOKEN:
        raise bad_request(
            f"the prompt has {chars} characters, more than api.max_request_length ({max_request_length} tokens) "
            f"can hold at {MAX_CHARS_PER_TOKEN} characters per token", param, "context_length_exceeded",
        )
    try:
        processed = await asyncio.to_thread(inputs.process, request)
    except (InvalidRequestError, ImageError) as exc:
        raise bad_request(str(exc), param) from None
    except (TypeError, UnicodeError):  # e.g. lone surrogates the tokenizer cannot encode
        raise bad_request(
            "the prompt text cannot be tokenized: it holds characters that are not valid Unicode "
            "(such as an unpaired UTF-16 surrogate escape like \\ud800)", param,
        ) from None
    n = len(processed.prompt_token_ids)
    if n > max_request_length:
        raise bad_request(
            f"the prompt has {n} tokens (image tokens included); the limit is {max_request_length} "
            "(api.max_request_length)", "messages" if "messages" in request else "prompt", "context_length_exceeded",
        )
    return processed


MAX_CHARS_PER_TOKEN = 32  # a cheap bound checked before tokenizing (no tokenizer yields fewer tokens)


def _text_chars(request: dict[str, Any]) -> int:
    """Characters of prompt text in a processed-request dict (before tokenizing)."""
    if isinstance(request.get("prompt"), str):
        return len(request["prompt"])
    total = 0
    for message in request.get("messages", []):
        content = message.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(p.get("text", "")) for p in content if p.get("type") == "text")
    return total


def check_model(requested: str, served: str, model_dir: str) -> None:
    """404 unless ``requested`` names the served model."""
    if requested not in (served, model_dir):
        raise APIError(404, f"the model '{requested}' does not exist; this server serves '{served}'",
                       "not_found_error", "model", "model_not_found")
