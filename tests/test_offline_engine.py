"""The offline API's in-process engine after a failure: it goes on serving."""

from __future__ import annotations

from pathlib import Path

import pytest

from mm_serve import LLM, SamplingParams


def test_a_failed_in_process_step_leaves_the_offline_engine_serving(tiny_llava: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that raises (a fault injected into the model runner's pass) fails its generate call; the
    call's requests are dropped with their pages, and the next call gives the tokens it gives on a fresh
    engine (a failed step had left half-prefilled requests that failed every later call)."""
    llm = LLM(tiny_llava, mode="colocated")
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
    expected = llm.generate(["a purple circle and", "a red square and"], params)
    assert llm.engine is not None
    free = llm.engine.num_free_pages()
    real = llm.engine.runner.mixed
    calls = {"n": 0}

    def failing_once(*args: object) -> object:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected fault")
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(llm.engine.runner, "mixed", failing_once)
    with pytest.raises(RuntimeError, match="injected fault"):
        llm.generate(["a purple circle and", "a red square and"], params)
    assert not llm.engine.has_unfinished() and not llm.engine.requests and llm.engine.num_free_pages() == free
    again = llm.generate(["a purple circle and", "a red square and"], params)
    assert [o.token_ids for o in again] == [o.token_ids for o in expected]
