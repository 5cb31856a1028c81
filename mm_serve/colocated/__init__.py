"""The colocated stage: one engine that runs every phase (vLLM-style continuous batching over
the decode stage's scheduler), in the caller's process or in a worker shell. It joins both
stages, so it stands above them."""
