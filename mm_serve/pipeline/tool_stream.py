"""A streamed chat answer's deltas, per choice, as OpenAI streams them: text as ``content``; a named tool
choice's output as argument deltas of one call (its id, type and name in the first); under a required tool
choice, and an auto one, each call as soon as its name is out (id, type and name), then its arguments as
they are written (:mod:`~mm_serve.protocol.call_spans`), and under auto the text that is surely content as
it comes (:func:`~mm_serve.protocol.tool_parsers.sure_content`). The finished answer's calls are read as
the JSON answer reads them; what they hold beyond the deltas sent (a call in an unusual form: arguments
before the name, or written as a JSON string) goes out at the end. The deltas of a call add up to its
arguments in the JSON answer."""

from __future__ import annotations

import uuid

from mm_serve.pipeline.call import Call
from mm_serve.pipeline.context import ServerContext
from mm_serve.pipeline.tool_answer import answer_message, call_parser, named_function
from mm_serve.protocol.call_spans import CallSpan, call_spans
from mm_serve.protocol.schemas import DeltaMessage, FinishReason
from mm_serve.protocol.tool_parsers import growing_calls, sure_content
from mm_serve.protocol.tools import DeltaFunctionCall, DeltaToolCall, ToolCall


class ToolStream:
    """The deltas of ``choices`` streamed choices of ``call``."""

    def __init__(self, ctx: ServerContext, call: Call, choices: int) -> None:
        self.ctx, self.call = ctx, call
        self.mode = call.tool_mode
        self.named = named_function(call)
        self.text = [""] * choices  # what each choice has output so far
        self.ids = [f"call_{uuid.uuid4().hex[:24]}" for _ in range(choices)]
        self.sent = [0] * choices  # characters of each choice's text sent as content (auto)
        self.parser = call_parser(ctx) if self.mode == "auto" else ""
        self.calls: list[list[list[str]]] = [[] for _ in range(choices)]  # per choice, per call: [name, arguments sent]
        self.declared = {tool.function.name for tool in getattr(call.body, "tools", None) or []}

    @property
    def forced(self) -> bool:
        """Whether every answer is a tool call (a named or required tool choice): it has no content."""
        return self.mode in ("named", "required")

    def step(self, i: int, text: str, reason: FinishReason | None) -> tuple[DeltaMessage | None, FinishReason | None]:
        """Choice ``i``'s new ``text`` (``reason`` set when it finished): the delta to send (None: nothing
        yet) and the finish reason to send with it."""
        first = not self.text[i]
        self.text[i] += text
        if self.mode is None:
            return (DeltaMessage(content=text) if text else None), reason
        if self.mode == "named":
            if reason is not None:
                reason = answer_message(self.ctx, self.call, self.text[i], reason)[1]
            if not text:
                return None, reason
            function = DeltaFunctionCall(name=self.named, arguments=text) if first else DeltaFunctionCall(arguments=text)
            return DeltaMessage(tool_calls=[DeltaToolCall(index=0, id=self.ids[i] if first else None,
                                                          type="function" if first else None, function=function)]), reason
        if reason is None:
            content = None
            if self.mode == "auto":
                sure = sure_content(self.parser, self.text[i])
                content, self.sent[i] = self.text[i][self.sent[i]:sure], max(self.sent[i], sure)
            deltas = self._growing(i)
            if not content and not deltas:
                return None, None
            return DeltaMessage(content=content or None, tool_calls=deltas or None), None
        message, reason = answer_message(self.ctx, self.call, self.text[i], reason)
        deltas = self._growing(i) + self._rest(i, message.tool_calls or [])
        rest = None if self.calls[i] else (message.content or "")[self.sent[i]:]  # content not sent yet
        return DeltaMessage(content=rest or None, tool_calls=deltas or None), reason

    def _growing(self, i: int) -> list[DeltaToolCall]:
        """Deltas for the calls of choice ``i`` as far as they are written: a call's first delta when its
        name is out (id, type, name and the arguments so far), then each new piece of its arguments."""
        text = self.text[i]
        spans: list[tuple[int, CallSpan]] = [(0, span) for span in call_spans(text, "parameters")] \
            if self.mode == "required" else growing_calls(self.parser, text)
        deltas = []
        for k, (offset, span) in enumerate(spans):
            if span.name not in self.declared:  # not a call of this request's tools (auto): none streamed from here
                break
            arguments = span.arguments(text[offset:])
            if arguments.lstrip().startswith('"'):  # written as a JSON string: the answer decodes it, so it goes
                arguments = ""  # out whole at the end (_rest), not as the quoted text
            if k == len(self.calls[i]):
                self.calls[i].append([span.name, arguments])
                deltas.append(DeltaToolCall(index=k, id=_call_id(), type="function",
                                            function=DeltaFunctionCall(name=span.name, arguments=arguments)))
                continue
            sent = self.calls[i][k][1]
            if arguments.startswith(sent) and len(arguments) > len(sent):
                self.calls[i][k][1] = arguments
                deltas.append(DeltaToolCall(index=k, function=DeltaFunctionCall(arguments=arguments[len(sent):])))
        return deltas

    def _rest(self, i: int, calls: list[ToolCall]) -> list[DeltaToolCall]:
        """At the end, what the finished answer's ``calls`` hold beyond the deltas sent: the rest of a call's
        arguments, or a call not streamed (its whole delta)."""
        deltas = []
        for k, c in enumerate(calls):
            if k < len(self.calls[i]):
                sent = self.calls[i][k][1]
                if c.function.arguments.startswith(sent) and len(c.function.arguments) > len(sent):
                    deltas.append(DeltaToolCall(index=k, function=DeltaFunctionCall(
                        arguments=c.function.arguments[len(sent):])))
                continue
            deltas.append(DeltaToolCall(index=k, id=c.id, type="function",
                                        function=DeltaFunctionCall(name=c.function.name, arguments=c.function.arguments)))
        return deltas


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
