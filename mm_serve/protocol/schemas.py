"""OpenAI request and response bodies (pydantic), as documented for the Chat Completions and
Completions APIs, plus the extensions vLLM users expect (``top_k``, ``ignore_eos``)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from mm_serve.protocol.service_tier import check_service_tier
from mm_serve.protocol.structured_outputs import StructuredFields
from mm_serve.protocol.tools import DeltaToolCall, StreamDelta, Tool, ToolCall, ToolChoice


class _Lenient(BaseModel):
    """Unknown fields are accepted and ignored, as vLLM does, so newer clients keep working."""

    model_config = ConfigDict(extra="ignore")


class ImageURL(_Lenient):
    url: str = Field(min_length=1, description="data:image/...;base64, URI, http(s) URL, or allowed file:// URL")
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ImagePart(_Lenient):
    type: Literal["image_url"]
    image_url: ImageURL


class VideoURL(_Lenient):
    url: str = Field(min_length=1, description="data:video/...;base64, URI, http(s) URL, or allowed file:// URL")


class VideoPart(_Lenient):
    """Extension (vLLM's form): a video, for models that take video (Qwen2-VL)."""

    type: Literal["video_url"]
    video_url: VideoURL


class RefusalPart(_Lenient):
    """An assistant turn's refusal (OpenAI's form, in a conversation sent back): rendered as its text."""

    type: Literal["refusal"]
    refusal: str

    @property
    def text(self) -> str:
        """What the assistant said, as a text part's ``text``."""
        return self.refusal


ContentPart = Annotated[TextPart | ImagePart | VideoPart | RefusalPart, Field(discriminator="type")]


def invalid(name: str, message: str, code: str | None = None) -> PydanticCustomError:
    """A validation error that names its parameter (400 with ``param`` = ``name`` and, when given,
    OpenAI's ``code``)."""
    return PydanticCustomError("invalid_parameter", message, {"name": name, "code": code})


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers
    refusal: str | None = None  # an assistant turn's refusal (OpenAI's response field, sent back): its content

    @model_validator(mode="after")
    def _content_given(self) -> ChatMessage:
        """Only an assistant turn may have no content (OpenAI's rule: it may carry tool calls instead); a tool
        turn names the call it answers; only an assistant turn carries calls or refusals."""
        refusals = isinstance(self.content, list) and any(part.type == "refusal" for part in self.content)
        if (self.refusal is not None or refusals) and self.role != "assistant":
            raise invalid("messages", f"a {self.role} message cannot carry a refusal (only assistant messages do)")
        if self.content is None and self.refusal is not None:
            self.content = self.refusal  # what the assistant said
        if self.content is None and self.role != "assistant":
            raise invalid("messages", f"a {self.role} message needs 'content' (a string or a list of parts); "
                                      "null is allowed only for assistant messages")
        if self.role == "tool" and not self.tool_call_id:
            raise invalid("messages", "a tool message needs 'tool_call_id', the id of the call it answers")
        if self.tool_calls and self.role != "assistant":
            raise invalid("messages", f"a {self.role} message cannot carry tool_calls (only assistant messages do)")
        return self


class StreamOptions(_Lenient):
    include_usage: bool = Field(False, strict=True)


class MMProcessorKwargs(BaseModel):
    """Extension (vLLM's names): the image processor's pixel bounds for this call's images, within the
    checkpoint's own, and how its videos are sampled (frames per second, most frames, within the server's
    ``api.max_video_frames``); only a dynamic-resolution family (Qwen2-VL) takes them. Unknown keys are a
    400: a processor option silently ignored would change nothing the user asked for."""

    model_config = ConfigDict(extra="forbid")
    min_pixels: int | None = Field(None, ge=1, strict=True)
    max_pixels: int | None = Field(None, ge=1, strict=True)  # against the model's bounds and min_pixels:
    # the input processor (InputProcessor._pixel_bounds), which offline requests go through too
    fps: float | None = Field(None, gt=0, le=60, strict=True)  # a number: not "2", not true
    max_frames: int | None = Field(None, ge=1, strict=True)  # against api.max_video_frames: the input processor


def _empty(value: Any) -> bool:
    return value is None or value is False or (isinstance(value, (str, list, dict)) and not value)


def _one(value: Any) -> bool:
    return value is None or (type(value) is int and value == 1)


def _zero(value: Any) -> bool:
    return value is None or (type(value) in (int, float) and value == 0)


def _is(*allowed: Any) -> Callable[[Any], bool]:
    return lambda value: _empty(value) or any(value == a and type(value) is type(a) for a in allowed)


# OpenAI parameters this server does not implement: asking for them is a 400, not a silent no-op.
# name -> whether a value asks for nothing (then it is accepted and ignored)
UNSUPPORTED_CHAT: dict[str, Callable[[Any], bool]] = {
    "functions": _empty, "function_call": _is("none", "auto"), "prediction": _empty,
    "audio": _empty, "modalities": _is(["text"]), "best_of": _one, "store": _empty, "web_search_options": _empty,
}
UNSUPPORTED_COMPLETIONS: dict[str, Callable[[Any], bool]] = {"suffix": _empty, "best_of": _one}
# what such a parameter may be set to, where a value other than none is accepted
ACCEPTED_VALUES = {"best_of": "1 (the default)", "modalities": '["text"]', "function_call": '"none" or "auto"',
                   "store": "false (the default: nothing is stored for retrieval)"}


NULL_IS_DEFAULT = ("n", "stream", "ignore_eos", "logprobs", "parallel_tool_calls")  # OpenAI's nullable fields


def _refuse(data: Any, unsupported: dict[str, Callable[[Any], bool]]) -> Any:
    if isinstance(data, dict):
        for name, asks_nothing in unsupported.items():
            if not asks_nothing(data.get(name)):
                accepted = ACCEPTED_VALUES.get(name)
                raise PydanticCustomError(
                    "unsupported_parameter",
                    "'{name}' is not supported by this server" + (": only {accepted} is accepted" if accepted else ""),
                    {"name": name, "accepted": accepted},
                )
    return data


class _SamplingFields(StructuredFields):
    model: str
    max_tokens: int | None = Field(None, ge=1, strict=True)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1, strict=True, description="extension: 0 or -1 = off")
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1, strict=True,
                             description="any signed 64-bit integer; seeds from 0 to 2**63 - 1039 are used as "
                             "given, others wrap modulo 2**63 - 1038 (so -1 samples like 2**63 - 1039); "
                             "choice i of n draws with the wrapped seed + i (request_builder.engine_seed)")
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(strict=True)]] | None = Field(
        None, description="extension (vLLM): token ids that end the output, in [0, vocab size)")
    n: int = Field(1, ge=1, strict=True, description="choices per prompt, at most api.max_n (16)")
    stream: bool = Field(False, strict=True)
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, strict=True)
    logit_bias: dict[str, float] | None = Field(
        None, description="token id (a decimal string) -> bias in [-100, 100] added to its logit before sampling; "
        "at most api.max_logit_bias (1024) entries")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False,
                                           description="subtracted from a token's logit once it is in the output")
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False,
                                            description="times a token's count in the output, subtracted from its logit")
    repetition_penalty: float | None = Field(
        None, gt=0.0, le=10.0, allow_inf_nan=False,
        description="extension (vLLM): divides the positive (multiplies the negative) logits of tokens in the prompt "
        "or the output; 1 = off")
    min_tokens: int | None = Field(None, ge=0, strict=True, description="extension (vLLM): stop tokens, EOS and "
                                   "stop strings take effect only after this many output tokens (at most max_tokens)")
    cache_salt: str | None = Field(
        None, min_length=1, max_length=1024, description="extension (vLLM): requests share cached KV pages and image "
        "embeddings only with requests of the same salt (none: with every request without one), so one tenant's "
        "prompts are never reported, or timed, as cached for another")
    user: str | None = None
    service_tier: str | None = Field(
        None, description="SLO tier: priority -> interactive, default -> standard, flex -> batch, auto or absent -> "
        "slo.default_tier; interactive, standard, batch name ours directly (mm_serve/protocol/service_tier.py)")

    @model_validator(mode="before")
    @classmethod
    def _nulls_as_absent(cls, data: Any) -> Any:
        """``null`` for a field of :data:`NULL_IS_DEFAULT` is its default, as OpenAI takes it."""
        if isinstance(data, dict) and any(data.get(name, 0) is None for name in NULL_IS_DEFAULT):
            return {key: value for key, value in data.items() if not (key in NULL_IS_DEFAULT and value is None)}
        return data

    @field_validator("service_tier", mode="before")
    @classmethod
    def _known_tier(cls, value: Any) -> Any:
        """A non-string or unknown tier: 400 ``invalid_service_tier`` naming the allowed values."""
        try:
            check_service_tier(value)
        except ValueError as exc:
            raise invalid("service_tier", str(exc), "invalid_service_tier") from None
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_biases(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        """Keys are token ids written as decimal strings (OpenAI's form), biases finite numbers in [-100, 100]."""
        for key, bias in (value or {}).items():
            if not (key.isascii() and key.isdigit()) or len(key) > 10:
                raise invalid("logit_bias", f"logit_bias keys are token ids as decimal strings, such as \"50256\"; "
                                            f"got {key[:40]!r}")
            if not -100.0 <= bias <= 100.0:  # NaN fails too
                raise invalid("logit_bias", f"logit_bias values must be numbers in [-100, 100]; {key!r} has {bias!r}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options", "stream_options is only allowed with stream: true")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        for text in stops:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise invalid("stop", "stop strings must be valid Unicode: one holds an unpaired UTF-16 "
                                      "surrogate escape such as \\ud800") from None
        return self


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    mm_processor_kwargs: MMProcessorKwargs | None = Field(
        None, description="extension (vLLM): {min_pixels, max_pixels} for a dynamic-resolution model's images, "
        "within the checkpoint's bounds")
    max_completion_tokens: int | None = Field(None, ge=1, strict=True)
    logprobs: bool = Field(False, strict=True)
    top_logprobs: int | None = Field(None, ge=0, strict=True, description="at most api.max_logprobs (20)")
    tools: list[Tool] | None = Field(None, description="functions the model may call, rendered by the chat "
                                     "template; at most api.max_tools")
    tool_choice: ToolChoice | None = Field(None, description="none | auto (the default with tools: calls found "
                                           "by api.tool_call_parser) | required | {type: function, function: "
                                           "{name}} (both enforced by a grammar)")
    parallel_tool_calls: bool = Field(True, strict=True, description="with tool_choice required: more than one "
                                      "call allowed")

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        """400 for :data:`UNSUPPORTED_CHAT` parameters that ask for something."""
        return _refuse(data, UNSUPPORTED_CHAT)

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs", "top_logprobs requires logprobs: true")
        return self


class CompletionRequest(_SamplingFields):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]  # token ids: not true / false
    max_tokens: int | None = Field(16, ge=1, strict=True)
    logprobs: int | None = Field(None, ge=0, strict=True, description="at most api.max_logprobs (20)")
    echo: bool | None = Field(None, strict=True, description="the prompt's text before each choice's; with logprobs, "
                              "its tokens' log-probabilities too (the first token's null)")

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        """400 for :data:`UNSUPPORTED_COMPLETIONS` parameters that ask for something."""
        return _refuse(data, UNSUPPORTED_COMPLETIONS)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (never more than prompt_tokens)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = []

    @model_serializer(mode="wrap")
    def _calls_when_any(self, handler: Any) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        if not out.get("tool_calls"):
            out.pop("tool_calls", None)
        return out


FinishReason = Literal["stop", "length", "tool_calls"]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None


def _completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: _completion_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    service_tier: str | None = None  # the SLO tier served, by its OpenAI name (priority | default | flex)
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(StreamDelta):
    """A streamed delta; ``role`` is sent in a choice's first chunk only, and a delta with no new
    text (a choice's last chunk, which carries its ``finish_reason``) is ``{}``, as OpenAI sends them."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    service_tier: str | None = None  # the SLO tier served, by its OpenAI name (priority | default | flex)
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: _completion_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    service_tier: str | None = None  # the SLO tier served, by its OpenAI name (priority | default | flex)
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "mm-serve"
    max_model_len: int
    root: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class WorkerCaches(BaseModel):
    """One prefill (or colocated) worker's caches in ``/health``, since the worker started."""

    kv_cache_hit_rate: float  # prompt tokens whose KV was reused / prompt tokens looked up, 0..1
    kv_cached_pages: int  # KV pages the prefix cache holds now
    encoder_cache_hit_rate: float  # images whose encoder output was reused / images looked up, 0..1
    encoder_cache_bytes: int  # bytes of encoder outputs the encoder cache holds now


class HealthResponse(BaseModel):
    """``/health``: 200 when ``ok`` or ``degraded``, else 503."""

    status: Literal["ok", "degraded", "warming", "stopping", "down"]
    workers: dict[str, str]  # worker name (prefill0, decode0, colocated0) -> ready | warming | restarting | down
    faults: dict[str, str] = {}  # worker name -> its last failure (exit code, hang), for workers that had one
    admission: dict[str, Any] | None = None  # the latency predictor's coefficients, observations and their age
    caches: dict[str, WorkerCaches] = {}  # prefill/colocated worker -> its cache figures
    event_loop: str = "asyncio"  # the API process's event loop: "uvloop" or "asyncio" (api.event_loop)
    placement: dict[str, Any] | None = None  # how the placement was chosen: the planner's choice and predictions, or the config's


class VersionResponse(BaseModel):
    version: str
    model: str


def dump(model: BaseModel) -> dict[str, Any]:
    """JSON-ready dict, keeping ``None`` fields as OpenAI does."""
    return model.model_dump(mode="json")
