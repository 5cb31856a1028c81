"""Turn a user request (prompt text, token ids or chat messages, plus images) into model inputs.

Each image placeholder (the checkpoint's image token, e.g. ``<image>``) in the
tokenized prompt is expanded to ``num_image_tokens`` copies, as the llava-hf
processor does; images are converted and normalised by :class:`ImageProcessor`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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
from mm_serve.media.offline import normalize_messages, to_pil
from mm_serve.models.model_config import CheckpointError, ModelConfig

REQUEST_KEYS = frozenset({"prompt", "prompt_token_ids", "messages", "images", "mm_processor_kwargs"})


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
    # or (Qwen2-VL) every image's patches [sum(h*w), C*T*P*P]
    num_images: int
    image_hashes: list[bytes] = field(default_factory=list)  # per image, runtime.page_hashes; [] = not hashed yet
    image_token_counts: list[int] = field(default_factory=list)  # image tokens each image expanded to, in order
    image_tiles: list[int] = field(default_factory=list)  # rows of pixel_values per image ([]: one each)
    # per image, what its features need: LLaVA-NeXT its original (height, width) in pixels, Qwen2-VL its patch grid
    image_sizes: list[tuple[int, int]] = field(default_factory=list)

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
        CheckpointError: the directory has no usable tokenizer files.
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{model_dir}: cannot load the tokenizer ({first[:300]}); a checkpoint directory "
                              "needs tokenizer.json or tokenizer.model with tokenizer_config.json") from None


class InputProcessor:
    """Tokenizes, renders chat templates, preprocesses images and expands image tokens."""

    def __init__(self, model_dir: str | Path, config: ModelConfig, tokenizer: Any | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_dir)
        self.image_processor: FixedSizeImages | AnyResImages | DynamicResolutionImages | None = None
        if config.vision is not None:
            self.image_processor = image_prep(model_dir, config.model_type, config.vision)

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

    def render_chat(self, messages: list[dict[str, Any]]) -> tuple[str, list[Image.Image], list[str], list[str | None]]:
        """Render ``messages`` with the chat template; returns the prompt, the images in order,
        the user messages' text parts in order (tokenized as text, :mod:`prompt_encoding`), and each
        image's ``detail`` (``low`` | ``high`` | ``auto``; None when not given).

        Image parts are ``{"type": "image", "image": X}`` or ``{"type": "image_url", "image_url":
        {"url": X}}`` with ``X`` a PIL image, a path, bytes or a data URI (:mod:`mm_serve.media.offline`).

        Raises:
            InvalidRequestError: malformed messages, an unknown part type, an unusable image.
        """
        try:
            messages, images = normalize_messages(messages)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        try:
            prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # jinja errors, missing template
            raise InvalidRequestError(f"cannot render chat template: {exc}") from None
        details = [p.get("detail") for m in messages if isinstance(m.get("content"), list)
                   for p in m["content"] if p.get("type") == "image"]
        return str(prompt), images, _user_texts(messages), details

    def process(self, request: dict[str, Any]) -> ProcessedInputs:
        """Process ``{"prompt"| "prompt_token_ids"| "messages": ..., "images": [...]}``.

        Raises:
            InvalidRequestError: no prompt, token ids out of range, images given to a
                text-only model, image count != placeholder count, or a key not in :data:`REQUEST_KEYS`.
        """
        if not isinstance(request, dict):
            raise InvalidRequestError(f"a request must be a dict (or a prompt string), not {type(request).__name__}")
        unknown = sorted(set(map(str, request)) - REQUEST_KEYS)
        if unknown:  # a misspelt key would otherwise be dropped without a word
            raise InvalidRequestError(f"unknown request key(s) {', '.join(map(repr, unknown))}; a request takes "
                                      f"{', '.join(sorted(REQUEST_KEYS))}")
        try:
            images: list[Image.Image] = [to_pil(image) for image in request.get("images") or []]
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        details: list[str | None] = []
        if "messages" in request:
            prompt, chat_images, user_texts, details = self.render_chat(request["messages"])
            images = chat_images + images
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
        return self._with_images(ids, images, details, self._pixel_bounds(request.get("mm_processor_kwargs")))

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
            raise InvalidRequestError("mm_processor_kwargs takes min_pixels and max_pixels, integers", where)
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

    def _with_images(self, ids: list[int], images: list[Image.Image], details: list[str | None],
                     pixel_bounds: tuple[int, int] | None = None) -> ProcessedInputs:
        index = self.image_token_index
        placeholders = 0 if index is None else ids.count(index)
        if images and (self.image_processor is None or index is None):
            raise InvalidRequestError("this model is text-only; it does not take images")
        if placeholders != len(images):
            raise InvalidRequestError(
                f"prompt has {placeholders} image placeholder(s) ({self.image_token}) but "
                f"{len(images)} image(s) were given"
            )
        if not images or self.image_processor is None or self.config.vision is None:
            return ProcessedInputs(ids, None, 0)
        if pixel_bounds is not None:
            assert isinstance(self.image_processor, DynamicResolutionImages)
            prepared = self.image_processor(images, details, pixel_bounds)
        else:
            prepared = self.image_processor(images, details)
        counts = iter(prepared.token_counts)
        expanded: list[int] = []
        for token in ids:
            expanded.extend([token] * next(counts) if token == index else [token])
        return ProcessedInputs(expanded, prepared.pixel_values, len(images), image_token_counts=prepared.token_counts,
                               image_tiles=prepared.tiles, image_sizes=prepared.sizes)


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
