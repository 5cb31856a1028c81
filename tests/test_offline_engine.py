"""The offline API after a failure or Ctrl-C: it goes on serving, and what the call left does not run on."""

from __future__ import annotations

import os
import signal
import threading
import time
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


def test_ctrl_c_during_a_call_on_the_workers_stops_its_requests(tiny_llava: Path) -> None:
    """SIGINT while a call's 24 long requests run on the workers: generate raises KeyboardInterrupt and each
    of them is aborted at once (they ran on, slowing the next calls for seconds); the next call is served."""
    with LLM(tiny_llava, mode="disaggregated") as llm:
        assert llm.client is not None
        timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                llm.generate(["a purple circle and"] * 24, SamplingParams(max_tokens=2000, ignore_eos=True))
        finally:
            timer.cancel()
        assert not llm.client.requests  # aborted: no request of that call is in flight
        started = time.monotonic()
        out = llm.generate("a red square and", SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0))
        assert len(out[0].token_ids) == 4 and time.monotonic() - started < 10
