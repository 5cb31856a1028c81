"""Flat inputs of a model step from requests' block tables (no torch: plain lists of ints)."""

from __future__ import annotations

from mm_serve.runtime.request import Request


def slots_for(block_table: list[int], start: int, end: int, page_size: int) -> list[int]:
    """Flat cache slots of token positions ``[start, end)`` of a sequence with ``block_table``."""
    return [block_table[p // page_size] * page_size + p % page_size for p in range(start, end)]


def decode_inputs(
    requests: list[Request], page_size: int, batch: int | None = None, pages: int | None = None,
    filler_page: int = 0,
) -> tuple[list[int], list[int], list[int], list[list[int]], list[int]]:
    """Token ids, rotary positions, slots ``[batch]``, block tables ``[batch, pages]`` and context
    lengths ``[batch]`` of a decode step that feeds each request's last token at position
    ``num_tokens - 1`` (its rotary position: that plus the request's M-RoPE ``rope_delta``; 0 but for
    Qwen2-VL prompts with images).

    ``batch`` (default: the requests) and ``pages`` (default: the longest block table)
    may be larger: extra rows feed token 0 at position 0 with one token of context on
    ``filler_page``, and block tables are padded with ``filler_page``.
    """
    rows = [(r.output_token_ids[-1], r.num_tokens - 1, r.block_table) for r in requests]
    rows += [(0, 0, [filler_page])] * ((batch or len(requests)) - len(requests))
    deltas = [r.rope_delta for r in requests] + [0] * (len(rows) - len(requests))
    pages = pages or max(len(r.block_table) for r in requests)
    return (
        [token for token, _, _ in rows],
        [position + delta for (_, position, _), delta in zip(rows, deltas, strict=True)],
        [slots_for(table, position, position + 1, page_size)[0] for _, position, table in rows],
        [table + [filler_page] * (pages - len(table)) for _, _, table in rows],
        [position + 1 for _, position, _ in rows],
    )
