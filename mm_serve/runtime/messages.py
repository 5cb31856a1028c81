"""Typed control messages between the front end (router) and the workers.

One codec for every socket: msgspec's MessagePack with a tagged union, so a
receiver gets a typed object or a decode error, never an arbitrary pickled
object. Tensors travel as raw bytes plus shape and dtype (:class:`TensorBlob`).
"""

from __future__ import annotations

import msgspec
import numpy as np
import torch

from mm_serve.ground.roles import Role
from mm_serve.transport.ring_spec import RingSpec


class TensorBlob(msgspec.Struct, frozen=True):
    """A dense tensor as bytes: ``data`` holds ``prod(shape)`` items of ``dtype`` (C order)."""

    shape: list[int]
    dtype: str
    data: bytes

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> TensorBlob:
        t = tensor.detach().contiguous().cpu()
        if t.dtype == torch.bfloat16:
            return cls(list(t.shape), "bfloat16", t.view(torch.int16).numpy().tobytes())
        return cls(list(t.shape), str(t.dtype).removeprefix("torch."), t.numpy().tobytes())

    def to_tensor(self) -> torch.Tensor:
        if self.dtype == "bfloat16":
            arr = np.frombuffer(self.data, dtype=np.int16).reshape(self.shape)
            return torch.from_numpy(arr.copy()).view(torch.bfloat16)
        arr = np.frombuffer(self.data, dtype=np.dtype(self.dtype)).reshape(self.shape)
        return torch.from_numpy(arr.copy())


class SamplingMsg(msgspec.Struct, frozen=True):
    """:class:`mm_serve.runtime.sampling_params.SamplingParams` on the wire."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop_token_ids: list[int]
    ignore_eos: bool
    logprobs: int | None
    min_tokens: int = 0
    logit_bias: list[tuple[int, float]] = []
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    structured: tuple[str, str] | None = None  # (kind, text) of a grammar (runtime.structured_output)
    prompt_logprobs: int | None = None  # SamplingParams.prompt_logprobs


# ---- front end -> prefill worker -------------------------------------------------------------


class PrefillRequest(msgspec.Struct, tag=True):
    """A request to prefill; the KV goes to decode worker ``decode_index``.

    A request migrated after a fault comes back with the outputs already streamed
    appended to ``prompt_token_ids``, ``output_offset`` = their number (so its random
    stream continues at that position) and ``sampling.max_tokens`` reduced by it.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingMsg
    generator_seed: int
    decode_index: int
    num_images: int = 0
    pixel_values: TensorBlob | None = None
    arrival_time: float = 0.0
    output_offset: int = 0
    priority: int = 1  # SLO tier rank: 0 interactive, 1 standard, 2 batch (lower runs first)
    max_wait_s: float = 0.0  # queued longer than this (admission.tiers.ageing_seconds), it moves up to rank 0; 0 = never
    image_hashes: list[bytes] = []  # content hash of each image's pixels (runtime.page_hashes); [] = not hashed
    image_token_counts: list[int] = []  # image tokens each image expanded to, in order
    image_tiles: list[int] = []  # rows of pixel_values per image ([] = one each)
    image_sizes: list[tuple[int, ...]] = []  # per image what its features need (Request.image_sizes)
    image_second_per_grid: list[float] = []  # per image, seconds a video's temporal patch spans (Request)
    cache_salt: bytes = b""  # page_hashes.request_salt of its cache_salt (Request.cache_salt); b"": none


# ---- front end -> any worker -----------------------------------------------------------------


class AbortRequest(msgspec.Struct, tag=True):
    """Cancel a request in whatever stage it is (queued, prefill, ring, decode)."""

    request_id: str


class Shutdown(msgspec.Struct, tag=True):
    """Stop serving and exit."""


class StatsQuery(msgspec.Struct, tag=True):
    """Ask a worker to report :class:`WorkerStats` now."""


class ReplaceRing(msgspec.Struct, tag=True):
    """The peer at ``peer_index`` was restarted with a fresh ring: drop the old one, attach ``ring``.

    To a prefill worker, ``peer_index`` is a decode worker (its pending hand-offs to it
    are dropped, their local pages freed); to a decode worker, a prefill worker (what
    the old ring still held is dropped). The front end migrates the requests involved.
    """

    peer_index: int
    ring: RingSpec


# ---- workers -> front end --------------------------------------------------------------------


class WorkerReady(msgspec.Struct, tag=True):
    """Sent once the worker has loaded its model, allocated its KV cache, run its warm-up pass
    (:mod:`mm_serve.runtime.warm_up`; skipped when its pool is too small) and frozen its start-up heap.
    ``warm_up_error``: why the warm-up pass failed (the worker serves without it), else empty."""

    role: Role
    index: int
    pid: int
    kv_pages_total: int
    warm_up_error: str = ""


class WorkerStats(msgspec.Struct, tag=True):
    """Load and health of one worker, sent periodically and on :class:`StatsQuery`."""

    role: Role
    index: int
    pid: int
    running: int
    waiting: int
    kv_pages_used: int
    kv_pages_total: int
    ring_slots_used: int
    queued_tokens: int
    num_preemptions: int
    num_encoded_images: int
    pages_integrity_ok: bool
    prefix_queried_tokens: int = 0  # prompt tokens of requests admitted with prefix caching on (since start)
    prefix_hit_tokens: int = 0  # of them, tokens whose cached KV was reused
    kv_cached_pages: int = 0  # pages carrying a prefix-cache hash now (in use or free)
    kv_evictions: int = 0  # cached pages reused for other content (since start)
    encoder_cache_hits: int = 0  # images served from the encoder cache (since start)
    encoder_cache_misses: int = 0  # images looked up and not found
    encoder_cache_bytes: int = 0  # bytes of embeddings cached now
    encoder_cache_evictions: int = 0  # entries dropped for room (since start)
    ray_handoffs: int = 0  # decode: hand-offs fetched through Ray's object store (other nodes)
    ring_pages_held: int = 0  # ring pages (over all its rings) held by hand-offs not yet given back


class TokenUpdate(msgspec.Struct):
    """New tokens of one request; ``finish_reason`` set on the last update of a request.

    ``start_index`` is the position of ``token_ids[0]`` among the request's output
    tokens, so the front end can order updates that reach it from two workers.
    """

    request_id: str
    start_index: int
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (the request's own input: see error)
    stop_reason: int | None = None
    events: dict[str, float] | None = None  # lifetime events, time.time() seconds
    cached_tokens: int | None = None  # on the first update: prompt tokens whose KV came from the prefix cache
    # on the first update, when asked (SamplingParams.prompt_logprobs): one entry per prompt token, None first
    prompt_logprobs: list[dict[int, float] | None] | None = None
    error: str | None = None  # with finish_reason "error": why the request cannot go on (its grammar allows no token)


class StepTiming(msgspec.Struct):
    """How long one worker step took, for the front end's latency predictor."""

    kind: str  # "prefill" (encode + LLM prefill of a batch) | "decode" (one decode step)
    seconds: float  # prefill: wall-clock time of the batch; decode: the step's period (what a running request waited, less a pacing sleep)
    requests: int  # requests in the batch
    tokens: int  # prefill: prompt tokens of the batch (image tokens included); decode: context tokens
    images: int = 0  # prefill: tower passes (images, or tiles of a tiling family's images) encoded
    # on a CPU (a prefill batch; a colocated worker's decode step): the worker's CPU seconds over it per torch
    # thread (time.process_time), which time slices taken by other processes on its cores do not inflate;
    # 0: not measured (a GPU's batch runs on the device; a decode worker's step is timed by its period)
    cpu_seconds: float = 0.0
    # prefill in a colocated step: the decode batch that ran in the same pass (its requests and their context
    # tokens); the predictor takes that batch's price out of the step's seconds before it fits the prefill
    decode_requests: int = 0
    decode_context: int = 0


class TokenBatch(msgspec.Struct, tag=True):
    """All token updates of one worker step (and, when it ran a timed step, its timing)."""

    role: Role
    index: int
    updates: list[TokenUpdate]
    step: StepTiming | None = None


class PrefillStarted(msgspec.Struct, tag=True):
    """A prefill worker started a batch: the front end's latency predictor then knows how much
    of it is left when a new request arrives (it is not preempted)."""

    role: Role
    index: int
    request_ids: list[str]  # the batch's requests (their prefill runs from now)


class RequestFailed(msgspec.Struct, tag=True):
    """A worker could not serve a request (it is finished with an error)."""

    request_id: str
    message: str


class HandoffFailed(msgspec.Struct, tag=True):
    """A decode worker refused a hand-off (bad version, payload checksum, meta for another
    request); nothing was computed from it and the front end re-prefills the request."""

    request_id: str
    reason: str


ToPrefill = PrefillRequest | AbortRequest | Shutdown | StatsQuery | ReplaceRing
ToDecode = AbortRequest | Shutdown | StatsQuery | ReplaceRing
FromWorker = WorkerReady | WorkerStats | TokenBatch | PrefillStarted | RequestFailed | HandoffFailed

_encoder = msgspec.msgpack.Encoder()


def encode(message: msgspec.Struct) -> bytes:
    """MessagePack bytes of a message."""
    return _encoder.encode(message)


def decoder(kind: object) -> msgspec.msgpack.Decoder:
    """A decoder for the union ``kind`` (e.g. :data:`ToPrefill`); raises ``msgspec.DecodeError`` on bad input."""
    return msgspec.msgpack.Decoder(kind)


# ---- prefill worker -> decode worker, inside a ring slot -------------------------------------


class HandoffMeta(msgspec.Struct):
    """The opaque ``meta`` payload of a ring hand-off (prefill → decode)."""

    request_id: str  # checked against the slot's id: a slot never feeds another request's meta
    prompt_token_ids: list[int]
    sampling: SamplingMsg
    seed: int | None  # the request's generator seed (None: greedy); see sampler.position_seed
    output_offset: int = 0  # outputs before this attempt (a migrated request)
    num_images: int = 0
    image_token_counts: list[int] = []  # image tokens of each image (the rows of its features), in order
    # per image, what its features need (Request.image_sizes); a decode worker reads Qwen2-VL's patch grids
    # to derive the M-RoPE positions of a preempted request it recomputes
    image_sizes: list[tuple[int, ...]] = []
    image_second_per_grid: list[float] = []  # and Qwen2.5-VL's video timing (Request.image_second_per_grid)
    first_logprobs: dict[int, float] | None = None
    events: dict[str, float] = {}
    priority: int = 1  # SLO tier rank (decode preempts the highest rank first)
    checksum: int | None = None  # CRC-32 of the hand-off's ring pages and features (None: not checked)


def encode_meta(meta: HandoffMeta) -> bytes:
    """MessagePack bytes of a :class:`HandoffMeta`."""
    return _encoder.encode(meta)


def decode_meta(data: bytes) -> HandoffMeta:
    """Parse :func:`encode_meta` output."""
    return msgspec.msgpack.decode(data, type=HandoffMeta)
