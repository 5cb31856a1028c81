"""Decode domain: paged KV cache, page (block) manager, continuous batching, sampling."""
