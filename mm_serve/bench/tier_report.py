"""``mm-serve bench --tier-mix``: tiers drawn per request, and the per-tier figures of a run.

Each request's ``service_tier`` is drawn (seeded by its index) from the mix. Per tier a
run reports: requests sent, the share refused (HTTP 429 or 503), the SLO attainment of
the admitted ones against the tier's SLOs (``slo.tiers`` of the server's config, or the
defaults), and the goodput of the admitted ones (requests/s that met both SLOs).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from mm_serve.bench.records import RequestRecord
from mm_serve.config import SLOConfig
from mm_serve.ground.tiers import Tier

TIER_LABELS = tuple(tier.label for tier in Tier)  # interactive, standard, batch: tightest first


def parse_tier_mix(text: str) -> dict[str, float]:
    """``interactive=0.3,standard=0.5,batch=0.2`` → shares summing to 1.

    Raises:
        ValueError: an unknown tier, a share that is not a non-negative number, or all zero.
    """
    mix: dict[str, float] = {}
    for part in text.split(","):
        name, sep, share = part.strip().partition("=")
        if name not in TIER_LABELS or not sep:
            raise ValueError(f"--tier-mix wants tier=share pairs with tiers {', '.join(TIER_LABELS)}, got {part!r}")
        try:
            value = float(share)
        except ValueError:
            raise ValueError(f"--tier-mix: share of {name} is not a number: {share!r}") from None
        if not value >= 0:
            raise ValueError(f"--tier-mix: share of {name} must be >= 0, got {share}")
        mix[name] = value
    total = sum(mix.values())
    if total <= 0:
        raise ValueError("--tier-mix: the shares add up to 0")
    return {name: share / total for name, share in mix.items()}


def draw_tier(mix: dict[str, float], index: int, salt: int = 0) -> str:
    """The tier of request ``index`` (the same for the same index, salt and mix)."""
    rng = random.Random(f"tier:{salt}:{index}")
    return rng.choices(list(mix), weights=list(mix.values()))[0]


def refused(record: RequestRecord) -> bool:
    """Whether admission refused the request (HTTP 429 or 503)."""
    return bool(record.error) and str(record.error).startswith(("HTTP 429", "HTTP 503"))


def tier_lines(records: Sequence[RequestRecord], slo: SLOConfig, duration_s: float) -> list[str]:
    """One line per tier present in ``records`` (see the module docstring); ``duration_s`` is the
    run's span of arrivals, seconds."""
    lines = []
    for tier in TIER_LABELS:
        mine = [r for r in records if r.tier == tier]
        if not mine:
            continue
        target = getattr(slo.tiers, tier)
        admitted = [r for r in mine if r.ok]
        met = [r for r in admitted if r.ttft_s is not None and r.ttft_s <= target.ttft_ms / 1000
               and r.tpot_s <= target.tpot_ms / 1000]
        attained = f"{100 * len(met) / len(admitted):.0f} %" if admitted else "-"
        lines.append(
            f"  {tier:<11} sent {len(mine):4d}  refused {100 * sum(map(refused, mine)) / len(mine):5.1f} %  "
            f"attainment of admitted {attained:>5} (TTFT {target.ttft_ms:g} ms, TPOT {target.tpot_ms:g} ms)  "
            f"goodput of admitted {len(met) / max(duration_s, 1e-9):.2f} req/s")
    return lines
