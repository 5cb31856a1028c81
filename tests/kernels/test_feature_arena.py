"""Feature arena: exact first-fit offsets, coalescing on free, typed errors, integrity under random use."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mm_serve.transport.feature_arena import FeatureArena


def take(arena: FeatureArena, rows: int) -> int:
    """Allocate ``rows`` rows that must fit."""
    offset = arena.allocate(rows)
    assert offset is not None
    return offset


def test_fresh_arena_allocates_first_fit_from_the_start() -> None:
    arena = FeatureArena(100)
    assert arena.allocate(30) == 0
    assert arena.allocate(50) == 30
    assert arena.free_extents() == [(80, 20)]
    assert arena.allocate(21) is None  # 20 rows left: backpressure, nothing changes
    assert arena.free_extents() == [(80, 20)]
    assert arena.allocate(20) == 80
    assert arena.free_extents() == [] and arena.num_free == 0
    arena.check_integrity()


def test_first_fit_takes_the_lowest_hole_that_fits() -> None:
    arena = FeatureArena(100)
    a, b, c, _ = (take(arena, 10), take(arena, 30), take(arena, 10), take(arena, 50))
    arena.free(a, 10)  # hole (0, 10)
    arena.free(c, 10)  # hole (40, 10)
    assert arena.free_extents() == [(0, 10), (40, 10)]
    assert arena.allocate(15) is None  # 20 rows free but no 15-row hole
    assert arena.largest_free == 10 and arena.num_free == 20
    assert arena.allocate(4) == 0
    assert arena.allocate(8) == 40
    assert arena.free_extents() == [(4, 6), (48, 2)]
    arena.free(b, 30)
    assert arena.free_extents() == [(4, 36), (48, 2)]
    arena.check_integrity()


def test_free_coalesces_with_both_neighbours() -> None:
    arena = FeatureArena(30)
    offsets = [take(arena, 10) for _ in range(3)]
    assert offsets == [0, 10, 20]
    arena.free(0, 10)
    arena.free(20, 10)
    assert arena.free_extents() == [(0, 10), (20, 10)]
    arena.free(10, 10)
    assert arena.free_extents() == [(0, 30)]
    assert arena.allocate(30) == 0
    arena.check_integrity()


def test_bad_requests_raise_and_change_nothing() -> None:
    arena = FeatureArena(16)
    offset = take(arena, 4)
    with pytest.raises(ValueError, match="cannot allocate 0 rows"):
        arena.allocate(0)
    with pytest.raises(ValueError, match="cannot allocate 17 rows"):
        arena.allocate(17)
    with pytest.raises(ValueError, match=r"\(0, 3\) is not allocated"):
        arena.free(offset, 3)  # wrong size
    arena.free(offset, 4)
    with pytest.raises(ValueError, match=r"\(0, 4\) is not allocated"):
        arena.free(offset, 4)  # double free
    assert arena.free_extents() == [(0, 16)]
    arena.check_integrity()


def test_empty_arena_refuses_everything() -> None:
    arena = FeatureArena(0)
    assert arena.free_extents() == [] and arena.largest_free == 0
    with pytest.raises(ValueError):
        arena.allocate(1)
    arena.check_integrity()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40)), max_size=60))
def test_random_use_keeps_invariants_and_frees_everything(ops: list[tuple[bool, int]]) -> None:
    arena = FeatureArena(128)
    live: list[tuple[int, int]] = []
    for do_alloc, value in ops:
        if do_alloc or not live:
            offset = arena.allocate(value)
            if offset is None:
                assert arena.largest_free < value
            else:
                live.append((offset, value))
        else:
            arena.free(*live.pop(value % len(live)))
        arena.check_integrity()
        assert arena.num_free == 128 - sum(rows for _, rows in live)
    for extent in live:
        arena.free(*extent)
    assert arena.free_extents() == [(0, 128)]
    arena.check_integrity()
