"""The batch tier on a real server: held while it would slow a tighter tier, then answered."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.api.server_process import ServerProcess, configured_server

# a standard TPOT SLO no decode step meets: a batch request joining a running standard one is held
CONFIG = {"slo": {"tiers": {"interactive": {"ttft_ms": 1000, "tpot_ms": 0.001},
                            "standard": {"ttft_ms": 4000, "tpot_ms": 0.001}}}}


@pytest.fixture(scope="module")
def hold_server(tiny_llava: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with configured_server(tiny_llava, CONFIG, tmp_path_factory.mktemp("hold")) as proc:
        yield proc


def _body(tier: str, max_tokens: int) -> dict[str, object]:
    return {"model": "tiny", "prompt": "hi", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "service_tier": tier}


def test_a_batch_call_waits_for_a_running_standard_request_then_is_answered(hold_server: ServerProcess) -> None:
    url = hold_server.url
    finished: dict[str, float] = {}
    decoding = threading.Event()

    def long_standard() -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json={**_body("default", 2000), "stream": True},
                          timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    decoding.set()
        finished["standard"] = time.monotonic()

    runner = threading.Thread(target=long_standard)
    runner.start()
    assert decoding.wait(60)  # its tokens are streaming: it is decoding now
    r = httpx.post(f"{url}/v1/completions", json=_body("flex", 4), timeout=120)
    answered = time.monotonic()
    runner.join()
    assert r.status_code == 200 and r.json()["service_tier"] == "batch"
    assert r.json()["usage"]["completion_tokens"] == 4
    # it was let go when the standard request finished, not before (its longest hold is 30 s)
    assert answered >= finished["standard"] - 0.05
    held = httpx.get(f"{url}/health", timeout=10).json()["admission"]["held"]
    assert held["calls_held"] >= 1 and held["released_by_time"] == 0 and held["requests_waiting"] == 0
