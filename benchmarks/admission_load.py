"""Mixed-tier llava load at 1x, 2x and 4x a base rate, with admission on and off.

Starts ``mm-serve serve`` (a real subprocess) twice, with ``admission.predict`` true and
false, and sends each the same open-loop Poisson arrivals: image chat requests (one
noise image, a short question, ``max_tokens`` 8-48, ``ignore_eos``), streamed, with
``service_tier`` drawn from ``--tier-mix``. For each (admission, load) it reports, per
tier, the attainment of the admitted requests (TTFT and TPOT within the tier's SLO of
the server's config), the rejection rate and the slowest rejection, the rate of
SLO-meeting requests (goodput of the admitted), and the median relative error of the
predicted TTFT (``x-mm-serve-predicted-ttft-ms``) against the measured one. Writes
``admission.json`` and, with matplotlib, ``admission.png`` (attainment vs offered load).

``--base-rate`` is the 1x rate in requests/s: the service's goodput rate, e.g. from
``mm-serve bench --workload llava --sweep``; without it, a rough stand-in is measured
first (the inverse of the mean e2e latency of 8 requests sent one at a time, on the
admission-on server). Not part of ``make test``. Usage::

    python benchmarks/admission_load.py [--model embedded|DIR] [--base-rate 2] [--duration 40]
        [--tier-mix interactive=0.3,standard=0.5,batch=0.2] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import yaml  # noqa: E402

from mm_serve.bench.launch import LocalServer  # noqa: E402
from mm_serve.bench.requests import noise_image_uri  # noqa: E402
from mm_serve.config import load_config  # noqa: E402

LOADS = (1.0, 2.0, 4.0)
TIERS = ("interactive", "standard", "batch")


@dataclass
class Outcome:
    """One request as the client saw it."""

    tier: str
    status: int = 0
    elapsed_s: float = 0.0  # to the response (a rejection) or to the last chunk
    ttft_s: float | None = None
    tpot_s: float | None = None
    predicted_ttft_s: float | None = None
    token_times: list[float] = field(default_factory=list)


def parse_mix(text: str) -> dict[str, float]:
    mix = {}
    for part in text.split(","):
        name, _, share = part.partition("=")
        if name not in TIERS:
            raise SystemExit(f"--tier-mix: unknown tier {name!r} (tiers: {', '.join(TIERS)})")
        mix[name] = float(share)
    total = sum(mix.values())
    return {k: v / total for k, v in mix.items()}


async def one(http: httpx.AsyncClient, url: str, tier: str, index: int) -> Outcome:
    body = {"model": "bench", "stream": True, "ignore_eos": True, "temperature": 0,
            "max_tokens": 8 + index % 41, "service_tier": tier,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": noise_image_uri(64 + index % 64, index)}},
                {"type": "text", "text": f"What is in picture {index}?"}]}]}
    out = Outcome(tier)
    start = time.monotonic()
    try:
        async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            out.status = r.status_code
            header = r.headers.get("x-mm-serve-predicted-ttft-ms")
            out.predicted_ttft_s = None if header is None else float(header) / 1000
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("delta", {}).get("content"):
                    out.token_times.append(time.monotonic())
    except httpx.HTTPError:
        out.status = -1
    out.elapsed_s = time.monotonic() - start
    if out.token_times:
        out.ttft_s = out.token_times[0] - start
        n = len(out.token_times)
        out.tpot_s = (out.token_times[-1] - out.token_times[0]) / (n - 1) if n > 1 else 0.0
    return out


async def run_load(url: str, rate: float, duration_s: float, mix: dict[str, float], seed: int) -> list[Outcome]:
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    while t < duration_s:
        t += rng.expovariate(rate)
        arrivals.append((t, rng.choices(list(mix), weights=list(mix.values()))[0]))
    async with httpx.AsyncClient(trust_env=False, timeout=300.0,
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=64)) as http:
        start = time.monotonic()

        async def fire(at: float, tier: str, index: int) -> Outcome:
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            return await one(http, url, tier, index)

        return list(await asyncio.gather(*(fire(at, tier, i) for i, (at, tier) in enumerate(arrivals))))


async def probe_rate(url: str, num_requests: int = 8) -> float:
    """1 / mean e2e seconds of ``num_requests`` standard requests sent one at a time (after one warm-up)."""
    async with httpx.AsyncClient(trust_env=False, timeout=300.0) as http:
        await one(http, url, "standard", 10_000)
        times = [(await one(http, url, "standard", 10_001 + i)).elapsed_s for i in range(num_requests)]
    return 1.0 / statistics.mean(times)


def summarize(outcomes: list[Outcome], slo: dict[str, tuple[float, float]], duration_s: float) -> dict[str, Any]:
    per_tier: dict[str, Any] = {}
    met_total = 0
    for tier in TIERS:
        mine = [o for o in outcomes if o.tier == tier]
        admitted = [o for o in mine if o.status == 200 and o.ttft_s is not None]
        rejected = [o for o in mine if o.status in (429, 503)]
        ttft_slo, tpot_slo = slo[tier]
        met = [o for o in admitted if o.ttft_s <= ttft_slo and (o.tpot_s or 0.0) <= tpot_slo]  # type: ignore[operator]
        met_total += len(met)
        per_tier[tier] = {
            "sent": len(mine), "admitted": len(admitted), "rejected": len(rejected),
            "attainment_of_admitted": len(met) / len(admitted) if admitted else None,
            "rejection_rate": len(rejected) / len(mine) if mine else None,
            "slowest_rejection_ms": 1000 * max((o.elapsed_s for o in rejected), default=0.0),
        }
    errors = [abs(o.predicted_ttft_s - o.ttft_s) / o.ttft_s for o in outcomes
              if o.status == 200 and o.ttft_s and o.predicted_ttft_s is not None]
    return {"tiers": per_tier, "slo_meeting_rate": met_total / duration_s,
            "median_ttft_prediction_error": statistics.median(errors) if errors else None,
            "other_failures": sum(1 for o in outcomes if o.status not in (200, 429, 503))}


def serve_and_load(args: argparse.Namespace, predict: bool, folder: Path) -> dict[str, Any]:
    base = yaml.safe_load(Path(args.config).read_text()) if args.config else {}
    base.setdefault("admission", {})["predict"] = predict
    config = folder / f"config-{'on' if predict else 'off'}.yaml"
    config.write_text(yaml.safe_dump(base))
    cfg = load_config(config)
    slo = {t: (getattr(cfg.slo.tiers, t).ttft_ms / 1000, getattr(cfg.slo.tiers, t).tpot_ms / 1000) for t in TIERS}
    results: dict[str, Any] = {}
    with LocalServer(folder / f"server-{'on' if predict else 'off'}.log", str(config), args.model) as server:
        if args.base_rate is None:
            args.base_rate = asyncio.run(probe_rate(server.url))
            print(f"base rate (1 / mean unloaded e2e): {args.base_rate:.2f} req/s", flush=True)
        asyncio.run(run_load(server.url, args.base_rate / 2, 10.0, parse_mix(args.tier_mix), args.seed + 99))  # warm-up
        for load in LOADS:
            outcomes = asyncio.run(run_load(server.url, args.base_rate * load, args.duration,
                                            parse_mix(args.tier_mix), args.seed))
            results[f"{load:g}x"] = summarize(outcomes, slo, args.duration)
            print(f"admission {'on ' if predict else 'off'} {load:g}x: {json.dumps(results[f'{load:g}x'])}", flush=True)
            time.sleep(5.0)  # let the queues drain before the next load
    return results


def plot(doc: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in ("on", "off"):
        for tier in ("interactive", "standard"):
            ys = [doc[mode][f"{x:g}x"]["tiers"][tier]["attainment_of_admitted"] or 0.0 for x in LOADS]
            ax.plot(LOADS, ys, marker="o", linestyle="-" if mode == "on" else "--", label=f"{tier}, admission {mode}")
    ax.set_xlabel("offered load (x base rate)")
    ax.set_ylabel("SLO attainment of admitted requests")
    ax.set_ylim(0, 1.05)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="embedded")
    p.add_argument("--config", default=None, help="server config YAML (default: the defaults)")
    p.add_argument("--base-rate", type=float, default=None, help="the 1x rate, requests/s (default: probed)")
    p.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per load")
    p.add_argument("--tier-mix", default="interactive=0.3,standard=0.5,batch=0.2")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    folder = Path(args.out or tempfile.mkdtemp(prefix="admission-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    on = serve_and_load(args, True, folder)
    off = serve_and_load(args, False, folder)
    doc = {"base_rate": args.base_rate, "tier_mix": args.tier_mix, "duration_s": args.duration, "on": on, "off": off}
    (folder / "admission.json").write_text(json.dumps(doc, indent=2))
    print(f"wrote {folder / 'admission.json'}")
    plot(doc, folder / "admission.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
