"""Hand-off transports from the prefill stage to the decode stage.

The protocol: :mod:`~mm_serve.transport.ring_spec` (a ring's spec, the hand-off record),
:mod:`~mm_serve.transport.base` (the one interface), :mod:`~mm_serve.transport.staging`
(the producer's page and feature allocation), :mod:`~mm_serve.transport.registry` (the
table of transports). The transports: :mod:`~mm_serve.transport.shm_ring` (shared memory,
laid out by :mod:`~mm_serve.transport.ring_layout` in :mod:`~mm_serve.transport.shm_segment`
segments) and :mod:`~mm_serve.transport.ray_ring` (Ray's object store, through an actor's
:mod:`~mm_serve.transport.ray_link`). Around them: the doorbell, page copies
(:mod:`~mm_serve.transport.kv_transfer`), checksums and the feature arena.
"""
