"""Kernels: attention over paged KV, KV page writes and copies, shared-memory transfer.

Each kernel has a plain-torch reference that runs on CPU; CUDA backends
(flash-attn, cupy) implement the same interface and are selected at run time.
"""
