"""The SLO tiers under an overload of text and photo calls: what each tier gets, this checkout against
another git revision, alternated round by round.

    python benchmarks/tier_overload.py --baseline-rev 4cc0931 --rounds 2 --rate 20 --duration 25

Each round starts a fresh ``mm-serve serve --mode colocated`` (the embedded model, default SLOs) from each
tree in turn and sends it an open loop of streamed chat calls, Poisson arrivals at ``--rate`` calls/s
for ``--duration`` s, each of a tier drawn from ``--tiers`` (OpenAI's names: priority, default, flex)
and a kind drawn from text only, a 320x240 JPEG and a 4000x3000 JPEG (random pixels, ~14 MB as a data
URI), ``--max-tokens`` tokens each (ignore_eos). Prints per tree and tier the calls sent, admitted
(200) and on time (TTFT and TPOT within the tier's default SLOs: priority 1 s / 100 ms, default 4 s /
250 ms, flex 60 s / 2 s, measured by this client), and the largest TPOT of the admitted ones. The
client runs on the same machine, as every benchmark here does. The baseline runs from a temporary
``git worktree`` with this venv's Python (as ``benchmarks/start_time.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import random
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from start_time import checkout_trees, colocated_server  # noqa: E402

SLO_S = {"priority": (1.0, 0.1), "default": (4.0, 0.25), "flex": (60.0, 2.0)}  # (TTFT, TPOT), the defaults


@dataclass
class Outcome:
    """One call: its tier and kind, HTTP status, and (admitted) its TTFT and mean TPOT in seconds."""

    tier: str
    kind: str
    status: int
    ttft_s: float | None = None
    tpot_s: float | None = None

    @property
    def on_time(self) -> bool:
        ttft, tpot = SLO_S[self.tier]
        return self.ttft_s is not None and self.ttft_s <= ttft and (self.tpot_s or 0.0) <= tpot


def _jpeg_uri(width: int, height: int, seed: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


async def _call(client: httpx.AsyncClient, url: str, model: str, tier: str, kind: str, image: str | None,
                max_tokens: int) -> Outcome:
    content: list[dict[str, object]] = [{"type": "text", "text": "Describe this in detail, please."}]
    if image is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": image}})
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "service_tier": tier, "cache_salt": uuid.uuid4().hex}
    started = time.monotonic()
    tokens: list[float] = []
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return Outcome(tier, kind, response.status_code)
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[len("data: "):])
                    if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                        tokens.append(time.monotonic())
    except httpx.HTTPError:
        return Outcome(tier, kind, 0)
    if not tokens:
        return Outcome(tier, kind, 200)
    tpot = (tokens[-1] - tokens[0]) / (len(tokens) - 1) if len(tokens) > 1 else 0.0
    return Outcome(tier, kind, 200, tokens[0] - started, tpot)


async def _load(url: str, args: argparse.Namespace, images: dict[str, str | None], seed: int) -> list[Outcome]:
    rng = random.Random(seed)
    tiers = args.tiers.split(",")
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=4096)) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        calls: list[asyncio.Task[Outcome]] = []
        start, at = time.monotonic(), 0.0
        while True:
            at += rng.expovariate(args.rate)
            if at >= args.duration:
                break
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            kind = rng.choice(list(images))
            calls.append(asyncio.create_task(_call(client, url, model, rng.choice(tiers), kind, images[kind],
                                                   args.max_tokens)))
        return list(await asyncio.gather(*calls))


def _report(name: str, outcomes: list[Outcome]) -> list[str]:
    lines = []
    for tier in SLO_S:
        sent = [o for o in outcomes if o.tier == tier]
        if not sent:
            continue
        admitted = [o for o in sent if o.status == 200 and o.ttft_s is not None]
        on_time = sum(o.on_time for o in admitted)
        tpot = max((o.tpot_s or 0.0 for o in admitted), default=0.0)
        kinds = ", ".join(f"{kind} {sum(o.on_time for o in admitted if o.kind == kind)}/"
                          f"{sum(o.status == 200 for o in sent if o.kind == kind)}/{sum(o.kind == kind for o in sent)}"
                          for kind in ("text", "small", "photo"))
        lines.append(f"{name}, {tier}: sent {len(sent)}, admitted {len(admitted)}, on time {on_time} "
                     f"(on time/admitted/sent: {kinds}); largest TPOT {1000 * tpot:.0f} ms")
    statuses = Counter(o.status for o in outcomes)
    lines.append(f"{name}: statuses {dict(sorted(statuses.items()))}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rate", type=float, default=20.0, help="calls per second")
    parser.add_argument("--duration", type=float, default=25.0, help="seconds of arrivals")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--tiers", default="priority,default,flex")
    parser.add_argument("--baseline-rev", help="git revision to compare against (omit: this checkout only)")
    args = parser.parse_args()
    images = {"text": None, "small": _jpeg_uri(320, 240, 1), "photo": _jpeg_uri(4000, 3000, 2)}
    with checkout_trees(args.baseline_rev) as trees:
        totals: dict[str, list[Outcome]] = {name: [] for name in trees}
        for round_ in range(1, args.rounds + 1):
            for name, tree in (trees.items() if round_ % 2 else reversed(trees.items())):
                with colocated_server(tree) as url:
                    outcomes = asyncio.run(_load(url, args, images, seed=round_))
                totals[name] += outcomes
                print("\n".join(_report(f"round {round_}, {name}", outcomes)), flush=True)
    for name, outcomes in totals.items():
        print("\n".join(_report(f"all rounds, {name}", outcomes)))


if __name__ == "__main__":
    main()
