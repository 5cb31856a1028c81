"""Decode pacing: how long a decode worker leaves between the starts of two steps.

With ``decode_step_interval_s`` a decode worker starts a step at most every that many seconds; with
``decode_step_pacing`` (a fraction in [0, 1)) at most every that fraction of the tightest TPOT SLO
among its running requests, so a prefill worker sharing
its core runs in the gaps while every running request still gets its tokens in time. The decode
worker paces its steps with it (:meth:`mm_serve.text_decode.decode_worker.DecodeWorker.step_interval_s`)
and the admission predictor prices a paced step with it (:mod:`mm_serve.admission.predictor`),
so both read the same rule from here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

MAX_PACED_INTERVAL_S = 1.0  # the longest paced interval (decode_step_interval_s's bound: heartbeats stay frequent)


def paced_interval_s(fixed_s: float, pacing: float, tier_tpot_s: Sequence[float], ranks: Iterable[int]) -> float:
    """Seconds from one decode step's start to the next's at the soonest.

    Args:
        fixed_s: ``decode_step_interval_s``, a fixed interval in seconds (0 = none); it wins when set
            (the config allows one of the two).
        pacing: ``decode_step_pacing``, a fraction in [0, 1); 0 means unpaced by rule.
        tier_tpot_s: the TPOT SLO of each tier in seconds, by rank (interactive, standard, batch).
        ranks: the tier ranks of the running requests (a rank past the table counts as the last tier,
            a negative one as the first).

    Returns:
        ``fixed_s`` when set; else ``pacing`` times the smallest TPOT SLO among ``ranks``, at most
        :data:`MAX_PACED_INTERVAL_S`; 0.0 when neither paces, when ``ranks`` is empty or the table is.
    """
    if fixed_s:
        return fixed_s
    if not pacing or not tier_tpot_s:
        return 0.0
    last = len(tier_tpot_s) - 1
    slos = [tier_tpot_s[min(max(rank, 0), last)] for rank in ranks]
    return min(MAX_PACED_INTERVAL_S, pacing * min(slos)) if slos else 0.0
