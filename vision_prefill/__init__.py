"""The prefill stage: the prefill worker (vision tower + projector + LLM prefill, first token),
its scheduler (length buckets, token budget) and the sending side of the KV hand-off.

Stands on :mod:`mm_serve.runtime`; never imports :mod:`mm_serve.text_decode` or the front end.
"""
