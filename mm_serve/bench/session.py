"""Measure one system end to end: unloaded latencies, then one rate or a goodput sweep.

Default SLOs, when none are given, follow DistServe's practice of setting them
relative to what the hardware does unloaded (arXiv:2401.09670, §6.1, "SLO scale"):
``TTFT SLO = 5 x`` and ``TPOT SLO = 5 x`` the unloaded p90 of the first system
measured. The p90 (not the median) matches the 90 % attainment target, so a long
prompt of the workload's tail still fits when the server is idle.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from mm_serve.bench.client import Endpoint
from mm_serve.bench.metrics import RunSummary
from mm_serve.bench.records import RequestRecord
from mm_serve.bench.report import SystemResult
from mm_serve.bench.requests import Api, RequestFactory
from mm_serve.bench.runner import LoadRunner, LoadSpec
from mm_serve.bench.sweep import find_goodput
from mm_serve.config import SLOConfig
from mm_serve.ground.slo import SLO

TTFT_SLO_SCALE = 5.0  # default TTFT SLO over the unloaded p90 TTFT
TPOT_SLO_SCALE = 5.0  # default TPOT SLO over the unloaded p90 TPOT


@dataclass(frozen=True)
class BenchSettings:
    """Run-wide settings shared by every system of one ``mm-serve bench`` invocation."""

    load: LoadSpec
    target: float = 0.9  # attainment target, 0..1
    rate: float | None = None  # one run at this rate (requests/s) ...
    sweep: bool = False  # ... or a goodput search
    start_rate: float | None = None  # first rate of the sweep (requests/s); None = from unloaded e2e
    rel_tol: float = 0.1  # sweep stops when the bracket is within 1 + rel_tol
    api: Api = "chat"
    api_key: str | None = None
    tokenizer_dir: Path | None = None  # local checkpoint: exact prompt lengths
    image_size: int | tuple[tuple[int, int], ...] = 336  # pixels of the square images, or the (width, height) drawn from
    video_shapes: tuple[tuple[int, int], ...] = ((224, 224),)  # (width, height) of a video's frames, drawn from
    ignore_eos: bool = True
    unloaded_requests: int = 8
    early_stop: bool = True
    timeout_s: float = 300.0  # per read, seconds
    records_dir: Path | None = None  # write records-<system>.jsonl (every request) here
    tier_mix: dict[str, float] | None = None  # --tier-mix: tier -> share of the requests
    tier_slo: SLOConfig = SLOConfig()  # the tiers' SLOs the per-tier figures are judged by


def _listed_models(url: str, api_key: str | None) -> list[dict[str, Any]]:
    """``GET /v1/models``'s ``data``, not empty.

    Raises:
        ConnectionError: the server cannot be reached, refuses the key (saying so), or lists no model.
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with httpx.Client(trust_env=False, timeout=10.0) as http:
            resp = http.get(url.rstrip("/") + "/v1/models", headers=headers)
            if resp.status_code in (401, 403):
                raise ConnectionError(f"{url}/v1/models answered {resp.status_code}: "
                                      + ("a wrong key: check --api-key" if api_key else "the server wants a key: "
                                         "pass --api-key"))
            resp.raise_for_status()
            models = resp.json().get("data") or []
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        raise ConnectionError(f"cannot list models at {url}/v1/models: {exc}") from None
    if not models:
        raise ConnectionError(f"{url}/v1/models lists no model")
    return list(models)


def served_model_id(url: str, api_key: str | None = None) -> str:
    """The first model id listed by ``GET /v1/models``.

    Raises:
        ConnectionError: the server cannot be reached or lists no model.
    """
    return str(_listed_models(url, api_key)[0]["id"])


def served_context(url: str, api_key: str | None = None) -> int | None:
    """The context length (tokens) of the first model ``GET /v1/models`` lists, from its ``max_model_len``
    (ours and vLLM's); None when the server does not say.

    Raises:
        ConnectionError: the server cannot be reached or lists no model.
    """
    value = _listed_models(url, api_key)[0].get("max_model_len")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def default_slo(unloaded: RunSummary) -> SLO:
    """The default SLO: :data:`TTFT_SLO_SCALE` / :data:`TPOT_SLO_SCALE` x the unloaded p90s.

    Raises:
        ValueError: no unloaded request finished (nothing to scale).
    """
    if unloaded.num_ok == 0 or math.isnan(unloaded.ttft.p90):
        raise ValueError("no unloaded request finished; give --slo-ttft and --slo-tpot")
    tpot = unloaded.tpot.p90 if unloaded.tpot.p90 > 0 else unloaded.itl.p90
    return SLO(ttft_s=round(TTFT_SLO_SCALE * unloaded.ttft.p90, 3),
               tpot_s=round(TPOT_SLO_SCALE * max(tpot, 1e-4), 4))


def measure(name: str, url: str, settings: BenchSettings, slo: SLO | None,
            model_id: str | None = None, start_rate: float | None = None,
            log: Callable[[str], None] = print) -> tuple[SystemResult, SLO]:
    """Measure one system at ``url``; returns its result and the SLO used (derived if ``slo`` is None).

    ``start_rate`` (requests/s) overrides the settings' first sweep rate (a
    comparison starts the second system at the first one's goodput).
    """
    from mm_serve.bench.report import format_run, format_unloaded

    model = model_id or served_model_id(url, settings.api_key)
    factory = RequestFactory(model, settings.api, settings.tokenizer_dir, settings.image_size,
                             settings.ignore_eos, settings.tier_mix, settings.video_shapes)
    endpoint = Endpoint(url, factory.path, settings.api_key, settings.timeout_s)
    runner = LoadRunner(endpoint, factory, settings.load, slo, settings.target, settings.early_stop,
                        on_run=lambda run: log(format_run(name, run)),
                        records_path=settings.records_dir / f"records-{name}.jsonl" if settings.records_dir else None,
                        on_records=_tier_logger(name, settings, log) if settings.tier_mix else None)
    log(f"[{name}] {url} (model {model}): about {settings.unloaded_requests} unloaded requests (whole conversations) ...")
    unloaded = runner.unloaded(settings.unloaded_requests)
    for message, count in unloaded.errors.items():
        log(f"[{name}] {count} unloaded request(s) failed: {message}")
    if slo is None:
        slo = default_slo(unloaded)
        runner.slo = slo
        log(f"[{name}] SLOs from the unloaded p90s: TTFT {slo.ttft_s:g} s, TPOT {slo.tpot_s * 1e3:g} ms")
    log(format_unloaded(SystemResult(name, url, unloaded)))
    if not settings.sweep:
        if settings.rate is None:
            raise ValueError("give a rate or ask for a sweep")
        return SystemResult(name, url, unloaded, single=runner.run_at(settings.rate)), slo
    first = start_rate or settings.start_rate or _guess_rate(unloaded)
    sweep = find_goodput(runner.run_at, settings.target, first, settings.rel_tol)
    log(f"[{name}] goodput {sweep.goodput:.3f} req/s")
    return SystemResult(name, url, unloaded, sweep=sweep), slo


def _guess_rate(unloaded: RunSummary) -> float:
    """A first sweep rate (requests/s): two requests per mean unloaded e2e latency."""
    e2e = unloaded.e2e.mean
    return 2.0 / e2e if e2e > 0 and math.isfinite(e2e) else 1.0


def _tier_logger(name: str, settings: BenchSettings,
                 log: Callable[[str], None]) -> Callable[[float, list[RequestRecord]], None]:
    """Logs a run's per-tier figures (:func:`mm_serve.bench.tier_report.tier_lines`)."""
    from mm_serve.bench.tier_report import tier_lines

    def report(rate: float, records: list[RequestRecord]) -> None:
        span = max((r.sent_s for r in records if r.sent_s is not None), default=0.0)
        log(f"[{name}] per tier at {rate:.3f} req/s:")
        for line in tier_lines(records, settings.tier_slo, span):
            log(line)

    return report
