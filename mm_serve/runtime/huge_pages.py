"""CPU tensors on transparent huge pages (2 MiB), for the KV cache's scattered page reads.

Decode attention reads every running context's K/V each step from pages scattered over
the cache (``kernels/csrc/paged_decode_attention_cpu.cpp``). On 4 KiB pages a 1 GiB cache
spans 262,144 pages, and the page walks cost bandwidth: on 2 cores of an Intel Xeon the
kernel read 18.8 GB/s of K/V from huge pages against 15.8 GB/s from 4 KiB pages (batch 64,
1,024-token contexts; ``benchmarks/decode_attention.py`` with and without ``--small-pages``,
benchmarks/results/2026-12-06-decode-attention-blocks.md).

Most distributions set transparent huge pages to ``madvise``: only regions that ask get
them. The tensor here is its own anonymous mapping (``mmap``), advised with
``MADV_HUGEPAGE`` before its first write faults it in (Linux
Documentation/admin-guide/mm/transhuge.rst), so that neither the advice nor the huge pages
reach memory the allocator hands out later; it is unmapped when the tensor is freed. Under
``always`` the advice changes nothing; under ``never`` the pages stay 4 KiB. With THP
``defrag`` set to ``madvise`` or ``always``, faulting a large cache in may compact memory
first, which can lengthen a worker's start on a fragmented machine.
"""

from __future__ import annotations

import mmap
import sys

import torch


def huge_page_zeros(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A zero-filled CPU tensor of ``shape`` on its own memory mapping, advised onto huge pages.

    Every page is written once here (as ``torch.zeros`` does), so the cache's memory is
    resident from the start and no decode step pays its page faults.

    Args:
        shape: the tensor's sizes (elements).
        dtype: its element type.

    Returns:
        A contiguous tensor. Off Linux, or where Python's ``mmap`` has no ``madvise`` /
        ``MADV_HUGEPAGE``, or for an empty shape, a plain ``torch.zeros`` tensor; a refused
        advice (a kernel without THP) leaves the mapping on 4 KiB pages.

    Raises:
        OSError: the mapping cannot be made (out of address space or memory), where
            ``torch.zeros`` would raise a RuntimeError.
    """
    numel = 1
    for size in shape:
        numel *= size
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0 or not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(*shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP compiled out: the mapping stays on small pages
        pass
    tensor = torch.frombuffer(region, dtype=dtype, count=numel).view(*shape)  # keeps `region` alive
    return tensor.zero_()
