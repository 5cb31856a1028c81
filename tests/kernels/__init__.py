"""Tests of kernels/: the cross-modal ring buffer, its allocators and KV page transfer."""
