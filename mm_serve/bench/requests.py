"""Turn sampled :class:`~mm_serve.workloads.spec.RequestSpec` rows into OpenAI request bodies.

A spec gives lengths in tokens; a server needs text and images. Prompt text is a
window of the English corpus shipped with mm-serve, cut to ``prompt_tokens`` tokens
with the model's own tokenizer when one is given (``tokenizer.json`` of the
checkpoint, read with ``tokenizers``), else to ``4 * prompt_tokens`` characters (the
workload module's estimate). The chat template adds a few tokens on top. Images
are seeded RGB noise, ``image_size`` pixels square (the vision tower's input, so the
server's resize is a no-op), JPEG-encoded into a ``data:`` URI; for a family that tiles
images at any resolution, each image's (width, height) is drawn from :func:`image_shapes`
(its grid resolutions and smaller ones), so the requests' image-token counts are mixed. Videos are
:data:`CLIP_FRAMES` frames of seeded noise at :data:`CLIP_FPS` frames per second (MP4, MPEG-4 Part 2),
at the smaller of those shapes (:func:`video_shapes`), in a ``data:video/mp4`` URI.

Every body asks for exactly ``output_tokens`` tokens (``max_tokens`` plus
``ignore_eos``, the vLLM extension; servers without it may stop early at EOS, and
TPOT then uses the token count the server reports). Text and images depend on a
``salt`` as well as the request index, so repeated runs of the same plan (a rate
sweep) never hit a prefix cache or an image-feature cache.

Within one plan, content is shared where the spec says so: a shared system prompt
(``shared_prefix_tokens``) is one text per salt; specs with the same ``image_seed``
send the same image bytes and the same text. A turn of a conversation gets a body
with only its own new user message; the client puts the history in front of it at
send time (:class:`mm_serve.bench.conversations.History`).
"""

from __future__ import annotations

import base64
import io
import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from mm_serve.bench.tier_report import draw_tier
from mm_serve.models.model_config import VisionConfig
from mm_serve.workloads import RequestSpec

Api = Literal["chat", "completions"]


@dataclass(frozen=True)
class PlannedRequest:
    """One request of a run: when to send it and what to send."""

    index: int
    arrival_s: float  # seconds after the run start
    max_tokens: int  # output tokens asked for
    body: bytes  # JSON body, ready to POST
    tier: str | None = None  # the service_tier it asks for (--tier-mix), our tier name
    conversation: str | None = None  # conversation id: sent after the previous turn, with its history
    turn: int | None = None  # 0-based turn in its conversation; None outside a conversation


class _TextSource:
    """Corpus windows of a given length in tokens (exact with a tokenizer, else ~4 chars/token)."""

    def __init__(self, tokenizer_dir: Path | None) -> None:
        from mm_serve.models.tokenizer_builder import shipped_corpus

        self._text = " ".join(line.strip() for line in shipped_corpus())
        self._tokenizer: Any = None
        self._ids: list[int] = []
        path = tokenizer_dir / "tokenizer.json" if tokenizer_dir else None
        if path is not None and path.is_file():
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(path))
            self._ids = self._tokenizer.encode(self._text, add_special_tokens=False).ids

    @property
    def exact(self) -> bool:
        """True when lengths are counted with the model's tokenizer."""
        return self._tokenizer is not None

    def window(self, num_tokens: int, rng: random.Random) -> str:
        """About ``num_tokens`` tokens of corpus text starting at a random place."""
        if self._tokenizer is not None:
            start = rng.randrange(len(self._ids))
            ids = [self._ids[(start + i) % len(self._ids)] for i in range(num_tokens)]
            return str(self._tokenizer.decode(ids, skip_special_tokens=True)).strip() or "Hello"
        num_chars = 4 * num_tokens
        start = rng.randrange(len(self._text))
        doubled = self._text * (2 + num_chars // len(self._text))
        return doubled[start : start + num_chars].strip() or "Hello"


CLIP_FRAMES = 8  # a bench video: 2 s at 4 fps; the server's default 2 fps samples 4 frames, 2 temporal patches
CLIP_FPS = 4


def video_shapes(vision: VisionConfig) -> list[tuple[int, int]]:
    """(width, height) pixels of a bench video's frames: the squares of :func:`image_shapes` but its largest
    (a video's tokens are its frames' times the temporal patches)."""
    squares = [shape for shape in image_shapes(vision) if shape[0] == shape[1]]
    return squares[:-1] if len(squares) > 1 else squares


def video_tokens(vision: VisionConfig, fps: float = 2.0) -> int:
    """The most tokens a bench video makes when a server samples it at ``fps``: its temporal patches
    times its largest frame's merged patches."""
    unit = vision.patch_size * max(1, vision.merge_size)
    sampled = min(CLIP_FRAMES, max(2, round(CLIP_FRAMES / CLIP_FPS * fps)))
    patches = -(-sampled // vision.temporal_patch_size)
    return patches * max((w // unit) * (h // unit) for w, h in video_shapes(vision))


@lru_cache(maxsize=16)
def noise_video_uri(size: tuple[int, int], seed: int) -> str:
    """A :data:`CLIP_FRAMES`-frame (width, height) RGB noise video (seeded) at :data:`CLIP_FPS` as an MP4 ``data:`` URI."""
    import numpy as np

    from mm_serve.media.video_loading import encode_video

    width, height = size
    frames = np.random.default_rng(seed).integers(0, 256, (CLIP_FRAMES, height, width, 3), dtype=np.uint8)
    return "data:video/mp4;base64," + base64.b64encode(encode_video(frames, CLIP_FPS)).decode()


def image_shapes(vision: VisionConfig | None) -> list[tuple[int, int]]:
    """(width, height) pixels of the images a bench sends to a model with ``vision``: the tower's
    input square for a fixed-size family (one shape); for an any-resolution family that square, each
    of its grid resolutions and each at half size (so images make from one tile to the most); for a
    dynamic-resolution family squares at its pixel floor, half way and its ceiling, and a wide and a
    tall image at the ceiling."""
    if vision is None:
        return [(336, 336)]
    if vision.dynamic_resolution:  # Qwen2-VL: squares from the pixel floor to the ceiling, and long sides
        unit = vision.patch_size * vision.merge_size
        low, high = (max(unit, math.isqrt(bound) // unit * unit) for bound in vision.pixel_bounds)
        middle = max(unit, (low + high) // 2 // unit * unit)
        return list(dict.fromkeys([(low, low), (middle, middle), (high, high), (2 * high, high // 2),
                                   (high // 2, 2 * high)]))
    shapes = [(vision.image_size, vision.image_size)]
    for height, width in vision.grid_pinpoints:
        shapes += [(width, height), (max(1, width // 2), max(1, height // 2))]
    return list(dict.fromkeys(shapes))


@lru_cache(maxsize=64)
def noise_image_uri(size: int | tuple[int, int], seed: int) -> str:
    """A ``size`` x ``size`` (or (width, height)) RGB noise image (seeded) as a JPEG ``data:`` URI."""
    import numpy as np
    from PIL import Image

    width, height = (size, size) if isinstance(size, int) else size
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


class RequestFactory:
    """Builds streaming OpenAI bodies (chat or completions) for sampled request specs."""

    def __init__(self, model_name: str, api: Api = "chat", tokenizer_dir: Path | None = None,
                 image_size: int | Sequence[tuple[int, int]] = 336, ignore_eos: bool = True,
                 tier_mix: dict[str, float] | None = None, video_shapes: Sequence[tuple[int, int]] = ((224, 224),)
                 ) -> None:
        """``image_size``: pixels of each square image, or the (width, height) shapes each image is
        drawn from (:func:`image_shapes`); ``video_shapes``: the frame shapes each video is drawn from.

        Raises:
            ValueError: a size under a pixel, or no shapes.
        """
        shapes = [(image_size, image_size)] if isinstance(image_size, int) else [tuple(s) for s in image_size]
        if not shapes or min(min(s) for s in shapes) < 1:
            raise ValueError(f"image size must be >= 1 pixel, got {image_size}")
        self.model_name = model_name
        self.api = api
        self.image_shapes: list[tuple[int, int]] = shapes  # type: ignore[assignment]
        self.video_shapes = [tuple(s) for s in video_shapes]
        self.ignore_eos = ignore_eos
        self.tier_mix = tier_mix  # tier -> share: each body asks for a drawn service_tier
        self._text = _TextSource(tokenizer_dir)
        self._shared: dict[tuple[int, int], str] = {}  # (tokens, salt) -> shared system prompt

    @property
    def exact_lengths(self) -> bool:
        """True when prompt text is cut with the model's tokenizer."""
        return self._text.exact

    def body(self, spec: RequestSpec, index: int, salt: int = 0) -> bytes:
        """The JSON body for ``spec`` (request ``index`` of a plan salted with ``salt``).

        Raises:
            ValueError: images or a conversation turn asked for on the completions API.
        """
        if spec.image_seed is None:
            rng = random.Random(f"request:{salt}:{index}")
        else:  # the same image comes with the same text, so the whole request repeats
            rng = random.Random(f"image:{salt}:{spec.image_seed}")
        shared = min(spec.shared_prefix_tokens, spec.prompt_tokens)
        system = self._shared_text(shared, salt) if shared else None
        text = self._text.window(max(1, spec.prompt_tokens - shared), rng)
        payload: dict[str, Any] = {
            "model": self.model_name, "max_tokens": spec.output_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            payload["ignore_eos"] = True
        if self.tier_mix:
            payload["service_tier"] = draw_tier(self.tier_mix, index, salt)
        if self.api == "completions":
            if spec.num_images or spec.num_videos or spec.conversation_id is not None:
                raise ValueError("image and conversation workloads need the chat API (--api chat)")
            payload["prompt"] = text if system is None else f"{system}\n\n{text}"
        else:
            parts: list[dict[str, Any]] = [
                {"type": "image_url", "image_url": {"url": self._image(rng)}} for _ in range(spec.num_images)
            ] + [{"type": "video_url", "video_url": {"url": self._video(rng)}} for _ in range(spec.num_videos)]
            content: str | list[dict[str, Any]] = [*parts, {"type": "text", "text": text}] if parts else text
            payload["messages"] = [{"role": "user", "content": content}]
            if system is not None:
                payload["messages"].insert(0, {"role": "system", "content": system})
        return json.dumps(payload).encode()

    def _image(self, rng: random.Random) -> str:
        """One image: a shape drawn (when there are several), then its noise, both from ``rng``."""
        shape = self.image_shapes[0] if len(self.image_shapes) == 1 else rng.choice(self.image_shapes)
        return noise_image_uri(shape, rng.getrandbits(32))

    def _video(self, rng: random.Random) -> str:
        """One video: a frame shape drawn, then its noise, both from ``rng``."""
        shape = rng.choice(self.video_shapes)
        return noise_video_uri(shape, rng.getrandbits(32))  # type: ignore[arg-type]

    def _shared_text(self, num_tokens: int, salt: int) -> str:
        """The system prompt shared by every request of a plan salted ``salt`` (about ``num_tokens`` tokens)."""
        key = (num_tokens, salt)
        if key not in self._shared:
            self._shared[key] = self._text.window(num_tokens, random.Random(f"shared:{salt}"))
        return self._shared[key]

    def plan(self, specs: Sequence[RequestSpec], arrivals_s: Sequence[float],
             salt: int = 0) -> list[PlannedRequest]:
        """Pair specs with arrival times (seconds) into a run plan, bodies built up front."""
        if len(specs) != len(arrivals_s):
            raise ValueError(f"{len(specs)} specs but {len(arrivals_s)} arrival times")
        return [PlannedRequest(i, t, spec.output_tokens, self.body(spec, i, salt),
                               draw_tier(self.tier_mix, i, salt) if self.tier_mix else None,
                               spec.conversation_id,
                               None if spec.conversation_id is None else spec.turn)
                for i, (spec, t) in enumerate(zip(specs, arrivals_s, strict=True))]

    @property
    def path(self) -> str:
        """The endpoint path for this factory's API."""
        return "/v1/chat/completions" if self.api == "chat" else "/v1/completions"
