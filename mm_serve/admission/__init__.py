"""Admission control of the API front end: SLO tiers, hard bounds, the latency predictor.

* :mod:`~mm_serve.admission.tiers`: the three tiers and OpenAI ``service_tier`` values.
* :mod:`~mm_serve.admission.rejection`: the refusal every check raises (status, reason, Retry-After).
* :mod:`~mm_serve.admission.bounds`: work limit and queue caps (always on).
* :mod:`~mm_serve.admission.byte_budget`: bytes of images being decoded at once.
* :mod:`~mm_serve.admission.online_fit`, :mod:`~mm_serve.admission.predictor`: TTFT/TPOT prediction.
* :mod:`~mm_serve.admission.controller`: the checks in order, per API call.
"""
