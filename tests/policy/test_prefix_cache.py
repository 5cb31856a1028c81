"""Prefix caching on the CPU with the policy factories: exact page ids, ref counts, hit lengths."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mm_serve.kernels.page_pool import PagePool, PagePoolExhaustedError
from mm_serve.runtime.page_hashes import HASH_BYTES, cache_salt, image_spans, page_hash_chain
from mm_serve.runtime.request import RequestStatus
from tests.policy.factories import (
    IMAGE_TOKEN,
    PAGE_SIZE,
    make_prefix_cache,
    make_prompt_request,
    make_scheduler,
)

IMG_A, IMG_B = b"A" * HASH_BYTES, b"B" * HASH_BYTES


def _run(prefix, request) -> None:  # type: ignore[no-untyped-def]
    """Admit ``request`` and mark its prompt's KV computed (what a prefill step does)."""
    prefix.allocate(request)
    prefix.commit(request, request.num_tokens)


def test_page_hash_chain_is_full_width_and_covers_full_pages_only() -> None:
    salt = cache_salt("m", "float32")
    chain = page_hash_chain(list(range(10)), 4, salt)
    assert len(chain) == 2 and all(len(h) == 32 for h in chain)  # 256-bit digests, 2 full pages of 4
    assert page_hash_chain(list(range(10)), 4, cache_salt("m", "bfloat16")) != chain  # the salt changes every page
    assert page_hash_chain(list(range(8)) + [77, 78], 4, salt) == chain  # only full pages count
    assert page_hash_chain(list(range(10)), 4, salt, start=chain[:1]) == chain  # continues a chain


def test_an_image_changes_the_hash_of_every_page_from_its_first_token_on() -> None:
    salt = cache_salt("m", "float32")
    prompt = [1, 2, 3, 4, 5, IMAGE_TOKEN, IMAGE_TOKEN, IMAGE_TOKEN, 6, 7, 8, 9]
    spans = image_spans(prompt, IMAGE_TOKEN, [3])
    assert spans == [(5, 8)]
    a = page_hash_chain(prompt, 4, salt, [IMG_A], spans)
    b = page_hash_chain(prompt, 4, salt, [IMG_B], spans)
    assert a[0] == b[0]  # page 0 holds no image token
    assert a[1] != b[1] and a[2] != b[2]  # page 1 holds the image; page 2 chains from it


def test_a_second_request_reuses_the_full_pages_of_a_finished_one() -> None:
    prefix = make_prefix_cache(num_pages=8)
    first = make_prompt_request("a", range(10, 20))  # 10 tokens: pages 0, 1 full, page 2 partial
    _run(prefix, first)
    assert first.block_table == [0, 1, 2] and first.num_cached_tokens == 0
    prefix.release(first)
    assert prefix.pool.free_page_ids() == [3, 4, 5, 6, 7, 2, 1, 0]  # freed last page first
    second = make_prompt_request("b", list(range(10, 20)) + [55, 56])
    _run(prefix, second)
    assert second.block_table[:2] == [0, 1] and second.num_cached_tokens == 2 * PAGE_SIZE
    assert second.num_prompt_cached_tokens == 8
    assert prefix.pool.ref_count(0) == 1 and 0 not in prefix.pool.free_page_ids()
    assert (prefix.queried_tokens, prefix.hit_tokens) == (10 + 12, 8)
    prefix.pool.check_integrity()


def test_a_hit_leaves_the_last_token_to_compute() -> None:
    prefix = make_prefix_cache(num_pages=8)
    first = make_prompt_request("a", range(10, 18))  # exactly two full pages
    _run(prefix, first)
    again = make_prompt_request("b", range(10, 18))
    prefix.allocate(again)
    assert again.block_table[0] == first.block_table[0] and again.block_table[1] != first.block_table[1]
    assert again.num_cached_tokens == PAGE_SIZE  # page 1 is recomputed: its last token gives the logits
    assert prefix.pool.ref_count(first.block_table[0]) == 2  # shared while both run


def test_same_text_different_images_share_only_the_pages_before_the_image() -> None:
    prefix = make_prefix_cache(num_pages=16)
    prompt = [1, 2, 3, 4, 5, 6, IMAGE_TOKEN, IMAGE_TOKEN, IMAGE_TOKEN, 7, 8, 9, 10, 11]
    first = make_prompt_request("a", prompt, [IMG_A])
    _run(prefix, first)
    other = make_prompt_request("b", prompt, [IMG_B])
    prefix.allocate(other)
    assert other.num_cached_tokens == 4  # page 0 only: page 1 holds the image's first token
    assert other.block_table[1:] != first.block_table[1:2] + first.block_table[2:]
    same = make_prompt_request("c", prompt, [IMG_A])
    prefix.allocate(same)
    assert same.num_cached_tokens == 12 and same.block_table[:3] == first.block_table[:3]


def test_eviction_takes_the_least_recently_freed_cached_page() -> None:
    prefix = make_prefix_cache(num_pages=4)
    a = make_prompt_request("a", range(10, 19))  # pages 0, 1 full, 2 partial
    _run(prefix, a)
    prefix.release(a)
    assert prefix.pool.num_cached == 2 and prefix.pool.free_page_ids() == [3, 2, 1, 0]
    b = make_prompt_request("b", range(50, 59))  # no match: takes 3, 2, 1 -> evicts page 1
    _run(prefix, b)
    assert b.block_table == [3, 2, 1] and prefix.pool.num_evictions == 1
    again = make_prompt_request("c", range(10, 19))
    assert prefix.match(again) == [0]  # page 1's hash is gone, page 0 still cached
    prefix.pool.check_integrity()


def test_pages_in_use_are_never_evicted() -> None:
    prefix = make_prefix_cache(num_pages=3)
    a = make_prompt_request("a", range(10, 19))
    _run(prefix, a)  # all 3 pages in use, 2 of them cached
    with pytest.raises(PagePoolExhaustedError):
        prefix.allocate(make_prompt_request("b", range(50, 54)))
    assert prefix.pool.num_cached == 2 and prefix.pool.num_evictions == 0


def test_pages_needed_counts_free_cached_hits_and_not_in_use_ones() -> None:
    prefix = make_prefix_cache(num_pages=8)
    a = make_prompt_request("a", range(10, 19))
    _run(prefix, a)
    b = make_prompt_request("b", range(10, 19))
    assert prefix.pages_needed(b) == 1  # pages 0, 1 shared in use; one fresh page
    prefix.release(a)
    assert prefix.pages_needed(b) == 3  # the two hits sit in the free list now


def test_disabled_cache_allocates_plainly() -> None:
    prefix = make_prefix_cache(num_pages=8, enabled=False)
    a = make_prompt_request("a", range(10, 19))
    _run(prefix, a)
    prefix.release(a, a.num_tokens)
    b = make_prompt_request("b", range(10, 19))
    prefix.allocate(b)
    assert b.num_cached_tokens == 0 and prefix.pool.num_cached == 0
    assert b.block_table == [3, 4, 5] and prefix.pool.free_page_ids() == [6, 7, 0, 1, 2]  # freed in order


def test_register_refuses_a_second_page_for_one_hash() -> None:
    pool = PagePool(4)
    p, q = pool.allocate(2)
    assert pool.register(p, IMG_A)
    assert not pool.register(q, IMG_A) and pool.hash_of(q) is None
    assert not pool.register(p, IMG_B)  # a page carries one hash
    with pytest.raises(ValueError, match="free"):
        pool.register(3, IMG_B)


def test_scheduler_preemption_registers_the_victim_and_its_recompute_hits() -> None:
    sched = make_scheduler(num_pages=6, page_size=PAGE_SIZE, prefix_caching=True)
    a = make_prompt_request("a", range(10, 19))  # 9 tokens: 3 pages
    b = make_prompt_request("b", range(50, 59))
    sched.add(a)
    sched.add(b)
    assert sched.schedule().prefill == [a, b]
    for request in (a, b):  # KV of the prompts computed, one token sampled
        sched.prefix.commit(request, request.num_tokens)  # type: ignore[union-attr]
        request.append_output(7, None)
    for token in range(4):  # decode until pages run out: b is preempted
        plan = sched.schedule()
        for request in plan.decode:
            request.append_output(token, None)
        if plan.preempted:
            break
    assert plan.preempted == [b] and b.status is RequestStatus.PREEMPTED
    assert sched.pool.num_cached >= 2  # b's two full prompt pages stayed cached
    sched.finish(a, RequestStatus.FINISHED_STOPPED)
    plan = sched.schedule()
    assert plan.prefill == [b] and b.num_cached_tokens >= 2 * PAGE_SIZE  # the recompute reused them
    sched.pool.check_integrity()


@settings(max_examples=120, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["admit", "finish", "preempt"]), st.integers(0, 5), st.integers(1, 14)),
                max_size=50))
def test_integrity_and_ref_counts_hold_over_random_request_sequences(ops: list[tuple[str, int, int]]) -> None:
    """Requests drawn from 6 prompt families (shared heads, two images) come and go; after every
    operation the pool's invariants hold and each page's ref count is the number of running
    requests whose block table holds it."""
    prefix = make_prefix_cache(num_pages=12)
    heads = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [1, 2, IMAGE_TOKEN, IMAGE_TOKEN, IMAGE_TOKEN, 6]]
    running = []
    for step, (op, family, extra) in enumerate(ops):
        if op == "admit":
            head = heads[family % 3]
            image = [IMG_A if family < 3 else IMG_B] if IMAGE_TOKEN in head else []
            request = make_prompt_request(f"r{step}", head + list(range(100, 100 + extra)), image)
            if prefix.can_allocate(request):
                _run(prefix, request)
                cached = request.num_cached_tokens
                assert cached % PAGE_SIZE == 0 and cached < request.num_tokens
                running.append(request)
            else:
                with pytest.raises(PagePoolExhaustedError):
                    prefix.allocate(request)
        elif running:
            request = running.pop(family % len(running))
            request.append_output(5, None)
            prefix.release(request, request.num_tokens - 1 if op == "finish" else 0)
        prefix.pool.check_integrity()
        for page in range(prefix.pool.num_pages):
            assert prefix.pool.ref_count(page) == sum(r.block_table.count(page) for r in running)
    for request in running:
        prefix.release(request)
    prefix.pool.check_integrity()
    assert prefix.pool.num_free == 12


def test_images_of_different_sizes_own_their_own_spans_and_hashes() -> None:
    """Each image carries its own token count: a 2-token and a 4-token image own consecutive runs of
    placeholders, a generated placeholder id after them is text, and two prompts alike but for the
    second image's content never share the pages that image touches."""
    prompt = [1, IMAGE_TOKEN, IMAGE_TOKEN, 2, IMAGE_TOKEN, IMAGE_TOKEN, IMAGE_TOKEN, IMAGE_TOKEN, 3, IMAGE_TOKEN]
    spans = image_spans(prompt, IMAGE_TOKEN, [2, 4])
    assert spans == [(1, 3), (4, 8)]  # the last placeholder is past both images' tokens: text
    salt = cache_salt("m", "float32")
    a = page_hash_chain(prompt, 4, salt, [IMG_A, IMG_B], spans)
    b = page_hash_chain(prompt, 4, salt, [IMG_A, IMG_A], spans)
    assert a[0] == b[0] and a[1] != b[1]  # page 0 holds only the first image; page 1 the second
