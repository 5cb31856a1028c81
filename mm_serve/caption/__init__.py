"""``mm-serve caption``: batch image captioning, resumable, on the in-process engine or any OpenAI server.

Modules, one job each:

* :mod:`~mm_serve.caption.inputs`: folder / JSONL / OpenAI batch readers, stable ids;
* :mod:`~mm_serve.caption.records`: an input's :class:`Outcome` and its output row;
* :mod:`~mm_serve.caption.output`: append + flush writer, resume from an existing OUT;
* :mod:`~mm_serve.caption.backends`: the backend contract and shared image loading;
* :mod:`~mm_serve.caption.engine_backend`, :mod:`~mm_serve.caption.engine_batch`,
  :mod:`~mm_serve.caption.engine_requests`: the in-process disaggregated engine;
* :mod:`~mm_serve.caption.server_backend`: any OpenAI-compatible server (``--server``);
* :mod:`~mm_serve.caption.runner`: the in-flight window, progress bar, stop handling;
* :mod:`~mm_serve.caption.summary`: counts, images/s, latency percentiles.

The user guide is ``docs/caption.md``.
"""
