"""JSON text from outside (a request body, a file's line, a model's output) read with every way it can
fail as one error.

``json.loads`` fails three ways on text it is handed: a syntax error (``json.JSONDecodeError``), nesting
past Python's recursion limit (``RecursionError``, not a ``ValueError``), and an integer of over 4,300
digits or bytes that are not UTF-8/16/32 (a plain ``ValueError``). Callers that miss the second let a
deep array become a 500 or a crashed job; this module is the one place that knows all three.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

_DECODER = json.JSONDecoder()


class JSONTextError(ValueError):
    """Text that is not JSON Python can hold. ``reason``: why, in a few words (for a message);
    ``pos``: the character offset of a syntax error, None for the other two causes. ``str()`` of it is
    the parser's own message (with line and column for a syntax error)."""

    def __init__(self, reason: str, pos: int | None = None, message: str = "") -> None:
        super().__init__(message or reason)
        self.reason = reason
        self.pos = pos


def load_json(text: str | bytes) -> Any:
    """``text`` parsed as one JSON value (``json.loads``).

    Raises:
        JSONTextError: a syntax error (``pos`` set), nesting past the recursion limit, an integer of over
            4,300 digits, or bytes in no UTF encoding.
    """
    return _read(json.loads, text)


def decode_json_at(text: str, start: int) -> tuple[Any, int]:
    """``(value, end)``: the JSON value that begins at ``text[start]`` and the offset just past it, text after
    it ignored (``json.JSONDecoder.raw_decode``).

    Raises:
        JSONTextError: as :func:`load_json`; a value cut short (text still streaming in) is a syntax error.
    """
    return _read(_DECODER.raw_decode, text, start)  # type: ignore[no-any-return]


def _read(parse: Callable[..., Any], *args: Any) -> Any:
    try:
        return parse(*args)
    except json.JSONDecodeError as exc:
        raise JSONTextError(exc.msg, exc.pos, str(exc)) from None
    except RecursionError:
        raise JSONTextError("nested too deeply") from None
    except ValueError as exc:
        if "integer string conversion" in str(exc):  # not the message's advice to raise the interpreter's limit
            raise JSONTextError(f"an integer of over {sys.get_int_max_str_digits()} digits") from None
        raise JSONTextError(str(exc)[:200]) from None
