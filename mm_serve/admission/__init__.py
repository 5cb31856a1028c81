"""Admission control of the API front end: hard bounds and the latency predictor.

* :mod:`~mm_serve.admission.rejection`: the refusal every check raises (status, reason, Retry-After).
* :mod:`~mm_serve.admission.bounds`: work limit and queue caps (always on).
* :mod:`~mm_serve.admission.byte_budget`: bytes of images being decoded at once.
* :mod:`~mm_serve.admission.online_fit`, :mod:`~mm_serve.admission.predictor`: TTFT/TPOT prediction.
* :mod:`~mm_serve.admission.learning`: what the predictor and the tiers' feedback learn from the workers.
* :mod:`~mm_serve.admission.controller`: the admission rule, reading the load through
  :class:`~mm_serve.admission.load_source.LoadSource`.
"""
