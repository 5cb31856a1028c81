"""The shortest completion of a JSON text being written (:mod:`mm_serve.runtime.json_closing`): every prefix
of canonical JSON (xgrammar's separators), completed by it, parses; and a ``json_object`` output always
parses by its ``max_tokens``."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from mm_serve import LLM, SamplingParams
from mm_serve.runtime.json_closing import JsonClosing


def _value(rng: random.Random, depth: int) -> object:
    kind = rng.randrange(8 if depth < 3 else 5)
    if kind == 0:
        return rng.choice([True, False, None])
    if kind == 1:
        return rng.choice([0, -7, 3.25, -0.5e-3, 12345678901234])
    if kind in (2, 3):
        return "".join(rng.choice(['a', ' ', '"', '\\', '\n', 'é', '\u2028', '}', ':', ', ']) for _ in range(rng.randrange(6)))
    if kind == 4:
        return {}
    if kind in (5, 6):
        return {f"k{i}\"": _value(rng, depth + 1) for i in range(rng.randrange(4))}
    return [_value(rng, depth + 1) for _ in range(rng.randrange(4))]


@pytest.mark.parametrize("ensure_ascii", [True, False])
def test_every_prefix_completed_by_its_rest_parses(ensure_ascii: bool) -> None:
    rng = random.Random(7)
    for _ in range(150):
        value = {"root": _value(rng, 0), "n": _value(rng, 2)}
        text = json.dumps(value, ensure_ascii=ensure_ascii).encode()
        closing = JsonClosing(object_only=True)
        assert closing.rest() == b"{}"
        for n, byte in enumerate(text):
            closing.feed(bytes([byte]))
            done = text[: n + 1] + closing.rest()
            try:
                done.decode()
            except UnicodeDecodeError:
                continue  # inside a UTF-8 character: the prefix is not text yet
            assert isinstance(json.loads(done), dict), (text[: n + 1], closing.rest())
        assert closing.rest() == b""


def test_the_rest_is_the_shortest_for_each_kind_of_state() -> None:
    cases = {b'{': b"}", b'{"a': b'": 0}', b'{"a"': b": 0}", b'{"a":': b" 0}", b'{"a": ': b"0}", b'{"a": -': b"0}",
             b'{"a": 1.': b"0}", b'{"a": 12': b"}", b'{"a": t': b"rue}", b'{"a": "x\\': b'n"}', b'{"a": "\\u0': b'000"}',
             b'{"a": [': b"]}", b'{"a": [1, ': b"0]}", b'{"a": 1, ': b'"": 0}', b'{"a": {"b": [{': b"}]}}",
             b'{"a": 1}': b""}
    for text, rest in cases.items():
        closing = JsonClosing(object_only=True)
        closing.feed(text)
        assert closing.rest() == rest, text


def test_json_object_outputs_always_parse_by_their_max_tokens(tiny_llava: Path) -> None:
    """A random model writes keys that never end; sampled, with budgets from 2 to 120 tokens, every output is
    a JSON object, ended by the model (stop) or closed on its last token (length); greedy too."""
    llm = LLM(tiny_llava, mode="colocated")
    prompt = {"messages": [{"role": "user", "content": "Describe the scene as JSON."}]}
    budgets = [2, 3, 5, 9, 17, 40, 120] * 2
    params = [SamplingParams(max_tokens=b, temperature=1.0 if k % 2 else 0.0, seed=k,
                             structured=("json_object", "")) for k, b in enumerate(budgets)]
    for out, budget in zip(llm.generate([prompt] * len(params), params), budgets, strict=True):
        assert isinstance(json.loads(out.text), dict), (budget, out.text)
        assert len(out.token_ids) <= budget and (out.finish_reason == "stop" or len(out.token_ids) == budget)
