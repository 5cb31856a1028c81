"""Page pool: exact ids on allocate/free/reuse, typed exhaustion, integrity under random operations."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mm_serve.kernels.page_pool import PagePool, PagePoolExhaustedError


def test_fresh_pool_hands_out_ids_in_order() -> None:
    pool = PagePool(8)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    assert pool.num_free == 3 and pool.num_used == 5
    assert pool.free_page_ids() == [5, 6, 7]


def test_freed_pages_are_reused_in_release_order() -> None:
    pool = PagePool(6)
    a = pool.allocate(3)
    b = pool.allocate(3)
    pool.free([a[1], b[0]])
    pool.free([a[0]])
    assert pool.free_page_ids() == [1, 3, 0]
    assert pool.allocate(2) == [1, 3]
    assert pool.allocate(1) == [0]
    pool.check_integrity()


def test_exhaustion_raises_typed_error_and_allocates_nothing() -> None:
    pool = PagePool(4)
    pool.allocate(3)
    with pytest.raises(PagePoolExhaustedError) as info:
        pool.allocate(2)
    assert (info.value.requested, info.value.free) == (2, 1)
    assert pool.num_free == 1
    assert pool.allocate(1) == [3]


def test_ref_counts_share_and_release() -> None:
    pool = PagePool(4)
    pages = pool.allocate(2)
    pool.incref(pages)
    assert [pool.ref_count(p) for p in pages] == [2, 2]
    pool.free(pages)
    assert pool.num_free == 2
    pool.free(pages)
    assert pool.num_free == 4 and pool.free_page_ids() == [2, 3, 0, 1]


def test_double_free_and_bad_ids_are_refused() -> None:
    pool = PagePool(2)
    (page,) = pool.allocate(1)
    pool.free([page])
    with pytest.raises(ValueError, match="double free"):
        pool.free([page])
    with pytest.raises(ValueError, match="out of range"):
        pool.free([7])
    with pytest.raises(ValueError, match="free"):
        pool.incref([1])


def test_check_integrity_catches_corruption() -> None:
    pool = PagePool(3)
    pool.allocate(1)
    pool._free[0] = None  # corrupt on purpose: page 0 in use and in the free list
    with pytest.raises(AssertionError, match="free page 0 has ref count 1"):
        pool.check_integrity()


def test_check_integrity_catches_a_broken_cache_map() -> None:
    pool = PagePool(3)
    page = pool.allocate(1)[0]
    assert pool.register(page, b"a" * 32)
    pool._hash_of[page] = b"b" * 32  # corrupt on purpose: the page carries another hash
    with pytest.raises(AssertionError, match="carries another"):
        pool.check_integrity()


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "incref"]), st.integers(0, 6)), max_size=60))
def test_integrity_holds_after_random_operations(ops: list[tuple[str, int]]) -> None:
    pool = PagePool(16)
    held: list[int] = []  # one entry per reference held
    for op, n in ops:
        if op == "alloc":
            if pool.can_allocate(n):
                held.extend(pool.allocate(n))
            else:
                with pytest.raises(PagePoolExhaustedError):
                    pool.allocate(n)
        elif op == "free" and held:
            drop, held = held[: n % (len(held) + 1)], held[n % (len(held) + 1):]
            pool.free(drop)
        elif op == "incref" and held:
            chosen = held[: n % (len(held) + 1)]
            pool.incref(chosen)
            held.extend(chosen)
        pool.check_integrity()
        assert pool.num_used == len(set(held))
        for page in set(held):
            assert pool.ref_count(page) == held.count(page)
    pool.free(held)
    pool.check_integrity()
    assert pool.num_free == 16
