"""The KV cache asks for transparent huge pages, and Linux gives them where its setting allows."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from mm_serve.runtime.huge_pages import HUGE_PAGE_BYTES, advise_huge_pages
from mm_serve.runtime.kv_cache import PagedKVCache

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    """The bracketed mode of the kernel's THP setting ('always', 'madvise', 'never'), or None."""
    try:
        match = re.search(r"\[(\w+)\]", THP_SETTING.read_text())
    except OSError:
        return None
    return match.group(1) if match else None


def _huge_bytes_of(tensor: torch.Tensor) -> int:
    """AnonHugePages of the mappings that overlap ``tensor``'s storage, from /proc/self/smaps."""
    start = tensor.untyped_storage().data_ptr()
    end = start + tensor.untyped_storage().nbytes()
    total, overlaps = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            low, high = int(head.group(1), 16), int(head.group(2), 16)
            overlaps = low < end and start < high
        elif overlaps and line.startswith("AnonHugePages:"):
            total += int(line.split()[1]) * 1024
    return total


needs_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or _thp_mode() not in ("always", "madvise"),
    reason="transparent huge pages are off (or not Linux) here",
)


@needs_thp
def test_an_advised_fresh_tensor_is_faulted_in_on_huge_pages() -> None:
    tensor = torch.empty(16 * HUGE_PAGE_BYTES // 4)  # 32 MiB of float32, untouched
    assert advise_huge_pages(tensor)
    tensor.zero_()
    assert _huge_bytes_of(tensor) >= 4 * HUGE_PAGE_BYTES  # most of its 15 aligned huge pages


@needs_thp
def test_the_kv_cache_lives_on_huge_pages() -> None:
    cache = PagedKVCache(num_layers=8, num_pages=256, page_size=16, num_kv_heads=4, head_dim=64)  # 64 MiB
    assert _huge_bytes_of(cache.data) >= 8 * HUGE_PAGE_BYTES
    assert not cache.data.any()  # zeroed after the advice, as torch.zeros was


def test_small_or_foreign_tensors_are_left_alone() -> None:
    assert not advise_huge_pages(torch.empty(1024))  # less than one aligned huge page
    if torch.cuda.is_available():
        assert not advise_huge_pages(torch.empty(HUGE_PAGE_BYTES, device="cuda"))
