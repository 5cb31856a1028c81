"""Model runner: turns a scheduled batch into tensors, runs the model, returns last-position logits."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kernels.attention_metadata import AttentionMetadata
from mm_serve.models.llava import MultimodalLM
from mm_serve.runtime.kv_cache import PagedKVCache
from mm_serve.runtime.request import Request
from mm_serve.runtime.step_inputs import decode_inputs, slots_for

if TYPE_CHECKING:
    from mm_serve.runtime.decode_graphs import DecodeGraphs


class ModelRunner:
    """Runs :class:`MultimodalLM` over a :class:`PagedKVCache` (no scheduling decisions here).

    With ``cuda_graphs`` (a CUDA cache), decode steps of up to ``max_running`` requests
    replay captured CUDA graphs (:class:`~mm_serve.runtime.decode_graphs.DecodeGraphs`).
    """

    def __init__(
        self, model: MultimodalLM, kv_cache: PagedKVCache, cuda_graphs: bool = False, max_running: int = 64,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.page_size = kv_cache.page_size
        self.device = kv_cache.data.device
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs and self.device.type == "cuda":
            from mm_serve.runtime.decode_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self.forward_decode, kv_cache, max_running, capture=True)

    @torch.inference_mode()
    def encode_images(self, requests: list[Request]) -> None:
        """Run the vision tower + projector once for all pending images of ``requests``.

        Sets each request's ``image_embeds`` ``[num_images * num_image_tokens, hidden]``
        and drops its ``pixel_values``.
        """
        pending = [r for r in requests if r.needs_encoding]
        if not pending:
            return
        pixels = torch.cat([r.pixel_values for r in pending if r.pixel_values is not None], dim=0)
        embeds = self.model.encode_images(pixels.to(self.device))  # [N, tokens, hidden]
        start = 0
        for request in pending:
            n = request.num_images
            request.image_embeds = embeds[start : start + n].reshape(-1, embeds.shape[-1])
            request.pixel_values = None
            start += n

    @torch.inference_mode()
    def prefill(self, requests: list[Request]) -> torch.Tensor:
        """Prefill every token of each request (prompt plus any recomputed outputs).

        Returns:
            Logits ``[B, vocab]`` (float32) at each request's last position.
        """
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        embeds = []
        for request in requests:
            tokens = request.all_token_ids
            n = len(tokens)
            ids.extend(tokens)
            positions.extend(range(n))
            slots.extend(slots_for(request.block_table, 0, n, self.page_size))
            seq_lens.append(n)
            if request.image_embeds is not None:
                embeds.append(request.image_embeds)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        image_embeds = torch.cat(embeds, dim=0) if embeds else None
        meta = AttentionMetadata(
            is_prefill=True, seq_lens=seq_lens,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
        )
        hidden = self.model.language_model(
            self.model.embed(input_ids, image_embeds, self._image_mask(requests, input_ids, seq_lens)),
            torch.tensor(positions, dtype=torch.long, device=self.device), meta, self.kv_cache.layer_caches,
        )
        last = torch.tensor(seq_lens, device=self.device).cumsum(0) - 1
        return self.model.language_model.compute_logits(hidden[last])

    def _image_mask(self, requests: list[Request], input_ids: torch.Tensor, seq_lens: list[int]) -> torch.Tensor | None:
        """Image positions of a prefill batch: in each request, the first ``len(image_embeds)``
        image-token positions (its prompt's placeholders); later ones are outputs that happen to
        equal the image token id (a recompute after preemption or a migration) and stay text."""
        token = getattr(self.model, "image_token_index", None)
        if token is None:
            return None
        mask = input_ids == token
        start = 0
        for request, n in zip(requests, seq_lens, strict=True):
            rows = 0 if request.image_embeds is None else int(request.image_embeds.shape[0])
            hits = mask[start : start + n].nonzero().flatten()
            if hits.numel() > rows:
                mask[start + hits[rows:]] = False
            start += n
        return mask

    @torch.inference_mode()
    def decode(self, requests: list[Request]) -> torch.Tensor:
        """One decode step: feed each request's last token at position ``num_tokens - 1``.

        Returns:
            Logits ``[B, vocab]`` (float32).
        """
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
        meta = AttentionMetadata(
            is_prefill=False, seq_lens=[1] * int(input_ids.shape[0]), slot_mapping=slot_mapping,
            block_tables=block_tables, context_lens=context_lens, graph_safe=graph_safe,
        )
        hidden = language_model(language_model.embed(input_ids), positions, meta, self.kv_cache.layer_caches)
        return language_model.compute_logits(hidden)
