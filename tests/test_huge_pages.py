"""The KV cache lives on transparent huge pages where Linux's setting allows it."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from mm_serve.runtime import huge_pages
from mm_serve.runtime.huge_pages import huge_page_zeros
from mm_serve.runtime.kv_cache import PagedKVCache

THP = Path("/sys/kernel/mm/transparent_hugepage")
HUGE = 2 << 20


def _setting(name: str) -> str | None:
    """The bracketed choice of a THP setting ('always', 'madvise', 'never', ...), or None."""
    try:
        match = re.search(r"\[([\w+]+)\]", (THP / name).read_text())
    except OSError:
        return None
    return match.group(1) if match else None


def _huge_bytes_of(tensor: torch.Tensor) -> int:
    """AnonHugePages of the mappings that overlap ``tensor``'s storage (/proc/self/smaps)."""
    start = tensor.untyped_storage().data_ptr()
    end = start + tensor.untyped_storage().nbytes()
    total, overlaps = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            overlaps = int(head.group(1), 16) < end and start < int(head.group(2), 16)
        elif overlaps and line.startswith("AnonHugePages:"):
            total += int(line.split()[1]) * 1024
    return total


# direct compaction on fault (defrag madvise/always) makes the huge pages near-certain; with
# defer or never the kernel may fall back to small pages on fragmented memory
needs_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or _setting("enabled") not in ("always", "madvise")
    or _setting("defrag") not in ("always", "madvise", "defer+madvise"),
    reason="transparent huge pages are off here, or not faulted in on demand (or not Linux)",
)


@needs_thp
def test_the_kv_cache_lives_on_huge_pages_and_is_zeroed() -> None:
    cache = PagedKVCache(num_layers=8, num_pages=255, page_size=16, num_kv_heads=4, head_dim=64)  # 64 MiB
    assert _huge_bytes_of(cache.data) >= 24 * HUGE  # most of its 31-32 huge pages
    assert not cache.data.any()
    k, v = cache.layer_caches[3]
    k[5, 2] = 1.5
    assert cache.data[5, 3, 0, 2].eq(1.5).all() and v.abs().sum() == 0  # the views share the mapping


@pytest.mark.skipif(_setting("enabled") != "madvise", reason="only under 'madvise' does the advice decide")
def test_without_the_advice_the_same_allocation_stays_on_small_pages() -> None:
    plain = torch.zeros(32 * HUGE // 4)
    assert _huge_bytes_of(plain) == 0


def test_shapes_dtypes_and_fallbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    half = huge_page_zeros(3, 5, dtype=torch.float16)
    assert half.shape == (3, 5) and half.dtype == torch.float16 and half.is_contiguous() and not half.any()
    assert huge_page_zeros(0, 4).shape == (0, 4)
    monkeypatch.setattr(huge_pages.sys, "platform", "darwin")
    other = huge_page_zeros(2, 2)
    assert other.shape == (2, 2) and not other.any()
