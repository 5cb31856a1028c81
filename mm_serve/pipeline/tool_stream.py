"""A streamed chat answer's deltas, per choice, as OpenAI streams them: text as ``content``; a named tool
choice's output as argument deltas of one call (its id, type and name in the first); under an auto tool
choice the text that is surely content as it comes (:func:`~mm_serve.protocol.tool_parsers.sure_content`),
the rest read at the end; under a required one the output read whole at its end. Calls read at the end go
out as one delta each, with all their arguments."""

from __future__ import annotations

import uuid

from mm_serve.pipeline.call import Call
from mm_serve.pipeline.context import ServerContext
from mm_serve.pipeline.tool_answer import answer_message, call_parser, named_function, tool_calls_of
from mm_serve.protocol.schemas import DeltaMessage, FinishReason
from mm_serve.protocol.tool_parsers import sure_content
from mm_serve.protocol.tools import DeltaFunctionCall, DeltaToolCall


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

    def step(self, i: int, text: str, reason: FinishReason | None) -> tuple[DeltaMessage | None, FinishReason | None]:
        """Choice ``i``'s new ``text`` (``reason`` set when it finished): the delta to send (None: nothing
        yet) and the finish reason to send with it."""
        first = not self.text[i]
        self.text[i] += text
        if self.mode is None:
            return (DeltaMessage(content=text) if text else None), reason
        if self.mode == "named":
            if reason is not None:
                _, calls = tool_calls_of(self.ctx, self.call, self.text[i])
                reason = "tool_calls" if calls else reason
            if not text:
                return None, reason
            function = DeltaFunctionCall(name=self.named, arguments=text) if first else DeltaFunctionCall(arguments=text)
            return DeltaMessage(tool_calls=[DeltaToolCall(index=0, id=self.ids[i] if first else None,
                                                          type="function" if first else None, function=function)]), reason
        if reason is None:
            if self.mode != "auto":
                return None, None
            sure = sure_content(self.parser, self.text[i])
            content, self.sent[i] = self.text[i][self.sent[i]:sure], max(self.sent[i], sure)
            return (DeltaMessage(content=content) if content else None), None
        message, reason = answer_message(self.ctx, self.call, self.text[i], reason)
        deltas = [DeltaToolCall(index=k, id=c.id, type="function",
                                function=DeltaFunctionCall(name=c.function.name, arguments=c.function.arguments))
                  for k, c in enumerate(message.tool_calls)]
        rest = (message.content or "")[self.sent[i]:]  # the content not sent yet (the whole text, without calls)
        return DeltaMessage(content=rest or None, tool_calls=deltas or None), reason
