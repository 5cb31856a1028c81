"""load_json / decode_json_at: each way outside text fails is one JSONTextError, never a RecursionError."""

from __future__ import annotations

import pytest

from mm_serve.ground.json_text import JSONTextError, decode_json_at, load_json


def test_values_parse_as_json_loads_parses_them() -> None:
    assert load_json('{"a": [1, 2.5, "x", null]}') == {"a": [1, 2.5, "x", None]}
    assert load_json(b'\xff\xfe{\x00}\x00') == {}  # UTF-16 with its byte-order mark, as json.loads reads it


@pytest.mark.parametrize(("text", "reason", "pos"), [
    ('{"a": }', "Expecting value", 6),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply", None),
    ("1" * 5000, "an integer of over 4300 digits", None),
    (b"\x80\x81{}", "codec can't decode", None),
])
def test_each_failure_is_one_error_with_its_reason(text: str | bytes, reason: str, pos: int | None) -> None:
    with pytest.raises(JSONTextError) as caught:
        load_json(text)
    assert reason in caught.value.reason
    assert caught.value.pos == pos
    assert isinstance(caught.value, ValueError)


def test_a_syntax_error_keeps_the_parsers_line_and_column() -> None:
    with pytest.raises(JSONTextError, match=r"Expecting value: line 2 column 7 \(char 8\)"):
        load_json('{\n "a": }')


def test_decode_json_at_reads_one_value_and_says_where_it_ends() -> None:
    text = 'call {"x": [1, 2]}; more'
    assert decode_json_at(text, 5) == ({"x": [1, 2]}, 18)
    with pytest.raises(JSONTextError) as caught:
        decode_json_at('{"x": [1, ', 0)  # cut short, as a stream still coming in
    assert caught.value.pos == 10
    with pytest.raises(JSONTextError, match="nested too deeply"):
        decode_json_at("[" * 100_000, 0)
