"""Model runner: turns a scheduled batch into tensors, runs the model, returns last-position logits."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mm_serve.kernels.attention_metadata import AttentionMetadata
from mm_serve.models.llava import MultimodalLM
from mm_serve.models.qwen2_vl.mrope import mrope_positions
from mm_serve.runtime.encoder_cache import EncoderCache
from mm_serve.runtime.kv_cache import PagedKVCache
from mm_serve.runtime.page_hashes import split_tiles
from mm_serve.runtime.request import Request
from mm_serve.runtime.sampler import Sampler
from mm_serve.runtime.step_inputs import decode_inputs, slots_for

if TYPE_CHECKING:
    from mm_serve.runtime.decode_graphs import DecodeGraphs

PROMPT_LOGPROB_ROWS = 256  # prompt positions per LM-head pass for prompt_logprobs (bounds the [rows, vocab] logits)


class ModelRunner:
    """Runs :class:`MultimodalLM` over a :class:`PagedKVCache` (no scheduling decisions here).

    With ``cuda_graphs`` (a CUDA cache), decode steps of up to ``max_running`` requests
    replay captured CUDA graphs (:class:`~mm_serve.runtime.decode_graphs.DecodeGraphs`).
    """

    def __init__(
        self, model: MultimodalLM, kv_cache: PagedKVCache, cuda_graphs: bool = False, max_running: int = 64,
        encoder_cache: EncoderCache | None = None,
    ) -> None:
        self.model = model
        self.encoder_cache = encoder_cache
        self.kv_cache = kv_cache
        self.page_size = kv_cache.page_size
        self.device = kv_cache.data.device
        self.graphs: DecodeGraphs | None = None
        self.mrope = bool(model.language_model.config.rope.mrope_section)  # Qwen2-VL's M-RoPE positions
        if cuda_graphs and self.device.type == "cuda":
            from mm_serve.runtime.decode_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self.forward_decode, kv_cache, max_running, capture=True)

    @torch.inference_mode()
    def encode_images(self, requests: list[Request]) -> None:
        """Run the vision tower + projector once for each distinct pending image of ``requests``.

        Sets each request's ``image_embeds`` ``[sum(image_token_counts), hidden]`` (its images' rows in order)
        and drops its ``pixel_values``. With an encoder cache, images whose content hash
        (``Request.image_hashes``) is cached skip the tower, an image repeated within the
        batch is encoded once, and what was encoded is cached.
        """
        pending = [r for r in requests if r.needs_encoding]
        if not pending:
            return
        cache = self.encoder_cache
        found: dict[bytes, torch.Tensor] = {}  # this batch's images by content hash
        to_encode: list[torch.Tensor] = []  # [3, H, W] each, or [tiles, 3, H, W]
        sizes: list[tuple[int, ...] | None] = []  # original (height, width) or patch grid of each, where features need it
        keys: list[bytes | None] = []
        for request in pending:
            assert request.pixel_values is not None
            hashes = request.image_hashes if len(request.image_hashes) == request.num_images else []
            images = split_tiles(request.pixel_values, request.image_tiles)
            for i in range(request.num_images):
                digest = hashes[i] if hashes else None
                if digest is not None and digest in found:
                    continue
                cached = None if cache is None or digest is None else cache.get(digest)
                if cached is not None:
                    found[digest] = cached  # type: ignore[index]
                    continue
                to_encode.append(images[i])
                sizes.append(tuple(request.image_sizes[i]) if request.image_sizes else None)  # type: ignore[arg-type]
                keys.append(digest)
                if digest is not None:
                    found[digest] = to_encode[-1]  # placeholder until encoded
        encoded: list[torch.Tensor] = []
        if to_encode:
            batch = self.model.encode_image_list([pixels.to(self.device) for pixels in to_encode], sizes)
            # cached entries get their own storage: they outlive the batch tensor
            encoded = [embeds.clone() if cache is not None else embeds for embeds in batch]
            for digest, embeds in zip(keys, encoded, strict=True):
                if digest is not None:
                    found[digest] = embeds
                    if cache is not None:
                        cache.put(digest, embeds)
        fresh = iter([encoded[j] for j, digest in enumerate(keys) if digest is None])
        for request in pending:
            hashes = request.image_hashes if len(request.image_hashes) == request.num_images else []
            rows = [found[hashes[i]] if hashes else next(fresh) for i in range(request.num_images)]
            request.image_embeds = torch.cat(rows, dim=0) if len(rows) > 1 else rows[0]
            request.pixel_values = None

    @torch.inference_mode()
    def prefill(self, requests: list[Request]) -> torch.Tensor:
        """Prefill each request's tokens (prompt plus any recomputed outputs) from its
        ``num_cached_tokens`` on, up to its ``prefill_end`` (a chunk; 0: the last token): the KV of
        the tokens before is already in the first pages of its block table (a prefix-cache hit, or
        earlier chunks) and is attended to, not recomputed.

        Returns:
            Logits ``[B, vocab]`` (float32) at each request's last computed position (only those of
            requests whose pass reaches their last token mean anything to a sampler).
        """
        return self.mixed(requests, [])

    @torch.inference_mode()
    def mixed(self, prefill: list[Request], decode: list[Request]) -> torch.Tensor:
        """One pass over ``prefill``'s tokens (as :meth:`prefill`: chunks or whole prompts) and one
        new token of each of ``decode`` (as :meth:`decode`): the linear layers see every row at once,
        attention runs per part (chunked prefill fused with decode; Agrawal et al., Sarathi-Serve,
        OSDI 2024). Either list may be empty; without prefill rows this is :meth:`decode`.

        Returns:
            Logits ``[len(prefill) + len(decode), vocab]`` (float32): each prefill request's at its
            last computed position, then each decode request's.
        """
        if not prefill:
            return self.decode(decode)
        ids: list[int] = []
        positions: list[torch.Tensor] = []  # [n] each, or [3, n] under M-RoPE
        slots: list[int] = []
        seq_lens: list[int] = []
        prefix_lens: list[int] = []
        embeds: list[torch.Tensor] = []
        masks: list[torch.Tensor] = []
        for request in prefill:
            tokens = request.all_token_ids
            cached = request.num_cached_tokens
            n = min(request.prefill_end, len(tokens)) if request.prefill_end else len(tokens)
            ids.extend(tokens[cached:n])
            positions.append(self._rope_positions(request, cached, n))
            slots.extend(slots_for(request.block_table, cached, n, self.page_size))
            seq_lens.append(n - cached)
            prefix_lens.append(cached)
            mask, rows = self._image_rows(request, tokens, cached, n)
            masks.append(mask)
            if rows is not None:
                embeds.append(rows)
        meta = AttentionMetadata(
            is_prefill=True, seq_lens=seq_lens,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
        )
        if any(prefix_lens):
            width = max(len(r.block_table) for r in prefill)
            meta.prefix_lens = prefix_lens
            meta.block_tables = torch.tensor(
                [r.block_table + [0] * (width - len(r.block_table)) for r in prefill], dtype=torch.long,
                device=self.device,
            )
        if decode:
            meta.decode = self._decode_metadata(decode, ids, positions)
            masks.append(torch.zeros(len(decode), dtype=torch.bool))
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        image_embeds = torch.cat(embeds, dim=0) if embeds else None
        image_mask = torch.cat(masks).to(self.device) if getattr(self.model, "image_token_index", None) is not None else None
        hidden = self.model.language_model(
            self.model.embed(input_ids, image_embeds, image_mask),
            torch.cat(positions, dim=-1).to(self.device), meta, self.kv_cache.layer_caches,
        )
        ends = torch.tensor(seq_lens, device=self.device).cumsum(0)
        for i, request in enumerate(prefill):
            if request.wants_prompt_logprobs:
                self._prompt_logprobs(request, hidden[int(ends[i]) - seq_lens[i]: int(ends[i])], prefix_lens[i])
        last = torch.cat([ends - 1, torch.arange(len(decode), device=self.device) + int(ends[-1])])
        return self.model.language_model.compute_logits(hidden[last])

    def _decode_metadata(
        self, requests: list[Request], ids: list[int], positions: list[torch.Tensor],
    ) -> AttentionMetadata:
        """The decode part of a mixed pass; appends its token ids to ``ids`` and its positions
        (``[B]``, or ``[3, B]`` under M-RoPE, three equal rows) to ``positions``."""
        if self.mrope:
            for request in requests:
                self.prepare_mrope(request)
        step_ids, step_positions, slots, tables, context = decode_inputs(requests, self.page_size)
        ids.extend(step_ids)
        rope = torch.tensor(step_positions, dtype=torch.long)
        positions.append(rope.expand(3, -1) if self.mrope else rope)
        slot_mapping, block_tables, context_lens = (
            torch.tensor(x, dtype=torch.long, device=self.device) for x in (slots, tables, context))
        return decode_metadata(slot_mapping, block_tables, context_lens)

    def _prompt_logprobs(self, request: Request, hidden: torch.Tensor, start: int) -> None:
        """Add to ``request.prompt_logprobs`` the entries of the prompt tokens this pass predicts: the
        hidden state at position ``p`` (``hidden`` ``[n, hidden]`` holds positions ``start .. start+n-1``)
        gives the log-probability of prompt token ``p + 1``, with the ``prompt_logprobs`` best
        (:meth:`Sampler.logprobs`, vLLM's ``prompt_logprobs``). Rows go through the LM head 256 at a time."""
        prompt, top_n = request.prompt_token_ids, request.sampling_params.prompt_logprobs
        if start == 0 or request.prompt_logprobs is None:
            request.prompt_logprobs = [None]  # the first token has no context to be predicted from
        stop = min(hidden.shape[0], len(prompt) - 1 - start)  # rows whose next token is in the prompt
        for lo in range(0, max(0, stop), PROMPT_LOGPROB_ROWS):
            hi = min(stop, lo + PROMPT_LOGPROB_ROWS)
            logits = self.model.language_model.compute_logits(hidden[lo:hi])
            targets = prompt[start + lo + 1: start + hi + 1]
            request.prompt_logprobs.extend(Sampler.logprobs(logits, targets, [top_n] * len(targets)))

    def _rope_positions(self, request: Request, start: int, end: int) -> torch.Tensor:
        """Rotary positions of a request's tokens ``[start, end)``: ``[n]`` (int64), or under M-RoPE
        ``[3, n]``: the prompt's from its images' grids (:func:`~mm_serve.models.qwen2_vl.mrope.mrope_positions`,
        computed once and kept on the request, with its ``rope_delta``), each later token's its index
        plus ``rope_delta`` in all three rows."""
        if not self.mrope:
            return torch.arange(start, end, dtype=torch.long)
        self.prepare_mrope(request)
        prompt = min(end, request.num_prompt_tokens)
        if request.mrope_positions is not None and start < prompt:
            head = request.mrope_positions[:, start:prompt]
        else:  # text only: three equal rows
            head = torch.arange(start, max(start, prompt), dtype=torch.long).expand(3, -1)
        tail = torch.arange(max(start, prompt), end, dtype=torch.long).expand(3, -1) + request.rope_delta
        return torch.cat([head, tail], dim=1)

    def prepare_mrope(self, request: Request) -> None:
        """Set a request's M-RoPE prompt positions and ``rope_delta`` if it has images and they are not set."""
        vision = self.model.config.vision
        if request.mrope_positions is not None or not request.num_images or vision is None:
            return
        request.mrope_positions, request.rope_delta = mrope_positions(
            request.prompt_token_ids, vision.placeholder_ids, request.image_token_counts, request.image_sizes,
            vision.merge_size, request.image_second_per_grid, vision.tokens_per_second)

    def _image_rows(
        self, request: Request, tokens: list[int], cached: int, end: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Image positions among a request's computed tokens ``tokens[cached:end]`` (bool
        ``[end - cached]``) and the rows of its ``image_embeds`` they take.

        A request's image positions are the first ``len(image_embeds)`` image-token positions
        (its prompt's placeholders); later ones are outputs that happen to equal the image
        token id (a recompute after preemption or a migration) and stay text. Rows of
        placeholders inside the cached prefix are skipped (their KV is reused), and so are those
        at or after ``end`` (a later chunk computes them).
        """
        mask = torch.zeros(end - cached, dtype=torch.bool)
        vision = self.model.config.vision
        if vision is None or request.image_embeds is None:
            return mask, None
        total = int(request.image_embeds.shape[0])
        placeholders = torch.tensor(vision.placeholder_ids)  # the image token, and a video-taking family's video token
        image_positions = torch.isin(torch.tensor(tokens), placeholders).nonzero().flatten()[:total]
        skip = int((image_positions < cached).sum())
        stop = int((image_positions < end).sum())
        mask[image_positions[skip:stop] - cached] = True
        return mask, request.image_embeds[skip:stop] if skip < stop else None

    @torch.inference_mode()
    def decode(self, requests: list[Request]) -> torch.Tensor:
        """One decode step: feed each request's last token at position ``num_tokens - 1``.

        Returns:
            Logits ``[B, vocab]`` (float32).
        """
        if self.mrope:
            for request in requests:
                self.prepare_mrope(request)
        if self.graphs is not None and self.graphs.supports(requests):
            return self.graphs.run(requests)
        ids, positions, slots, tables, context = (
            torch.tensor(x, dtype=torch.long, device=self.device) for x in decode_inputs(requests, self.page_size)
        )
        return self.forward_decode(ids, positions, slots, tables, context)

    def forward_decode(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
        block_tables: torch.Tensor, context_lens: torch.Tensor, graph_safe: bool = False,
    ) -> torch.Tensor:
        """The decode forward pass on tensors (:func:`decode_inputs`, on the device): logits
        ``[B, vocab]`` (float32). ``graph_safe`` selects static-shape attention (CUDA graphs)."""
        language_model = self.model.language_model
        meta = decode_metadata(slot_mapping, block_tables, context_lens, graph_safe)
        hidden = language_model(language_model.embed(input_ids), positions, meta, self.kv_cache.layer_caches)
        return language_model.compute_logits(hidden)


def decode_metadata(
    slot_mapping: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, graph_safe: bool = False,
) -> AttentionMetadata:
    """The metadata of one new token per sequence: ``slot_mapping`` and ``context_lens`` ``[B]``,
    ``block_tables`` ``[B, pages]`` (int64, on the device; :func:`decode_inputs`)."""
    return AttentionMetadata(
        is_prefill=False, seq_lens=[1] * int(slot_mapping.shape[0]), slot_mapping=slot_mapping,
        block_tables=block_tables, context_lens=context_lens, graph_safe=graph_safe,
    )
