"""Hand-off transports from the prefill stage to the decode stage: the ring protocol (layout
and record), the shared-memory ring, the Ray ring across nodes, the doorbell, page copies and
checksums."""
