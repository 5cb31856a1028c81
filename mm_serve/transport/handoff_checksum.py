"""Payload checksum of a ring hand-off: CRC-32 of its KV pages and feature rows.

The prefill side computes it over the ring pages after copying them in and puts it in
the hand-off's meta; the decode side recomputes it over the same ring memory before it
releases the hand-off. A mismatch means the pages or features changed between publish
and claim (another hand-off written over them, a stray write): the decode worker
refuses the hand-off and the request is prefilled again, so no answer is computed
from KV that belongs to another request. ``zlib.crc32`` runs at roughly 2.4 GB/s on
one core here (against about 6.5 GB/s for the copy itself); ``fault.handoff_checksum:
false`` turns it off.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch


def _bytes_of(t: torch.Tensor) -> bytes | memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (any dtype)."""
    return t.contiguous().view(torch.uint8).numpy().data


def handoff_checksum(
    ring_pages: torch.Tensor, page_ids: Sequence[int], features: torch.Tensor | None = None,
    feature_offset: int = 0, feature_rows: int = 0,
) -> int:
    """CRC-32 (an unsigned 32-bit int) of ``ring_pages[page_ids]`` in order, then of
    ``features[feature_offset : feature_offset + feature_rows]``.

    ``ring_pages``: ``[num_pages, *page_shape]``; ``features``: ``[rows, dim]``; both
    host tensors (the ring's shared-memory views).
    """
    crc = 0
    for page in page_ids:
        crc = zlib.crc32(_bytes_of(ring_pages[page]), crc)
    if features is not None and feature_rows:
        crc = zlib.crc32(_bytes_of(features[feature_offset : feature_offset + feature_rows]), crc)
    return crc
