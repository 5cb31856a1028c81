"""``/dashboard`` in headless Chromium during a short ``mm-serve bench`` load with a worker kill: the tier attainment, the
decode worker going to ``restarting`` and back to ``ready`` (with its restart counted), and the phase
waterfall of recent requests appear in the page (read from the DOM); nothing is fetched from anywhere but
the server. And the series behind it, from the registry /metrics renders."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram

from mm_serve.console.history import MetricsHistory, bucket_quantile
from mm_serve.models.named_models import EMBEDDED_MODEL_DIR
from tests.api.server_process import ServerProcess
from tests.console.conftest import API_KEY, screenshot

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _bench(server: ServerProcess, out: Path) -> subprocess.Popen[bytes]:
    """``mm-serve bench`` against ``server``: LLaVA-style image questions at 6 requests/s for 8 s, in the
    interactive and standard tiers (a short bench load, as a user would run it)."""
    return subprocess.Popen(
        [sys.executable, "-m", "mm_serve.cli.main", "bench", "--server", server.url, "--model", str(EMBEDDED_MODEL_DIR),
         "--workload", "llava", "--rate", "6", "--duration", "8", "--api-key", API_KEY, "--no-early-stop",
         "--tier-mix", "interactive=0.5,standard=0.5", "--out", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ, HF_HUB_OFFLINE="1"))


def _cell(page: Any, selector: str) -> str:
    return page.eval_on_selector(selector, "e => e.textContent") if page.query_selector(selector) else ""


def test_the_dashboard_shows_attainment_a_worker_restart_and_the_waterfall(page: Any, console_server: ServerProcess,
                                                                            tmp_path: Path) -> None:
    page.goto(f"{console_server.url}/dashboard")
    page.fill("#api-key", API_KEY)
    page.click("#key-form button")
    page.locator("#workers tr[data-worker=decode0]").wait_for()
    bench = _bench(console_server, tmp_path / "bench")
    try:
        page.wait_for_function("document.querySelector('#attainment-interactive .value').textContent.includes('%')",
                               timeout=30_000)
        pid = httpx.get(f"{console_server.url}/internal/stats", headers=AUTH, timeout=10).json()["decode0"]["pid"]
        os.kill(pid, signal.SIGKILL)
        states = set()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = _cell(page, "#workers tr[data-worker=decode0] .state")
            states.add(state)
            if state == "ready" and len(states) > 1:
                break
            time.sleep(0.1)
        assert "restarting" in states and _cell(page, "#workers tr[data-worker=decode0] .state") == "ready", states
        page.wait_for_function("Number(document.querySelector('#faults tr[data-role=decode] .restarts').textContent) >= 1")
        assert bench.wait(timeout=120) == 0  # the bench ran to its end, the restarted worker serving its rest
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    page.wait_for_function("document.querySelectorAll('#waterfall .row').length >= 4")
    row = page.locator("#waterfall .row").first
    phases = [p.get_attribute("data-phase") for p in row.locator(".phase").all()]
    assert {"front end", "encode", "prefill", "hand-off", "decode"} <= set(phases), phases
    assert ("interactive" in row.text_content() or "standard" in row.text_content()) and "TTFT" in row.text_content()
    assert "%" in _cell(page, "#attainment-interactive .value")
    assert page.locator("#chart-ttft .main-svg").count() >= 1  # plotly drew the charts
    screenshot(page, "dashboard.png", tmp_path)
    assert page.outside == [] and all(url.startswith(console_server.url) for url in page.requests)


def test_the_dashboard_data_needs_the_key_and_the_pages_do_not(console_server: ServerProcess) -> None:
    assert httpx.get(f"{console_server.url}/internal/dashboard", timeout=10).status_code == 401
    assert httpx.get(f"{console_server.url}/internal/dashboard", headers=AUTH, timeout=10).json()["status"] == "ok"
    for path in ("/dashboard", "/playground", "/console/static/plotly.min.js", "/console/static/dashboard.js"):
        assert httpx.get(f"{console_server.url}{path}", timeout=10).status_code == 200, path
    assert httpx.get(f"{console_server.url}/console/static/../config.py", timeout=10).status_code == 404


def test_percentiles_are_prometheus_histogram_quantiles() -> None:
    buckets = [(0.1, 10.0), (0.5, 30.0), (1.0, 40.0), (float("inf"), 40.0)]
    assert bucket_quantile(buckets, 0.5) == pytest.approx(0.1 + 0.4 * (20 - 10) / 20)
    assert bucket_quantile(buckets, 0.25) == pytest.approx(0.1)
    assert bucket_quantile(buckets, 0.1) == pytest.approx(0.04)
    assert bucket_quantile([(1.0, 2.0), (float("inf"), 4.0)], 0.9) == 1.0  # in +Inf: the highest finite bound
    assert bucket_quantile([(1.0, 0.0), (float("inf"), 0.0)], 0.5) is None


def test_the_series_are_differences_of_registry_snapshots() -> None:
    """Requests, TTFTs and tier counters observed between snapshots: the rate over the last 5 s, the
    percentiles of the TTFTs in that window only, attainment as met / finished of the last 30 s and
    refusals by reason since the previous snapshot."""
    registry = CollectorRegistry()
    requests = Counter("mm_serve_requests", "x", ("finish_reason", "status_code"), registry=registry)
    ttft = Histogram("mm_serve_time_to_first_token_seconds", "x", registry=registry, buckets=(0.1, 0.2, 0.4, 0.8))
    finished = Counter("mm_serve_tier_finished", "x", ("tier",), registry=registry)
    met = Counter("mm_serve_tier_slo_met", "x", ("tier",), registry=registry)
    rejected = Counter("mm_serve_tier_rejected", "x", ("tier", "reason"), registry=registry)
    history = MetricsHistory(registry)
    for value in (0.7, 0.7, 0.7):  # before the window: not in the percentiles
        ttft.observe(value)
    history.sample(now=100.0)
    for second in range(1, 6):
        requests.labels("stop", "200").inc(2)
        for _ in range(2):
            ttft.observe(0.15)
        finished.labels("interactive").inc(2)
        met.labels("interactive").inc(1)
        history.sample(now=100.0 + second)
    rejected.labels("interactive", "ttft_slo").inc(3)
    history.sample(now=106.0)
    points = history.series()
    assert len(points) == 6
    assert points[-2]["rate"] == pytest.approx(2.0) and points[-1]["rate"] == pytest.approx(8 / 5)
    assert points[-2]["ttft"]["p50"] == pytest.approx(0.15) and points[-2]["ttft"]["p99"] <= 0.2
    assert points[-1]["attainment"] == {"interactive": pytest.approx(0.5)}
    assert points[-1]["refusals"] == {"ttft_slo": 3.0} and points[-2]["refusals"] == {}


def test_waterfall_phases_disaggregated_and_colocated() -> None:
    """A disaggregated request's events give each phase in order; a colocated one's (queued, first token,
    finished only) give its wait and prefill as one phase."""
    from mm_serve.console.recent import phases

    t0 = 1000.0
    events = {"arrived": t0 + 0.01, "prefill_queued": t0 + 0.012, "encode_begin": t0 + 0.02, "encode_end": t0 + 0.03,
              "prefill_begin": t0 + 0.03, "prefill_end": t0 + 0.05, "handoff_begin": t0 + 0.05,
              "handoff_end": t0 + 0.06, "first_decode": t0 + 0.065, "finished": t0 + 0.2}
    got = [(p["name"], round(p["start_s"], 3), round(p["end_s"], 3)) for p in phases(events, t0, t0 + 0.2)]
    assert got == [("front end", 0.0, 0.01), ("queue", 0.012, 0.02), ("encode", 0.02, 0.03),
                   ("prefill", 0.03, 0.05), ("hand-off", 0.05, 0.06), ("decode queue", 0.06, 0.065),
                   ("decode", 0.065, 0.2)]
    colocated = {"arrived": t0 + 0.01, "prefill_queued": t0 + 0.012, "prefill_end": t0 + 0.04}
    got = [(p["name"], round(p["start_s"], 3), round(p["end_s"], 3)) for p in phases(colocated, t0, t0 + 0.1)]
    assert got == [("front end", 0.0, 0.01), ("queue + prefill", 0.012, 0.04), ("decode", 0.04, 0.1)]
