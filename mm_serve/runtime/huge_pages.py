"""Back large CPU tensors (the KV cache) with transparent huge pages where Linux allows it.

Decode attention reads every running context's K/V each step from pages scattered over
the cache (``kernels/csrc/paged_decode_attention_cpu.cpp``). On 4 KiB pages a 1 GiB cache
spans 262,144 pages, and the page walks cost bandwidth: on 2 cores of an Intel Xeon the
kernel read 18.5 GB/s of K/V from huge pages against 15.8 GB/s from 4 KiB pages (batch 64,
1,024-token contexts; ``benchmarks/decode_attention.py`` with and without ``--small-pages``,
benchmarks/results/2026-12-06-decode-attention-blocks.md).

Most distributions set transparent huge pages to ``madvise`` (only regions that ask get
them), so the cache asks: ``madvise(MADV_HUGEPAGE)`` on the 2 MiB-aligned part of a fresh,
untouched allocation, before its first write faults it in (Linux
Documentation/admin-guide/mm/transhuge.rst). Under ``always`` this changes nothing; under
``never``, or off Linux, it is a no-op. PyTorch's ``THP_MEM_ALLOC_ENABLE=1`` does the same
for every allocation of 2 MiB or more.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import torch

MADV_HUGEPAGE = 14  # linux/mman.h
HUGE_PAGE_BYTES = 2 << 20


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask Linux to back ``tensor``'s storage with transparent huge pages.

    Call it on a freshly allocated tensor before writing to it: pages already faulted
    in stay 4 KiB until the kernel's background collapse. Only the 2 MiB-aligned
    interior of the storage is advised (the ragged ends keep small pages).

    Args:
        tensor: a CPU tensor of any dtype and shape.

    Returns:
        True when the kernel accepted the advice; False off Linux, on another device,
        for storages smaller than one aligned huge page, or when ``madvise`` fails
        (kernels built without THP). Never raises.
    """
    if not sys.platform.startswith("linux") or tensor.device.type != "cpu":
        return False
    storage = tensor.untyped_storage()
    start = storage.data_ptr()
    end = start + storage.nbytes()
    aligned = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    length = (end - aligned) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if length <= 0:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise(aligned, length, MADV_HUGEPAGE) == 0
