"""The producer's staging area: exact page ids and extents, reclaim on demand, publish checks."""

from __future__ import annotations

import pytest

from mm_serve.transport.ring_spec import Handoff, RingSpec, unique_ring_name
from mm_serve.transport.staging import StagingArea


def make_spec() -> RingSpec:
    return RingSpec(name=unique_ring_name("staging"), num_pages=8, page_shape=(1, 2, 4, 1, 2), dtype="float32",
                    feature_rows=10, feature_dim=4, capacity=2, max_pages_per_handoff=4, meta_bytes=8)


def nothing_released() -> int:
    return 0


def handoff(pages: list[int], offset: int, rows: int) -> Handoff:
    return Handoff("r", pages, 4 * len(pages), 1, offset, rows, b"")


def test_allocations_are_exact_and_full_room_is_backpressure() -> None:
    staging = StagingArea(make_spec())
    assert staging.alloc_pages(3, nothing_released) == [0, 1, 2]
    assert staging.alloc_pages(4, nothing_released) == [3, 4, 5, 6]
    assert staging.alloc_pages(2, nothing_released) is None and staging.pages_free == 1
    assert staging.alloc_features(6, nothing_released) == 0
    assert staging.alloc_features(0, nothing_released) == 0
    assert staging.alloc_features(5, nothing_released) is None and staging.feature_rows_free == 4
    with pytest.raises(ValueError, match="cannot hand off 5 pages"):
        staging.alloc_pages(5, nothing_released)
    staging.check_integrity()


def test_reclaim_runs_only_when_short_and_frees_what_was_released() -> None:
    staging = StagingArea(make_spec())
    first = handoff(staging.alloc_pages(4, nothing_released) or [], 0, 10)
    assert staging.alloc_features(10, nothing_released) == 0
    staging.check_unpublished(first.page_ids, 0, 10)
    staging.mark_published(first)
    calls: list[int] = []

    def release_first() -> int:
        calls.append(1)
        staging.free_released(first)
        return 1

    assert staging.alloc_pages(4, release_first) == [4, 5, 6, 7] and calls == []  # enough free: no reclaim
    assert staging.alloc_features(3, release_first) == 0 and calls == [1]  # arena full: reclaimed first
    assert staging.pages_free == 4 and staging.feature_rows_free == 7
    staging.check_integrity()


def test_published_and_foreign_allocations_are_refused() -> None:
    staging = StagingArea(make_spec())
    pages = staging.alloc_pages(2, nothing_released)
    offset = staging.alloc_features(3, nothing_released)
    assert pages == [0, 1] and offset == 0
    with pytest.raises(ValueError, match="not all allocated and unpublished"):
        staging.check_unpublished([0, 0], 0, 3)
    with pytest.raises(ValueError, match=r"feature extent \(0, 2\)"):
        staging.free_unpublished(pages, 0, 2)
    staging.mark_published(handoff(pages, 0, 3))
    with pytest.raises(ValueError, match=r"pages \[0, 1\]"):
        staging.free_unpublished(pages, 0, 3)
    assert staging.pages_free == 6 and staging.feature_rows_free == 7  # nothing freed by the refusals


def test_unpublished_allocations_go_back_whole() -> None:
    staging = StagingArea(make_spec())
    pages = staging.alloc_pages(4, nothing_released)
    assert pages == [0, 1, 2, 3] and staging.alloc_features(4, nothing_released) == 0
    staging.free_unpublished(pages, 0, 4)
    assert staging.pages_free == 8 and staging.feature_rows_free == 10
    assert staging.alloc_features(10, nothing_released) == 0
    staging.check_integrity()
