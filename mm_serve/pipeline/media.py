"""A call's media work: fetch and decode its images and videos, render and tokenize its prompts.

Runs off the event loop where it is heavy (decoding, tokenizing and preprocessing in a thread; fetches
are async), and enforces ``api.max_images_per_request``, ``api.max_videos_per_request``, the video
limits and ``api.max_request_length``.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

from mm_serve.config import APIConfig
from mm_serve.inputs.input_processor import InputProcessor, InvalidRequestError, ProcessedInputs
from mm_serve.media.errors import ImageError
from mm_serve.media.fetch import MediaPolicy, load_media_urls
from mm_serve.media.media_runner import RunCPU
from mm_serve.media.video_loading import Reserve, VideoError, VideoLimits
from mm_serve.pipeline.call import check_text_chars
from mm_serve.pipeline.chat_prompt import ChatPrompt
from mm_serve.protocol.errors import bad_request

MAX_STREAM_FPS = 60  # a video may hold this many frames per second of api.max_video_seconds (a frame bomb: more)


def media_policy(api: APIConfig) -> MediaPolicy:
    """The image-fetch policy of the service."""
    return MediaPolicy(
        max_pixels=api.max_image_pixels, max_fetch_bytes=api.max_image_fetch_bytes,
        fetch_timeout_s=api.image_fetch_timeout_s,
        allowed_local_media_path=Path(api.allowed_local_media_path) if api.allowed_local_media_path else None,
        allowed_media_domains=tuple(api.allowed_media_domains),
    )


def video_policy(api: APIConfig) -> MediaPolicy:
    """The video-fetch policy: the image policy's rules with ``api.max_video_fetch_bytes``."""
    return replace(media_policy(api), max_fetch_bytes=api.max_video_fetch_bytes, kind="video")


def video_limits(api: APIConfig) -> VideoLimits:
    """How the service decodes and samples a video unless a request says otherwise (``mm_processor_kwargs``)."""
    return VideoLimits(fps=api.video_fps, max_frames=api.max_video_frames, max_seconds=api.max_video_seconds,
                       max_frame_pixels=api.max_video_frame_pixels,
                       max_stream_frames=max(1, round(api.max_video_seconds * MAX_STREAM_FPS)))


def check_image_count(prompt: ChatPrompt, api: APIConfig) -> None:
    """Raises:
        APIError: 400 ``too_many_images`` past ``api.max_images_per_request`` (``too_many_videos`` past
            ``api.max_videos_per_request``)."""
    videos = prompt.num_videos
    images = len(prompt.images) - videos
    if images > api.max_images_per_request:
        raise bad_request(f"{images} images in one request; the limit is {api.max_images_per_request} "
                          "(api.max_images_per_request)", "messages", "too_many_images")
    if videos > api.max_videos_per_request:
        raise bad_request(f"{videos} videos in one request; the limit is {api.max_videos_per_request} "
                          "(api.max_videos_per_request)", "messages", "too_many_videos")


async def chat_request(prompt: ChatPrompt, api: APIConfig, limits: VideoLimits | None = None,
                       reserve: Reserve | None = None, takes_video: bool = True,
                       takes_images: bool = True, run: RunCPU = asyncio.to_thread) -> dict[str, Any]:
    """The input processor's request for a chat call: its messages with the images and videos loaded (videos
    sampled under ``limits``, default :func:`video_limits`, each giving ``reserve`` the bytes its decoding
    holds; their decoding run by ``run``).

    Raises:
        APIError: 400 for too many images or videos, an image or video to a model that takes none (before
            it is fetched), or one that cannot be loaded.
    """
    check_image_count(prompt, api)
    if len(prompt.images) > prompt.num_videos and not takes_images:
        raise bad_request("this model is text-only; it does not take images", "messages", "invalid_image")
    if prompt.num_videos and not takes_video:
        raise bad_request("this model does not take video (video input is served for Qwen2-VL and Qwen2.5-VL "
                          "checkpoints)", "messages", "invalid_video")
    limits = limits or video_limits(api)
    items = [(image.url, limits if image.is_video else None) for image in prompt.images]
    try:
        loaded = await load_media_urls(items, media_policy(api), video_policy(api), reserve=reserve,
                                       run=run) if items else []
    except VideoError as exc:
        raise bad_request(str(exc), "messages", "invalid_video") from None
    except ImageError as exc:
        raise bad_request(str(exc), "messages", "invalid_image") from None
    return {"messages": prompt.template_messages(loaded)}


async def process_inputs(inputs: InputProcessor, request: dict[str, Any], text_chars: int,
                         max_request_length: int, run: RunCPU = asyncio.to_thread) -> ProcessedInputs:
    """Tokenize and preprocess ``request`` (with ``text_chars`` characters of text) off the event
    loop (with ``run``); enforce ``api.max_request_length``.

    Raises:
        APIError: 400 for an invalid prompt or one over the prompt cap.
    """
    param = "messages" if "messages" in request else "prompt"
    check_text_chars(text_chars, max_request_length, param)
    try:
        processed = await run(inputs.process, request)
    except InvalidRequestError as exc:
        raise bad_request(str(exc), exc.param or param) from None
    except VideoError as exc:  # the processor refused a video (e.g. Qwen2-VL's aspect ratio over 200)
        raise bad_request(str(exc), param, "invalid_video") from None
    except ImageError as exc:  # the processor refused an image (e.g. Qwen2-VL's aspect ratio over 200)
        raise bad_request(str(exc), param, "invalid_image") from None
    except (TypeError, UnicodeError):  # e.g. lone surrogates the tokenizer cannot encode
        raise bad_request(
            "the prompt text cannot be tokenized: it holds characters that are not valid Unicode "
            "(such as an unpaired UTF-16 surrogate escape like \\ud800)", param,
        ) from None
    n = len(processed.prompt_token_ids)
    if n > max_request_length:
        raise bad_request(
            f"the prompt has {n} tokens (image tokens included); the limit is {max_request_length} "
            "(api.max_request_length)", param, "context_length_exceeded",
        )
    return processed
