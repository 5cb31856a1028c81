"""A chat call's messages, read once: turns of text, image and video parts, the media's URLs and the
sizes images' data URIs declare, the characters of text.

Every step that needs the messages before the images are loaded (the early admission check,
the image budget, the text-length bound) reads this; loading the images turns it into the
template-ready messages the input processor renders (:meth:`ChatPrompt.template_messages`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from PIL import Image

from mm_serve.ground.json_text import JSONTextError, load_json
from mm_serve.media.image_loading import declared_size
from mm_serve.media.offline import image_outside_user_message
from mm_serve.media.video_loading import Video
from mm_serve.protocol.errors import bad_request
from mm_serve.protocol.schemas import ChatMessage

PRECHECK_TEXT_CHARS = 8192  # of each text part, tokenized by the early check (a lower bound: the loop must not stall)


@dataclass(frozen=True)
class DeclaredImage:
    """An ``image_url`` part: its URL, and the (width, height) its data-URI header declares (None for
    a URL or an unreadable header); or a ``video_url`` part (``is_video``; no size declared)."""

    url: str
    size: tuple[int, int] | None
    detail: str | None = None  # OpenAI's low | high | auto (None: auto)
    is_video: bool = False

    @property
    def is_data(self) -> bool:
        """Whether it is a ``data:`` URI (its bytes are in the request)."""
        return self.url.lstrip()[:5].lower() == "data:"


def _template_call(name: str, arguments: str) -> dict[str, Any]:
    """A call of the history as chat templates take it (Hugging Face's convention): its arguments as an
    object where they are JSON, else as the text they are."""
    try:
        parsed: Any = load_json(arguments)
    except JSONTextError:  # kept as text
        parsed = arguments
    return {"type": "function", "function": {"name": name, "arguments": parsed}}


@dataclass(frozen=True)
class Turn:
    """One message: its role (``developer`` read as ``system``) and its content, a string or parts
    ``("text", text)`` / ``("image", index into ChatPrompt.images)`` (an image or a video); None for no content."""

    role: str
    content: str | list[tuple[str, str | int]] | None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls, as chat templates take them
    tool_call_id: str | None = None  # a tool turn's call


@dataclass(frozen=True)
class ChatPrompt:
    """The messages of one chat call."""

    turns: list[Turn]
    images: list[DeclaredImage]
    text_chars: int  # characters of text in every message

    @classmethod
    def parse(cls, messages: Sequence[ChatMessage]) -> ChatPrompt:
        """Read the messages once.

        Raises:
            APIError: 400 for an image outside a user message (chat templates render images in user
                turns only; said before any image is fetched).
        """
        turns: list[Turn] = []
        images: list[DeclaredImage] = []
        chars = 0
        for number, message in enumerate(messages):
            role = "system" if message.role == "developer" else message.role
            content = message.content
            calls = [_template_call(c.function.name, c.function.arguments) for c in message.tool_calls or []] or None
            if content is None or isinstance(content, str):
                chars += len(content or "") + sum(len(c.function.arguments) for c in message.tool_calls or [])
                turns.append(Turn(role, content, calls, message.tool_call_id))
                continue
            parts: list[tuple[str, str | int]] = []
            for part in content:
                if part.type in ("text", "refusal"):  # a refusal: what the assistant said, as text
                    chars += len(part.text)
                    parts.append(("text", part.text))
                    continue
                video = part.type == "video_url"
                if message.role != "user":
                    raise bad_request(image_outside_user_message(number, message.role, "a video" if video else "an image"),
                                      "messages")
                parts.append(("image", len(images)))
                if video:
                    images.append(DeclaredImage(part.video_url.url, None, None, is_video=True))  # type: ignore[union-attr]
                else:
                    url = part.image_url.url  # type: ignore[union-attr]
                    images.append(DeclaredImage(url, declared_size(url), part.image_url.detail))  # type: ignore[union-attr]
            turns.append(Turn(role, parts, calls, message.tool_call_id))
        return cls(turns, images, chars)

    @property
    def num_videos(self) -> int:
        return sum(image.is_video for image in self.images)

    def template_messages(self, loaded: Sequence[Image.Image | Video]) -> list[dict[str, Any]]:
        """Template-ready messages, the images and videos ``loaded`` (one per :attr:`images`, in order) as
        ``{"type": "image", "image": PIL.Image}`` and ``{"type": "video", "video": Video}`` parts."""
        out: list[dict[str, Any]] = []
        for turn in self.turns:
            extra: dict[str, Any] = {}
            if turn.tool_calls:
                extra["tool_calls"] = turn.tool_calls
            if turn.tool_call_id is not None:
                extra["tool_call_id"] = turn.tool_call_id
            if turn.content is None or isinstance(turn.content, str):
                out.append({"role": turn.role, "content": turn.content or "", **extra})
                continue
            parts: list[dict[str, Any]] = []
            for kind, value in turn.content:
                if isinstance(value, int) and self.images[value].is_video:
                    parts.append({"type": "video", "video": loaded[value]})
                elif isinstance(value, int):
                    detail = self.images[value].detail
                    parts.append({"type": "image", "image": loaded[value], **({"detail": detail} if detail else {})})
                else:
                    parts.append({"type": kind, "text": value})
            out.append({"role": turn.role, "content": parts, **extra})
        return out

    def uncached_text_floor(self, unseen: Sequence[bool], tokenizer: Any) -> int:
        """A lower bound on the prompt tokens, without the chat template's own, that no prefix cache
        can hold: those of the text after the first image whose ``unseen`` flag (one per image, in
        order) is set (a cached prefix ends before it), each text part's first
        :data:`PRECHECK_TEXT_CHARS` characters tokenized alone, one token less per part (a merge
        across a part's edge may save one). 0 when no image is unseen."""
        total, after = 0, False
        for turn in self.turns:
            parts = [("text", turn.content or "")] if not isinstance(turn.content, list) else turn.content
            for kind, value in parts:
                if kind == "image":
                    after = after or unseen[int(value)]
                elif after and value:
                    text = str(value)[:PRECHECK_TEXT_CHARS]
                    total += max(0, len(tokenizer.encode(text, add_special_tokens=False)) - 1)
        return total
