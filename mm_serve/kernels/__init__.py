"""Kernels: attention over paged KV (torch reference, compiled CPU kernels, flash-attn on CUDA),
the page pool, and oneDNN-packed linear layers.

Each kernel has a plain-torch reference that runs on the CPU; the compiled and CUDA backends
implement the same interface and are selected at run time. The C++ sources live in the
repository's top-level ``kernels/csrc/`` (linked here as ``csrc/``, shipped in the wheel).
"""
