"""``mm-serve bench``: the load generator, its metrics and reports, and the goodput search.

It sends the requests of a workload (:mod:`mm_serve.workloads`, shared with the placement
planner) to any OpenAI-compatible server at a request rate, records each request's TTFT
and TPOT (seconds), scores them against an SLO (:class:`mm_serve.ground.slo.SLO`) and
searches the highest rate that meets the attainment target (the goodput).
"""
