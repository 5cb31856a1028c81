"""FLOPs and memory traffic of one forward pass, per phase, from a model shape.

Counts follow the usual dense-transformer accounting (Kaplan et al. 2020, "Scaling
Laws", Table 1; Pope et al. 2022, "Efficiently Scaling Transformer Inference", §2),
a multiply-add being 2 FLOPs:

* linear layers: ``2 * layer_params`` FLOPs per token per layer;
* causal prefill attention over a sequence of ``l`` tokens: ``QK^T`` and ``AV`` each
  ``l^2 * q_dim`` FLOPs per layer (half of the full square), ``2 l^2 q_dim`` together;
* decode attention of one new token over a context of ``c`` tokens: ``4 c q_dim`` per
  layer; it reads the ``c`` tokens' K and V (``kv_bytes_per_token`` each);
* the LM head: ``2 * hidden * vocab`` FLOPs per sampled token;
* every forward streams the stage's weights once; prefill writes each token's KV.

These are DistServe's terms (arXiv:2401.09670, Appendix A: prefill cost in the sum
and the sum of squares of the batch's lengths, decode cost in batch and total
context), with the coefficients derived rather than fitted.
All functions are linear in their count arguments (tokens, sequences, tower passes).
"""

from __future__ import annotations

from dataclasses import dataclass

from mm_serve.planner.model_shape import ModelShape


@dataclass(frozen=True)
class Work:
    """FLOPs and device-memory bytes of one kernel sequence."""

    flops: float
    bytes: float

    def __add__(self, other: Work) -> Work:
        return Work(self.flops + other.flops, self.bytes + other.bytes)

    def scaled(self, factor: float) -> Work:
        return Work(self.flops * factor, self.bytes * factor)


def prefill_work(
    shape: ModelShape, tokens: float, tokens_sq: float, seqs: float, layers: int, head: bool = True
) -> Work:
    """Prefill of a batch over ``layers`` decoder layers (all of them on one GPU).

    Args:
        tokens: total prompt tokens in the batch (image tokens included).
        tokens_sq: sum over sequences of length squared (tokens^2).
        seqs: sequences in the batch (one sampled token each).
        layers: decoder layers run (a pipeline stage runs a slice).
        head: whether the LM head (and its weights) are in this stage.
    """
    db = shape.dtype_bytes
    flops = layers * (2 * shape.layer_params * tokens + 2 * shape.q_dim * tokens_sq)
    weights = layers * shape.layer_params * db
    kv_written = tokens * 2 * layers * shape.kv_dim * db
    work = Work(flops, weights + kv_written)
    return work + _head(shape, seqs) if head else work


def decode_work(shape: ModelShape, batch: float, context: float, layers: int, head: bool = True) -> Work:
    """One decode step of ``batch`` sequences holding ``context`` KV tokens in total."""
    db = shape.dtype_bytes
    flops = layers * (2 * shape.layer_params * batch + 4 * shape.q_dim * context)
    weights = layers * shape.layer_params * db
    kv_read = (context + batch) * 2 * layers * shape.kv_dim * db
    work = Work(flops, weights + kv_read)
    return work + _head(shape, batch) if head else work


def _head(shape: ModelShape, tokens: float) -> Work:
    h, v, db = shape.hidden_size, shape.vocab_size, shape.dtype_bytes
    return Work(2 * h * v * tokens, h * v * db)


def encode_work(shape: ModelShape, passes: float) -> Work:
    """Vision tower + projector over ``passes`` tower passes (bidirectional attention): an untiled
    image is one pass, a tiled one ``shape.vision.tiles_per_image`` at most.

    Per pass: ``2 * params`` FLOPs per position through the tower layers, ``4 * n^2 * hidden``
    attention FLOPs per layer (``n`` = ViT positions), and the projector's ``2 * params`` per output
    row. Weights are read once per batch. Zero work for a text-only model.
    """
    vis = shape.vision
    if vis is None:
        return Work(0.0, 0.0)
    n = vis.seq_len
    per_pass = vis.num_layers * (2 * vis.layer_params * n + 4 * n * n * vis.hidden_size)
    per_pass += 2 * vis.projector_params * vis.pass_tokens
    per_pass += 2 * 3 * vis.patch_size**2 * vis.hidden_size * vis.num_patches
    act_bytes = passes * vis.pass_tokens * shape.hidden_size * shape.dtype_bytes
    return Work(per_pass * passes, vis.params * shape.dtype_bytes + act_bytes)
