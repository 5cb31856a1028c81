"""The words of a 429: what was predicted, against which SLO, and what the client can do."""

from __future__ import annotations

from mm_serve.admission.predictor import LateRequest
from mm_serve.ground.tiers import Tier

ADVICE = "retry later, or send service_tier 'flex' (batch tier, never refused for latency)"


def amount(seconds: float) -> str:
    """An excess in words: ``0.0004`` -> "under 1 ms", ``0.0123`` -> "12 ms", ``1.5`` -> "1.500 s"."""
    ms = round(1000 * seconds)
    if ms >= 1000:
        return f"{seconds:.3f} s"
    return "under 1 ms" if ms < 1 else f"{ms} ms"


def limit(margin: float, factor: float = 1.0) -> str:
    """How the refusal threshold relates to the SLO, in words (``factor``: the attainment feedback's)."""
    if factor < 1:
        return (f"admission refuses above {100 * (1 + margin) * factor:.0f} % of the SLO: admission.margin {margin:g}, "
                f"tightened x{factor:.2f} while the tier's requests have been missing it more than its attainment "
                f"target allows")
    if margin < 0:
        return f"admission refuses above {100 * (1 + margin):.0f} % of the SLO, admission.margin {margin:g}"
    return f"admission refuses above the SLO + {100 * margin:.0f} %, admission.margin {margin:g}"


def over_slo(what: str, tier: Tier, predicted: float, slo: float, margin: float, factor: float) -> str:
    """A prediction of ``what`` ("TTFT" or "TPOT"), seconds, refused against its ``slo`` (seconds)."""
    excess = predicted - slo
    relation = (f"over its {what} SLO of {slo:.3f} s by {amount(excess)} ({100 * excess / slo:.0f} %" if excess > 0
                else f"{-100 * excess / slo:.0f} % under its {what} SLO of {slo:.3f} s (")
    sep = "; " if excess > 0 else ""
    return (f"the service is overloaded for the {tier.label} tier: the predicted {what} is {predicted:.3f} s, "
            f"{relation}{sep}{limit(margin, factor)}); {ADVICE}")


def over_spread(tier: Tier, attainment: float, predicted: float, upper: float, spread: float, slo: float,
                factor: float) -> str:
    """A TTFT prediction whose upper bound at the tier's ``attainment`` target is over its ``slo`` (seconds)."""
    percent = round(100 * attainment)
    tightened = "" if factor >= 1 else f" x {factor:.2f} (tightened while the tier's requests miss its attainment target)"
    return (f"the service is overloaded for the {tier.label} tier: the predicted TTFT is {predicted:.3f} s, and with "
            f"the spread of recent measurements around predictions ({spread:.2f}x at the {percent}th percentile, "
            f"its attainment target) {upper:.3f} s, over its TTFT SLO of {slo:.3f} s{tightened} by "
            f"{amount(upper - slo * factor)}; {ADVICE}")


def breaks_tighter(tier: Tier, tighter: Tier, live: bool, predicted: float, slo: float, margin: float,
                   factor: float) -> str:
    """A request that would push the decode step of ``tighter`` requests (``live`` there, or room kept
    for them) past their TPOT ``slo`` (seconds)."""
    serving = f"serving {tighter.label} requests" if live else f"keeping room for {tighter.label} requests"
    return (f"the service is overloaded for the {tier.label} tier: its decode worker is {serving}, "
            f"whose TPOT SLO is {slo:.3f} s, and with this request the predicted TPOT is {predicted:.3f} s "
            f"({limit(margin, factor)}); {ADVICE}")


def makes_late(tier: Tier, late: LateRequest, factor: float = 1.0) -> str:
    """A call refused to keep ``late``, a queued request of a looser tier, on time (``factor``: the
    attainment feedback's on that tier's TTFT limit)."""
    looser = late.tier.label
    tightened = "" if factor >= 1 else (f" x {factor:.2f}, tightened while the {looser} tier's requests miss its "
                                        f"attainment target,")
    return (f"the service is overloaded for the {tier.label} tier: this request would be prefilled before a queued "
            f"{looser} tier request admitted earlier and delay its first token to {late.first_token_in_s:.3f} s from "
            f"now, past its TTFT SLO{tightened} ({late.due_in_s:.3f} s from now) by {amount(late.late_by_s)}; {ADVICE}")
