"""The runtime every worker stands on: the request and its lifetime events, the KV cache,
the model runner, the sampler, the post-step, the worker shell and its channel.

Imports only :mod:`kernels` and :mod:`mm_serve.models` (checked by ``lint-imports``,
contracts in ``pyproject.toml``); the two stages (:mod:`vision_prefill`,
:mod:`text_decode`) and the front end import it.
"""
