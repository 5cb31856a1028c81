"""Images handed to the offline API (``LLM.generate``): PIL images, files, bytes, data URIs.

The HTTP API fetches and decodes ``image_url`` parts itself (:mod:`mm_serve.media.fetch`);
the offline API accepts the same chat content parts without any network access:
``{"type": "image", "image": X}`` and ``{"type": "image_url", "image_url": {"url": X}}``
(or ``"image_url": X``), where ``X`` is a ``PIL.Image.Image``, a ``data:image/...;base64,``
URI, a local file path (``str`` / ``pathlib.Path``, or a ``file://`` URL) or the encoded
bytes of an image. ``http(s)`` URLs are refused: fetch them yourself.

Videos (models that take them, Qwen2-VL): ``{"type": "video", "video": V}`` and
``{"type": "video_url", "video_url": {"url": V}}``, ``V`` a path, ``file://`` URL, ``data:video/...;base64,``
URI or encoded bytes (decoded and sampled by :func:`~mm_serve.media.video_loading.load_video_bytes`), a
:class:`~mm_serve.media.video_loading.Video`, or a list of PIL frames already sampled (at the part's
``fps``, default 2).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from PIL import Image

from mm_serve.media.errors import ImageError
from mm_serve.media.image_loading import decode_data_uri, load_image_bytes, load_image_file, to_rgb
from mm_serve.media.video_loading import (
    Video,
    VideoLimits,
    decode_video_data_uri,
    load_video_bytes,
    load_video_file,
)

OFFLINE_MAX_PIXELS = 40_000_000  # the HTTP API's default ``api.max_image_pixels``
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")  # as the server's request schema
TEXT_PART_TYPES = ("text",)
IMAGE_PART_TYPES = ("image", "image_url")
VIDEO_PART_TYPES = ("video", "video_url")
IMAGE_DETAILS = (None, "auto", "low", "high")  # OpenAI's image_url detail: low = the whole image only, on tiling families


def to_pil(value: Any, max_pixels: int = OFFLINE_MAX_PIXELS) -> Image.Image:
    """An image from any of the accepted forms (module docstring).

    Raises:
        ValueError: a form that is not accepted, or an image that cannot be read or
            decoded (:class:`mm_serve.media.errors.ImageError` messages).
    """
    if isinstance(value, Image.Image):
        try:
            value.load()  # Image.open reads the header only: a truncated file fails here, not in the processor
        except (OSError, SyntaxError, ValueError) as exc:  # Pillow's decoders raise all three
            raise ValueError(f"image: the PIL image cannot be decoded: {exc}") from None
        if value.width < 1 or value.height < 1:
            raise ValueError(f"image: the PIL image is empty ({value.width}x{value.height} px)")
        return value
    try:
        if isinstance(value, bytes | bytearray):
            return load_image_bytes(bytes(value), max_pixels=max_pixels)
        if isinstance(value, os.PathLike):
            return load_image_file(value, max_pixels=max_pixels)
        if isinstance(value, str):
            text = value.strip()
            if text[:5].lower() == "data:":
                return decode_data_uri(text, max_pixels=max_pixels)
            if text.lower().startswith(("http://", "https://")):
                raise ValueError("the offline API does not fetch http(s) images; pass a PIL image, a path or a data URI")
            path = text[7:] if text.lower().startswith("file://") else text
            return load_image_file(path, max_pixels=max_pixels)
    except ImageError as exc:
        raise ValueError(f"image: {exc}") from None
    except OSError as exc:
        raise ValueError(f"image: cannot read {value!r}: {exc.strerror or exc}") from None
    raise ValueError(f"an image must be a PIL image, a file path, a data URI or bytes, not {type(value).__name__}")


def to_video(value: Any, limits: VideoLimits, fps: Any = None) -> Video:
    """A video from any of the accepted forms (module docstring); a list of frames is taken as sampled
    at ``fps`` frames per second (default ``limits.fps``).

    Raises:
        ValueError: a form that is not accepted, or a video that cannot be read, decoded or sampled
            within ``limits``.
    """
    if isinstance(value, Video):
        return value
    try:
        if isinstance(value, list | tuple) and value and all(isinstance(f, Image.Image) for f in value):
            rgb = [to_rgb(frame) for frame in value]
            if len({frame.size for frame in rgb}) > 1:
                raise ValueError("a video's frames must all have one size")
            rate = limits.fps if fps is None else fps
            if isinstance(rate, bool) or not isinstance(rate, int | float) or not rate > 0:
                raise ValueError(f"a video part's fps must be a number > 0, got {rate!r}")
            return Video(np.stack([np.asarray(frame) for frame in rgb]), float(rate))
        if isinstance(value, bytes | bytearray):
            return load_video_bytes(bytes(value), limits)
        if isinstance(value, os.PathLike):
            return load_video_file(value, limits)
        if isinstance(value, str):
            text = value.strip()
            if text[:5].lower() == "data:":
                return decode_video_data_uri(text, limits)
            if text.lower().startswith(("http://", "https://")):
                raise ValueError("the offline API does not fetch http(s) videos; pass a path, bytes or a data URI")
            return load_video_file(text[7:] if text.lower().startswith("file://") else text, limits)
    except ImageError as exc:
        raise ValueError(f"video: {exc}") from None
    except OSError as exc:
        raise ValueError(f"video: cannot read {value!r}: {exc.strerror or exc}") from None
    if isinstance(value, list | tuple):
        raise ValueError("a video given as a list must be a non-empty list of PIL images (its frames)")
    raise ValueError(f"a video must be a file path, a data URI, bytes, a Video or a list of PIL frames, not "
                     f"{type(value).__name__}")


def image_outside_user_message(number: int, role: object, what: str = "an image") -> str:
    """The refusal of an image (or video) part in message ``number`` whose role is ``role`` (not ``user``)."""
    noun = "videos" if what == "a video" else "images"
    return f"{noun} are accepted only in user messages; message {number} (role {role!r}) has {what} part"


def normalize_messages(messages: Any, video_limits: VideoLimits | None = None
                       ) -> tuple[list[dict[str, Any]], list[Image.Image | Video]]:
    """Chat ``messages`` with every image part as ``{"type": "image", "image": PIL.Image}`` and every video
    part as ``{"type": "video", "video": Video}`` (what the chat templates count), and the images and
    videos in order (videos decoded and sampled under ``video_limits``, default :class:`VideoLimits`).

    Raises:
        ValueError: ``messages`` is not a non-empty list of ``{"role", "content"}`` dicts, a
            content part has an unknown type, an image is in a message whose role is not
            ``user`` (chat templates render images in user turns only), or an image cannot be used.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list of {'role', 'content'} dicts")
    images: list[Image.Image | Video] = []
    out: list[dict[str, Any]] = []
    for number, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError("each message must be a dict with 'role' and 'content'")
        if message["role"] not in CHAT_ROLES:  # the server's schema takes these only
            raise ValueError(f"message {number}: role {message['role']!r} is not one of {', '.join(CHAT_ROLES)}")
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in TEXT_PART_TYPES:
                parts.append(part)
            elif kind in IMAGE_PART_TYPES:
                if message["role"] != "user":
                    raise ValueError(image_outside_user_message(number, message["role"]))
                raw = part.get("image") if kind == "image" else part.get("image_url")
                detail = part.get("detail")
                if isinstance(raw, dict):
                    detail = raw.get("detail", detail)
                    raw = raw.get("url")
                if detail not in IMAGE_DETAILS:
                    raise ValueError(f"an image's detail must be one of low, high, auto, got {detail!r}")
                image = to_pil(raw)
                images.append(image)
                parts.append({"type": "image", "image": image, **({"detail": detail} if detail else {})})
            elif kind in VIDEO_PART_TYPES:
                if message["role"] != "user":
                    raise ValueError(image_outside_user_message(number, message["role"], "a video"))
                raw = part.get("video") if kind == "video" else part.get("video_url")
                if isinstance(raw, dict):
                    raw = raw.get("url")
                video = to_video(raw, video_limits or VideoLimits(), part.get("fps"))
                images.append(video)
                parts.append({"type": "video", "video": video})
            else:
                raise ValueError(f"unsupported content part type {kind!r}; use 'text', 'image', 'image_url', "
                                 "'video' or 'video_url'")
        out.append({**message, "content": parts})
    return out, images
