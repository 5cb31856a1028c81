"""A chat answer's message when the call declared tools: its content and ``tool_calls``, read from the output
as the call's tool mode says (:mod:`mm_serve.protocol.tools`), the same for JSON and streamed answers."""

from __future__ import annotations

from mm_serve.pipeline.call import Call
from mm_serve.pipeline.context import ServerContext
from mm_serve.protocol.schemas import AssistantMessage, ChatCompletionRequest, FinishReason
from mm_serve.protocol.tool_parsers import PARSERS, parser_name
from mm_serve.protocol.tools import NamedToolChoice, ToolCall, constrained_calls, partial_calls


def named_function(call: Call) -> str | None:
    """The function a named ``tool_choice`` forces (None otherwise)."""
    choice = call.body.tool_choice if isinstance(call.body, ChatCompletionRequest) else None
    return choice.function.name if isinstance(choice, NamedToolChoice) else None


def call_parser(ctx: ServerContext) -> str:
    """``api.tool_call_parser`` for the served checkpoint (``auto`` resolved by its decoder's model type)."""
    raw = ctx.holder.model_config.raw
    decoder = (raw.get("text_config") or raw).get("model_type", ctx.holder.model_config.model_type)
    return parser_name(ctx.config.api.tool_call_parser, str(decoder))


def tool_calls_of(ctx: ServerContext, call: Call, text: str) -> tuple[str | None, list[ToolCall], bool]:
    """(content, calls, whole) of an output of ``call``: under a named or required grammar the output is the
    calls (an output cut short: the calls as far as they were written, the last one's arguments cut, as a
    stream sent them, and ``whole`` False); ``auto``, what the checkpoint's parser finds."""
    if call.tool_mode in ("named", "required"):
        calls = constrained_calls(call.tool_mode, text, named_function(call))
        whole = calls is not None
        if calls is None:
            calls = partial_calls(call.tool_mode, text, named_function(call))
        return None, calls, whole  # the output is the calls' JSON, never content (cut before a name: none)
    if call.tool_mode == "auto":
        content, calls = PARSERS[call_parser(ctx)](text)
        declared = {tool.function.name for tool in getattr(call.body, "tools", None) or []}
        if any(c.function.name not in declared for c in calls):  # not a call of this request's tools: text
            return text, [], True
        return content, calls, True
    return text, [], True


def answer_message(ctx: ServerContext, call: Call, text: str, reason: FinishReason | None,
                   ) -> tuple[AssistantMessage, FinishReason | None]:
    """The assistant message of one choice and its finish reason: ``tool_calls`` when it has whole calls;
    a forced choice's calls cut short (by ``max_tokens``, ``length``, or a stop string, ``stop``) are given
    as far as written with that reason, and cut before any call's name, no call and no content."""
    content, calls, whole = tool_calls_of(ctx, call, text)
    if not calls:  # the text (a forced choice's output is calls' JSON: none)
        return AssistantMessage(content=content), reason
    return AssistantMessage(content=content, tool_calls=calls), "tool_calls" if whole else reason
