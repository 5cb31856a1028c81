"""Turn a user request (prompt text, token ids or chat messages, plus images and videos) into model inputs.

Each image placeholder (the checkpoint's image token, e.g. ``<image>``) in the
tokenized prompt is expanded to the tokens its image makes, as the llava-hf
processor does; images are prepared by the family's :mod:`~mm_serve.inputs.image_prep`.
A video (families that take them, Qwen2-VL) is one more image to the engine: its
placeholder (the video token) expands to its temporal patches' tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from mm_serve.inputs.image_prep import (
    AnyResImages,
    DynamicResolutionImages,
    FixedSizeImages,
    image_prep,
)
from mm_serve.inputs.prompt_encoding import encode_chat, encode_prompt
from mm_serve.media.offline import normalize_messages, to_pil, to_video
from mm_serve.media.video_loading import Video, VideoLimits
from mm_serve.models.model_config import CheckpointError, ModelConfig

REQUEST_KEYS = frozenset({"prompt", "prompt_token_ids", "messages", "images", "videos", "mm_processor_kwargs",
                          "tools"})
VIDEO_KWARGS = ("fps", "max_frames")  # mm_processor_kwargs that say how a video is sampled
OFFLINE_MAX_VIDEO_FRAMES = 768  # transformers' Qwen2VLVideoProcessor.max_frames


class InvalidRequestError(ValueError):
    """The request cannot be served as given (bad shape, too long, wrong image count, ...); ``param``
    names the request field at fault where it is not the prompt."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class ProcessedInputs:
    """Model-ready inputs of one request."""

    prompt_token_ids: list[int]  # image placeholders expanded
    pixel_values: torch.Tensor | None  # [num_images, 3, H, W] float32, or every image's tiles [sum(tiles), 3, H, W],
    # or (Qwen2-VL) every image's (and video's) patches [sum(t*h*w), C*T*P*P]
    num_images: int
    image_hashes: list[bytes] = field(default_factory=list)  # per image, runtime.page_hashes; [] = not hashed yet
    image_token_counts: list[int] = field(default_factory=list)  # image tokens each image expanded to, in order
    image_tiles: list[int] = field(default_factory=list)  # rows of pixel_values per image ([]: one each)
    # per image, what its features need: LLaVA-NeXT its original (height, width) in pixels, Qwen2-VL its patch
    # grid (h, w), a video's (t, h, w)
    image_sizes: list[tuple[int, ...]] = field(default_factory=list)
    # per image, seconds of video one temporal patch spans (0: a still image; []: no video); Qwen2.5-VL's M-RoPE
    image_second_per_grid: list[float] = field(default_factory=list)
    cache_salt: bytes = b""  # runtime.page_hashes.request_salt of the request's cache_salt; b"": shared caches

    @property
    def tiles_per_image(self) -> list[int]:
        """Tower passes of each image: its tiles, or one where the family does not tile."""
        return self.image_tiles if self.image_tiles else [1] * self.num_images

    @property
    def num_tiles(self) -> int:
        """Tower passes of all the request's images: the encode work admission prices (a LLaVA-NeXT image
        at full detail is its whole-image tile and its grid's; at ``low`` one)."""
        return sum(self.tiles_per_image)


def load_tokenizer(model_dir: str | Path) -> Any:
    """The checkpoint's tokenizer via ``transformers.AutoTokenizer`` (offline).

    Raises:
        CheckpointError: the directory has no usable tokenizer files: none load, or what loads encodes text
            as nothing (transformers builds an empty tokenizer of the config's class when its files are gone).
    """
    from transformers import AutoTokenizer

    needs = "a checkpoint directory needs tokenizer.json or tokenizer.model with tokenizer_config.json"
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError, KeyError, RecursionError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{model_dir}: cannot load the tokenizer ({first[:300]}); {needs}") from None
    if not tokenizer.encode("Hello world", add_special_tokens=False):
        raise CheckpointError(f"{model_dir}: the tokenizer has no vocabulary ({len(tokenizer)} token(s): it encodes "
                              f"text as nothing); {needs}")
    return tokenizer


def _check_chat_template(model_dir: str | Path, tokenizer: Any) -> None:
    """Render a one-message chat with the checkpoint's chat template, if it has one, so that a template
    that does not compile stops the start instead of failing every chat call.

    Raises:
        CheckpointError: the template is not valid Jinja (``jinja2.TemplateSyntaxError``). A template that
            compiles but raises for this chat (one that wants a system message, say) is left to the calls.
    """
    import jinja2

    if not getattr(tokenizer, "chat_template", None):
        return
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    except jinja2.TemplateSyntaxError as exc:
        raise CheckpointError(f"{model_dir}: the chat template is not valid Jinja (line {exc.lineno}: {exc.message})") from None
    except Exception:  # noqa: BLE001 - the template's own exceptions and checks: a call's 400 names them
        pass


class InputProcessor:
    """Tokenizes, renders chat templates, preprocesses images and expands image tokens."""

    def __init__(self, model_dir: str | Path, config: ModelConfig, tokenizer: Any | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_dir)
        _check_chat_template(model_dir, self.tokenizer)
        self.image_processor: FixedSizeImages | AnyResImages | DynamicResolutionImages | None = None
        if config.vision is not None:
            try:
                self.image_processor = image_prep(model_dir, config.model_type, config.vision)
            except (OSError, ValueError, KeyError, RecursionError) as exc:  # a preprocessor config unread or not JSON
                raise CheckpointError(f"{model_dir}: cannot load the image processor ({str(exc).strip()[:300]})") from None

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """End-of-sequence ids: the checkpoint's ``eos_token_id`` (one or a list) and the tokenizer's."""
        eos = set(self.config.text.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        return frozenset(eos)

    @staticmethod
    def check_context(num_prompt_tokens: int, max_tokens: int, limit: int) -> None:
        """Refuse a request whose prompt plus ``max_tokens`` exceeds ``limit`` tokens (the engine's
        :meth:`~mm_serve.runtime.engine_config.EngineConfig.context_limit`).

        Raises:
            InvalidRequestError: over the limit (both numbers in the message).
        """
        total = num_prompt_tokens + max_tokens
        if total > limit:
            raise InvalidRequestError(
                f"prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) is {total} "
                f"tokens, over this model's context length of {limit} tokens"
            )

    @property
    def image_token_index(self) -> int | None:
        return None if self.config.vision is None else self.config.vision.image_token_index

    @property
    def image_token(self) -> str | None:
        """The placeholder string users put in a raw prompt, once per image."""
        index = self.image_token_index
        return None if index is None else str(self.tokenizer.convert_ids_to_tokens(index))

    @property
    def video_token(self) -> str | None:
        """The video placeholder string (None: the model takes no video)."""
        index = None if self.config.vision is None else self.config.vision.video_token_index
        return None if index is None else str(self.tokenizer.convert_ids_to_tokens(index))

    def render_chat(self, messages: list[dict[str, Any]], video_limits: VideoLimits | None = None,
                    tools: list[dict[str, Any]] | None = None,
                    ) -> tuple[str, list[Image.Image | Video], list[str], list[str | None]]:
        """Render ``messages`` with the chat template; returns the prompt, the images and videos in order,
        the user messages' text parts in order (tokenized as text, :mod:`prompt_encoding`), and each
        image's ``detail`` (``low`` | ``high`` | ``auto``; None when not given; None for a video).

        Image parts are ``{"type": "image", "image": X}`` or ``{"type": "image_url", "image_url":
        {"url": X}}`` with ``X`` a PIL image, a path, bytes or a data URI; video parts ``{"type": "video",
        "video": V}`` or ``{"type": "video_url", ...}`` (:mod:`mm_serve.media.offline`), sampled under
        ``video_limits``. ``tools`` (OpenAI's ``tools``) go to the template as Hugging Face templates take them.

        Raises:
            InvalidRequestError: malformed messages, an unknown part type, an unusable image or video.
        """
        try:
            messages, media = normalize_messages(messages, video_limits)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        try:
            prompt = self.tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                                        tokenize=False)
        except Exception as exc:  # jinja errors, missing template
            raise InvalidRequestError(f"cannot render chat template: {exc}") from None
        details = [p.get("detail") for m in messages if isinstance(m.get("content"), list)
                   for p in m["content"] if p.get("type") in ("image", "video")]
        return str(prompt), media, _user_texts(messages), details

    def process(self, request: dict[str, Any]) -> ProcessedInputs:
        """Process ``{"prompt"| "prompt_token_ids"| "messages": ..., "images": [...], "videos": [...],
        "mm_processor_kwargs": {...}}``. A raw prompt's image (video) placeholders take the request's
        ``images`` (``videos``) in order; a chat's take its parts', then those lists'.

        Raises:
            InvalidRequestError: no prompt, token ids out of range, images or videos given to a model that
                does not take them, an image or video count != its placeholder count, bad
                ``mm_processor_kwargs``, or a key not in :data:`REQUEST_KEYS`.
        """
        if not isinstance(request, dict):
            raise InvalidRequestError(f"a request must be a dict (or a prompt string), not {type(request).__name__}")
        unknown = sorted(set(map(str, request)) - REQUEST_KEYS)
        if unknown:  # a misspelt key would otherwise be dropped without a word
            raise InvalidRequestError(f"unknown request key(s) {', '.join(map(repr, unknown))}; a request takes "
                                      f"{', '.join(sorted(REQUEST_KEYS))}")
        kwargs = request.get("mm_processor_kwargs") or {}
        bounds = self._pixel_bounds({k: v for k, v in kwargs.items() if k not in VIDEO_KWARGS}
                                    if isinstance(kwargs, dict) else kwargs)
        limits = self.video_limits(kwargs, VideoLimits(max_frames=OFFLINE_MAX_VIDEO_FRAMES))
        try:
            images: list[Image.Image | Video] = [to_pil(image) for image in request.get("images") or []]
            images += [to_video(video, limits) for video in request.get("videos") or []]
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        details: list[str | None] = []
        if "messages" in request:
            prompt, chat_media, user_texts, details = self.render_chat(request["messages"], limits,
                                                                       request.get("tools"))
            images = chat_media + images
            ids = encode_chat(self.tokenizer, prompt, user_texts)
        elif "prompt_token_ids" in request:
            ids = [int(t) for t in request["prompt_token_ids"]]
        elif "prompt" in request:
            ids = encode_prompt(self.tokenizer, request["prompt"])
        else:
            raise InvalidRequestError("request needs 'prompt', 'prompt_token_ids' or 'messages'")
        if not ids:
            raise InvalidRequestError("prompt is empty")
        vocab = self.config.text.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        details += [None] * (len(images) - len(details))  # the request's "images" list: auto
        return self._with_images(ids, images, details, bounds)

    def video_limits(self, kwargs: Any, base: VideoLimits) -> VideoLimits:
        """``base`` with the ``fps`` and ``max_frames`` of ``mm_processor_kwargs`` (vLLM's names) where given.

        Raises:
            InvalidRequestError: ``fps`` not a number > 0 (at most 60), ``max_frames`` not an integer in
                ``[1, base.max_frames]``, or either given to a model that takes no video.
        """
        given = {k: kwargs[k] for k in VIDEO_KWARGS if isinstance(kwargs, dict) and k in kwargs}
        if not given:
            return base
        where = "mm_processor_kwargs"
        if self.config.vision is None or self.config.vision.video_token_index is None:
            raise InvalidRequestError("mm_processor_kwargs fps and max_frames apply to models that take video "
                                      "(Qwen2-VL); this model does not", where)
        fps, frames = given.get("fps", base.fps), given.get("max_frames", base.max_frames)
        if isinstance(fps, bool) or not isinstance(fps, int | float) or not 0 < fps <= 60:
            raise InvalidRequestError(f"mm_processor_kwargs fps must be a number in (0, 60], got {fps!r}", where)
        if isinstance(frames, bool) or not isinstance(frames, int) or not 1 <= frames <= base.max_frames:
            raise InvalidRequestError(f"mm_processor_kwargs max_frames must be an integer in [1, {base.max_frames}] "
                                      f"(the most this server samples from a video), got {frames!r}", where)
        return replace(base, fps=float(fps), max_frames=frames)

    def _pixel_bounds(self, kwargs: Any) -> tuple[int, int] | None:
        """The (min, max) pixels of ``mm_processor_kwargs`` (vLLM's name), the checkpoint's where one is
        absent; None when not given.

        Raises:
            InvalidRequestError: not a dict of ``min_pixels`` / ``max_pixels`` integers, a family whose
                images are not resized to pixel bounds, or bounds outside the checkpoint's.
        """
        if not kwargs:
            return None
        where = "mm_processor_kwargs"
        if not isinstance(kwargs, dict) or set(kwargs) - {"min_pixels", "max_pixels"} or any(
                isinstance(v, bool) or not isinstance(v, int) for v in kwargs.values()):
            raise InvalidRequestError("mm_processor_kwargs takes min_pixels and max_pixels, integers (and, for "
                                      "video, fps and max_frames)", where)
        vision = self.config.vision
        if vision is None or not vision.dynamic_resolution:
            raise InvalidRequestError("mm_processor_kwargs (min_pixels, max_pixels) applies to models that resize "
                                      "each image within pixel bounds (Qwen2-VL); this model's images are not", where)
        low, high = vision.pixel_bounds
        bounds = (int(kwargs.get("min_pixels", low)), int(kwargs.get("max_pixels", high)))
        if not low <= bounds[0] <= bounds[1] <= high:
            raise InvalidRequestError(f"mm_processor_kwargs asks for {bounds[0]} to {bounds[1]} pixels per image; "
                                      f"this model takes {low} to {high} (and min_pixels <= max_pixels)", where)
        return bounds

    def _with_images(self, ids: list[int], media: list[Image.Image | Video], details: list[str | None],
                     pixel_bounds: tuple[int, int] | None = None) -> ProcessedInputs:
        """Expand each placeholder of ``ids`` to its image's (video's) tokens; the images and videos are
        matched to the image and video placeholders in order, each kind on its own."""
        vision = self.config.vision
        images = [(m, d) for m, d in zip(media, details, strict=True) if not isinstance(m, Video)]
        videos = [m for m in media if isinstance(m, Video)]
        image_id = None if vision is None else vision.image_token_index
        video_id = None if vision is None else vision.video_token_index
        if images and (self.image_processor is None or image_id is None):
            raise InvalidRequestError("this model is text-only; it does not take images")
        if videos and video_id is None:
            raise InvalidRequestError("this model does not take video (video input is served for Qwen2-VL and "
                                      "Qwen2.5-VL checkpoints)")
        checks: list[tuple[str, int | None, int, str | None]] = [
            ("image", image_id, len(images), self.image_token), ("video", video_id, len(videos), self.video_token)]
        for kind, index, given, shown in checks:
            found = 0 if index is None else ids.count(index)
            if found != given:
                raise InvalidRequestError(f"prompt has {found} {kind} placeholder(s) ({shown}) but {given} "
                                          f"{kind}(s) were given")
        if not media or self.image_processor is None or vision is None:
            return ProcessedInputs(ids, None, 0)
        queues: dict[int | None, Iterator[tuple[Image.Image | Video, str | None]]] = {
            image_id: iter(images), video_id: iter((v, None) for v in videos)}
        ordered = [next(queues[t]) for t in ids if t in queues]  # in prompt order
        items = [m for m, _ in ordered]
        item_details = [d for _, d in ordered]
        if pixel_bounds is not None:
            assert isinstance(self.image_processor, DynamicResolutionImages)
            prepared = self.image_processor(items, item_details, pixel_bounds)
        else:
            prepared = self.image_processor(items, item_details)  # type: ignore[arg-type]
        counts = iter(prepared.token_counts)
        expanded: list[int] = []
        for token in ids:
            expanded.extend([token] * next(counts) if token in queues else [token])
        return ProcessedInputs(expanded, prepared.pixel_values, len(items), image_token_counts=prepared.token_counts,
                               image_tiles=prepared.tiles, image_sizes=prepared.sizes,
                               image_second_per_grid=prepared.second_per_grid)


def _user_texts(messages: list[dict[str, Any]]) -> list[str]:
    """Text of the user messages' content (strings and text parts), in order."""
    out: list[str] = []
    for message in messages:
        if message.get("role") != "user":
            continue
        content = message.get("content")
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            out.extend(str(p.get("text", "")) for p in content if p.get("type") == "text")
    return out
