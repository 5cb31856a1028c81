"""The decode stage: the decode worker, the continuous-batching scheduler (admission, the
decode running set, preemption by recompute) and the receiving side of the KV hand-off.

Stands on :mod:`mm_serve.runtime`; never imports :mod:`mm_serve.vision_prefill` or the front end.
"""
