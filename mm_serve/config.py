"""Service configuration: YAML → validated, frozen pydantic models.

Keys follow the DistServe write-ups where one exists (``compute.prefill_gpus``,
``scheduler.decode_max_concurrent``, ``kv_cache.page_size``, ...). Every model
is frozen and rejects unknown keys; a bad value raises :class:`ConfigError`
whose message names the dotted key, the value and what is allowed.

Example::

    cfg = load_config("configs/default.yaml", overrides={"api.port": 9000})
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from mm_serve.ground.dtypes import DTypeChoice, DTypeName, resolve_dtype
from mm_serve.ground.slo import SLO
from mm_serve.ground.tiers import Tier, TierLabel
from mm_serve.runtime.engine_config import DEFAULT_ENGINE as _E
from mm_serve.workloads.builtin import BUILTIN_WORKLOADS


class ConfigError(ValueError):
    """A configuration file or override is invalid; the message names key, value and rule."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)  # "nan" fails every bound: name it


class ComputeConfig(_Frozen):
    """Worker counts and placement of the prefill and decode domains."""

    prefill_workers: int = Field(1, ge=1, le=64, description="Prefill instances (N in NpMd).")
    decode_workers: int = Field(1, ge=1, le=64, description="Decode instances (M in NpMd).")
    prefill_tensor_parallel: int = Field(1, ge=1, le=64, description="TP degree per prefill instance (the planner models it; the runtime runs 1).")
    prefill_pipeline_parallel: int = Field(1, ge=1, le=64, description="PP degree per prefill instance (the planner models it; the runtime runs 1).")
    decode_tensor_parallel: int = Field(1, ge=1, le=64, description="TP degree per decode instance (the planner models it; the runtime runs 1).")
    decode_pipeline_parallel: int = Field(1, ge=1, le=64, description="PP degree per decode instance (the planner models it; the runtime runs 1).")
    prefill_gpus: list[int] = Field(default_factory=list, description="CUDA device ids for prefill, in instance order, distinct; empty = CPU. When given, one per prefill worker x tensor_parallel x pipeline_parallel.")
    decode_gpus: list[int] = Field(default_factory=list, description="CUDA device ids for decode, in instance order, distinct; empty = CPU. When given, one per decode worker x tensor_parallel x pipeline_parallel.")
    prefill_cpus: list[int] = Field(default_factory=list, description="CPU cores the prefill workers are pinned to (distinct ids); empty (with decode_cpus empty) = first half of the cores. With cluster.backend local, a core `mm-serve serve` may not run on (os.sched_getaffinity) is an error at start naming the key.")
    decode_cpus: list[int] = Field(default_factory=list, description="CPU cores the decode workers are pinned to (distinct ids); empty (with prefill_cpus empty) = the other half. Checked at start as prefill_cpus.")
    threads_per_worker: int = Field(0, ge=0, le=256, description="torch threads per worker; 0 = number of pinned cores, else torch's default.")
    worker_nice: int = Field(5, ge=0, le=19, description="Niceness added to every worker process, so the front end (HTTP, tokenizing, streaming) gets a core when it needs one although the workers keep the cores busy; the API process's media threads (api.media_threads) get it too; 0 = same priority.")
    prefill_worker_nice: int | None = Field(None, ge=0, le=19, description="Niceness, instead of worker_nice, of the prefill workers that share a core with a decode worker (or are unpinned; null = worker_nice): above worker_nice, the decode worker gets most of that core when both want it, so long prefills stretch inter-token gaps less (the CPU analogue of DistServe's prefill/decode isolation). Prefill workers on cores of their own keep worker_nice.")

    @field_validator("prefill_gpus", "decode_gpus", "prefill_cpus", "decode_cpus")
    @classmethod
    def _non_negative_unique(cls, value: list[int]) -> list[int]:
        if any(v < 0 for v in value) or len(set(value)) != len(value):
            raise ValueError(f"must be distinct non-negative device/core ids, got {value}")
        return value

    @property
    def uses_gpus(self) -> bool:
        """Whether any worker runs on a CUDA device (``prefill_gpus`` or ``decode_gpus`` given)."""
        return bool(self.prefill_gpus or self.decode_gpus)

    @model_validator(mode="after")
    def _gpu_counts(self) -> ComputeConfig:
        for role in ("prefill", "decode"):
            gpus = getattr(self, f"{role}_gpus")
            need = (
                getattr(self, f"{role}_workers")
                * getattr(self, f"{role}_tensor_parallel")
                * getattr(self, f"{role}_pipeline_parallel")
            )
            if gpus and len(gpus) != need:
                raise ValueError(
                    f"compute.{role}_gpus lists {len(gpus)} GPUs but {role}_workers x tensor_parallel x "
                    f"pipeline_parallel needs {need}"
                )
        return self


class SchedulerConfig(_Frozen):
    """Batching limits of the prefill and decode schedulers."""

    prefill_batch_size: int = Field(_E.prefill_batch_size, ge=1, le=1024, description="Max requests in one prefill batch.")
    prefill_token_budget: int = Field(_E.prefill_token_budget, ge=16, le=1 << 20, description="Max prompt tokens (image tokens included) in one prefill batch.")
    decode_max_concurrent: int = Field(_E.max_running, ge=1, le=4096, description="Max running requests per decode worker.")
    ring_buffer_size: int = Field(16, ge=2, le=1 << 16, description="Hand-off ring slots per (prefill, decode) pair; a power of two.")
    prefill_chunk_tokens: int = Field(_E.prefill_chunk_tokens, strict=True, ge=0, le=1 << 20, description="A prompt with more tokens than this is prefilled in chunks of this size, one per prefill step, so shorter requests behind it wait for one chunk, not the whole prompt (chunked prefill; prefill workers). 0 never splits.")
    mixed_step_tokens: int = Field(_E.mixed_step_tokens, strict=True, ge=0, le=1 << 20, description="Colocated mode: each step decodes one token of every running request and fills the rest of this many tokens with prefill chunks (chunked prefill fused with decode, Sarathi-Serve), so a burst of long prompts delays running requests by one step of this size per token instead of stalling them; A step whose decodes leave less than one KV page of the budget still prefills one page's worth of tokens (so prompts never starve, and such a step exceeds the budget by up to a page; a budget below page_size acts as page_size for prefill). 0 runs whole-prompt prefill steps apart from decode steps.")
    decode_step_interval_ms: float = Field(0.0, strict=True, ge=0.0, le=1000.0, description="Decode workers start a decode step at least this long after the previous one began (0 = at once): the worker sleeps out the rest, so a prefill worker sharing its core gets that time. Set it below the TPOT SLO (e.g. 50 ms for 70 ms) where a decode worker shares a core with a prefill worker and prompts are long (summarization); every running request then gets a token at most every max(interval, step) instead of as fast as the core allows (the admission predictor prices a step as at least the interval, and judges the SLOs on the work). Must be below slo.tiers.interactive.tpot_ms.")
    decode_step_pacing: float = Field(0.0, strict=True, ge=0.0, lt=1.0, description="Decode workers pace their steps by rule: a step begins at least this fraction of the tightest TPOT SLO among the requests running there (slo.tiers, by each request's tier; at most 1 s) after the previous one began, and the worker sleeps out the rest, so a prefill worker sharing its core gets that time while every running request still gets a token within its SLO (e.g. 0.7: 70 ms between steps while a 100 ms request runs, 175 ms while only 250 ms ones do). 0 = off. Use it, or decode_step_interval_ms, not both. The admission predictor prices a paced step as at least its interval, and judges the SLOs on the work. Disaggregated mode only (a colocated worker does not pace).")
    decode_pacing_always: bool = Field(False, strict=True, description="With decode_step_interval_ms or decode_step_pacing, pace every step. By default a decode worker pinned to its cores paces only while other processes (the prefill worker sharing its core, or any other) want them: from 10 % of one core over a 0.2 s window (/proc/stat less its own CPU time), or at once when its thread waited 10 % of the time since its last look (at least 20 ms) on its run queue, until under 5 % over a window, so an unloaded service decodes at full speed. `mm-serve serve` keeps its own process (the front end) off the cores of decode workers that pace, where other cores are left. An unpinned worker (a Ray actor), or one where /proc/stat cannot be read, always paces.")
    prefill_routing: Literal["cache_aware", "least_queued"] = Field("cache_aware", description="How the router picks a prefill worker: 'cache_aware' prefers the worker holding the longest cached prefix of the request (SGLang's cache_aware policy) unless it is much busier; 'least_queued' takes the one with the fewest queued prompt tokens.")
    prefill_speed_routing: bool = Field(True, strict=True, description="Weigh each prefill worker's queued work by its measured speed (the admission predictor's per-worker factor), so the router picks the worker that would finish the request first; false: plain queued tokens.")
    cache_aware_balance_tokens: int = Field(2048, strict=True, ge=0, le=1 << 24, description="cache_aware routing: the worker with the longest cached prefix is passed over when its queued prompt tokens (plus the request's own, weighed by each worker's measured speed) exceed the least-queued worker's by more than this.")

    @field_validator("ring_buffer_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"must be a power of two (2, 4, 8, ...), got {value}")
        return value


class KVCacheConfig(_Frozen):
    """Paged KV cache sizing."""

    page_size: int = Field(_E.page_size, ge=1, le=1024, description="Tokens per KV page (block).")
    max_pages_per_gpu: int = Field(_E.num_pages, ge=4, le=1 << 24, description="KV pages per worker (per GPU on CUDA).")
    ring_pages: int = Field(0, ge=0, le=1 << 24, description="Pages in each ring's shared page pool; 0 = max_pages_per_gpu // 4.")
    eviction_policy: Literal["lru"] = Field("lru", description="Which cached free page is reused (evicted) first: 'lru', the one freed longest ago (the only policy implemented).")
    enable_prefix_caching: bool = Field(_E.enable_prefix_caching, strict=True, description="Reuse the KV of full pages whose chained hash (tokens, images, model, dtype) matches a cached page (docs/kv_sharing.md); false: every prompt is computed from scratch.")


class CacheConfig(_Frozen):
    """Caches of the prefill domain besides the KV pages."""

    encoder_cache_bytes: int = Field(_E.encoder_cache_bytes, strict=True, ge=0, le=1 << 40, description="Bytes of projected image embeddings each prefill (or colocated) worker keeps by image content hash, LRU; a repeated image skips the vision tower. 0 turns the cache off.")


class APIConfig(_Frozen):
    """HTTP front-end limits."""

    host: str = Field("127.0.0.1", description="Address the HTTP server binds (--host).")
    port: int = Field(8000, ge=0, le=65535, description="Port of the HTTP server (--port).")
    max_request_length: int = Field(8192, ge=1, description="Max prompt tokens (image tokens included); more is a 400.")
    timeout_ms: int = Field(120_000, ge=100, description="A request not finished by then gets 503.")
    shutdown_grace_s: float = Field(30.0, ge=0, le=3600, description="On SIGTERM/SIGINT (--shutdown-grace-s): new requests get 503 while in-flight ones finish, for up to this long; requests still in flight then get 503 (a stream: an error event) and every worker stops. A second signal ends the wait at once.")
    max_body_bytes: int = Field(64 << 20, ge=1024, description="Larger request bodies get 413.")
    body_idle_timeout_s: float = Field(10.0, gt=0, le=3600, description="A generation call's body (/v1/chat/completions, /v1/completions) that sends no byte for this long gets 408 and its connection is closed: it holds its size in the image budget while it is read.")
    body_read_timeout_s: float = Field(60.0, gt=0, le=3600, description="A generation call's body not fully received this long after the request arrived gets 408 and its connection is closed.")
    max_images_per_request: int = Field(4, ge=0, le=64, description="Most images in one request; more is a 400.")
    max_stop_strings: int = Field(64, ge=1, le=65536, description="Most stop strings in one request (OpenAI allows 4); more is a 400 (code stop_limit).")
    max_stop_chars: int = Field(8192, ge=1, le=1 << 24, description="Most characters in one request's stop strings together; more is a 400 (code stop_limit). A stream holds back the longest stop string's length less one character until it knows they start no stop string.")
    max_stop_token_ids: int = Field(1024, ge=1, le=1 << 20, description="Most stop_token_ids in one request; more is a 400 (code stop_limit).")
    max_grammar_compile_s: float = Field(2.0, gt=0, le=60, description="Seconds the front end may take to compile a call's grammar (each worker compiles it again, in about as long, while the request waits); a grammar not compiled by then is a 400 (code grammar_too_complex), and the same grammar is refused at once afterwards. Keep it well under fault.heartbeat_timeout_s.")
    max_grammar_chars: int = Field(32768, ge=1, le=1 << 22, description="Most characters of the grammar a call asks for (a response_format JSON schema, guided_json, guided_regex, guided_choice as JSON, guided_grammar, a required or named tool_choice's parameter schemas); more is a 400 (code grammar_limit). It travels with the request to the decode worker: each hand-off ring slot holds 4 bytes a character of it.")
    max_tools: int = Field(128, ge=1, le=1 << 16, description="Most tools in one chat call (OpenAI's limit); more is a 400 (code tools_limit).")
    tool_call_parser: Literal["auto", "hermes", "llama3_json"] = Field("auto", description="How tool calls are found in what a model writes with tool_choice auto (--tool-call-parser, vLLM's names): 'hermes' reads <tool_call>{...}</tool_call> blocks (Qwen2, Hermes), 'llama3_json' a JSON answer with name and parameters (Llama 3.1); 'auto' takes llama3_json for a Llama decoder, else hermes.")
    max_logit_bias: int = Field(1024, ge=1, le=1 << 20, description="Most logit_bias entries (tokens) in one request; more is a 400 (code logit_bias_limit).")
    max_messages: int = Field(2048, ge=1, le=1 << 24, description="Most messages in one chat call; more is a 400 (code messages_limit).")
    max_n: int = Field(16, ge=1, le=16, description="Most choices (n) one call may ask for per prompt (the engine's own bound is 16); more is a 400 (code n_limit).")
    max_logprobs: int = Field(20, ge=0, le=20, description="Most alternatives per token one call may ask for (chat top_logprobs, completions logprobs; vLLM's max_logprobs; the engine's own bound is 20); more is a 400 (code logprobs_limit).")
    max_content_parts: int = Field(4096, ge=1, le=1 << 24, description="Most content parts (text, image, video) in one chat call's messages together; more is a 400 (code content_parts_limit).")
    max_image_pixels: int = Field(40_000_000, ge=1, description="Larger decoded images are refused (decompression bomb).")
    media_threads: int = Field(0, strict=True, ge=0, le=256, description="Threads of the API process that decode and preprocess the images and videos of calls (a call without any is tokenized apart); each step waits for one, tighter SLO tiers first, so a burst of photos cannot take every core from the workers; they run at compute.worker_nice. 0 = half the cores the server may run on, at least 1.")
    max_image_fetch_bytes: int = Field(20 << 20, ge=1024, description="Largest image fetched from an http(s) URL, in bytes.")
    image_fetch_timeout_s: float = Field(10.0, gt=0, description="Seconds an http(s) image fetch may take.")
    max_videos_per_request: int = Field(1, ge=0, le=16, description="Most video_url parts in one request (models that take video, Qwen2-VL); more is a 400.")
    video_fps: float = Field(2.0, gt=0, le=60, description="Frames sampled per second of video unless a request's mm_processor_kwargs.fps says otherwise (fewer when max_video_frames binds).")
    max_video_frames: int = Field(32, ge=1, le=768, description="Most frames sampled from one video (a request's mm_processor_kwargs.max_frames may ask for fewer, not more).")
    max_video_seconds: float = Field(600.0, gt=0, description="Longer videos are a 400 (checked on the container's packets, before any frame is decoded).")
    max_video_frame_pixels: int = Field(1280 * 720, ge=1, description="Videos whose frames have more pixels are a 400 (checked before decoding); with max_video_frames it bounds a decoded video's memory.")
    max_video_fetch_bytes: int = Field(64 << 20, ge=1024, description="Largest video fetched from an http(s) URL or read from a file:// URL, in bytes.")
    api_key: str | list[str] | None = Field(None, description="Require 'Authorization: Bearer <key>' on /v1/* and /internal/* (--api-key, which may be given more than once); a list accepts any of its keys (one per tenant); printable ASCII without spaces (it travels in a header); null = no key.")
    cache_salt_by_api_key: bool = Field(False, description="Salt every generation call's prefix- and encoder-cache hashes by the API key it came with (one tenant per key; a call's own cache_salt is salted within its key's): no tenant's prompts or images are ever reported or timed as cached for another. Needs api_key.")
    allowed_local_media_path: str | None = Field(None, description="A folder whose images and videos requests may name as file:// URLs (--allowed-local-media-path); null = no file:// URLs.")
    allowed_media_domains: list[str] = Field(default_factory=list, description="Hosts http(s) images and videos may be fetched from (--allowed-media-domains); empty = any public host.")
    event_loop: Literal["auto", "asyncio", "uvloop"] = Field("auto", description="The API process's event loop (uvicorn's --loop): 'auto' takes uvloop when it is installed (a dependency on Linux and macOS), else asyncio's.")
    http_parser: Literal["auto", "h11", "httptools"] = Field("auto", description="The API process's HTTP/1.1 implementation: 'auto' and 'h11' take uvicorn's h11 protocol with this section's header, connection and error limits (mm_serve/server/guarded_http.py); 'httptools' takes uvicorn's httptools (C) protocol, whose parsing is faster but which has none of them (no 431, no header timeout, no connection cap, plain-text 400s): only behind a proxy that enforces them.")
    max_header_bytes: int = Field(32 << 10, ge=1024, le=1 << 24, description="Most bytes in a request's line and headers together; more gets 431 (code header_too_large) and the connection is closed.")
    header_timeout_s: float = Field(10.0, gt=0, le=3600, description="A connection whose request line and headers are not complete this long after it opened, or after their first byte on a kept-alive connection, is closed.")
    keep_alive_timeout_s: int = Field(5, ge=1, le=3600, description="An idle kept-alive connection is closed after this long (uvicorn's --timeout-keep-alive).")
    max_connections: int = Field(2048, ge=1, le=1 << 20, description="Most open connections: a request on a connection opened past it gets 429 (code too_many_connections) with Retry-After and the connection is closed.")

    @field_validator("api_key")
    @classmethod
    def _sendable_key(cls, value: str | list[str] | None) -> str | list[str] | None:
        """Keys clients can send in a header: printable ASCII, no spaces (HTTP clients encode a
        header otherwise, and it would never match); an empty key is an error (an unset variable must not turn
        the check off)."""
        if value == "" or (isinstance(value, list) and not all(value)):
            raise ValueError("an empty api_key would turn the key check off: give a key, or null for none")
        for key in [value] if isinstance(value, str) else value or []:
            if not (key.isascii() and key.isprintable() and " " not in key):
                raise ValueError("api_key must be printable ASCII without spaces (it travels in the Authorization header)")
        return value

    @model_validator(mode="after")
    def _salt_needs_key(self) -> APIConfig:
        if self.cache_salt_by_api_key and not self.api_keys:
            raise ValueError("cache_salt_by_api_key needs api_key (the keys are the tenants)")
        return self

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The keys ``api_key`` accepts (one string or a list), () when none is required."""
        value = self.api_key
        return (value,) if isinstance(value, str) and value else tuple(value or ())


class FaultConfig(_Frozen):
    """Supervision of the workers and migration of the requests a failed worker held (strict types:
    ``true`` is no count, ``"0.5"`` no number, ``"no"`` no boolean)."""

    heartbeat_timeout_s: float = Field(strict=True, default=10.0, ge=0.5, le=3600, description="A ready worker that sends nothing (stats come every 0.5 s between steps) for this long is hung: it is killed and restarted. Longer than the slowest single step.")
    max_restarts: int = Field(strict=True, default=3, ge=0, le=1000, description="Restarts of one worker allowed within restart_window_s; past it the worker stays down and the service runs on the others.")
    restart_window_s: float = Field(strict=True, default=300.0, gt=0, le=86400, description="The window max_restarts counts in, in seconds.")
    exit_when_unavailable: bool = Field(strict=True, default=True, description="When every worker of a role the requests need is down for good (past max_restarts), `mm-serve serve` answers what is in flight with an error and exits with status 1, so that a supervisor (systemd, Kubernetes, a container's restart policy) starts a fresh service, as vLLM exits when its engine dies; false: it stays up, answering 503 with /health 503 `down`.")
    restart_backoff_s: float = Field(strict=True, default=0.5, ge=0, le=600, description="Wait before restarting a failed worker, doubled for each restart already in the window.")
    start_timeout_s: float = Field(strict=True, default=300.0, gt=0, le=7200, description="A restarted worker not ready within this long counts as failed again.")
    max_migrations: int = Field(strict=True, default=3, ge=0, le=100, description="Times one request may be moved to another worker after a fault (re-prefilled from its prompt plus the tokens already streamed); past it the request ends with a 503 / an SSE error event.")
    handoff_checksum: bool = Field(strict=True, default=True, description="CRC-32 of each hand-off's KV pages and features, checked by decode before it uses them; a mismatch is re-prefilled.")


class BatchConfig(_Frozen):
    """The server-side OpenAI Batch API (``/v1/files``, ``/v1/batches``): storage and limits."""

    data_dir: str | None = Field(None, description="Folder for the batch database (SQLite) and files (--batch-data-dir); null = $XDG_STATE_HOME/mm-serve/batches, else ~/.local/state/mm-serve/batches. Created on the first batch call.")
    max_file_bytes: int = Field(200 << 20, ge=1024, le=1 << 40, description="Largest uploaded file, in bytes (OpenAI's limit: 200 MB); larger uploads get 413.")
    max_lines: int = Field(50_000, ge=1, le=10_000_000, description="Most requests (lines) in one batch input file (OpenAI's limit: 50,000).")
    max_total_bytes: int = Field(10 << 30, ge=1 << 20, le=1 << 50, description="Disk bound: stored files plus running batches' results, in bytes; an upload that would pass it gets 413.")
    max_in_flight_rows: int = Field(2, ge=1, le=4096, description="A batch row starts only while the engine has fewer requests than this in flight (interactive ones included), so at most this many batch rows run, over every batch: with the batch SLO tier the rows run in, what keeps interactive traffic fast while a batch runs.")
    completion_window_s: int = Field(86_400, ge=1, le=30 * 86_400, description="What completion_window '24h' means here: seconds after creation at which unfinished rows are given up (status 'expired', those rows in the error file).")
    fsync: bool = Field(False, description="fsync each result row (survives power loss); without it a row is flushed to the OS, which survives a crash or SIGKILL of the server.")


class TierSLO(_Frozen):
    """The latency targets of one SLO tier (milliseconds here, at the configuration surface only)."""

    ttft_ms: float = Field(gt=0, le=3_600_000, description="Time-to-first-token SLO, in milliseconds.")
    tpot_ms: float = Field(gt=0, le=600_000, description="Time-per-output-token SLO, in milliseconds.")
    attainment: float = Field(0.9, gt=0, le=1, description="Target fraction of the tier's requests meeting both SLOs.")

    @property
    def slo(self) -> SLO:
        """These targets in seconds, the unit everything past the configuration uses."""
        return SLO(self.ttft_ms / 1000.0, self.tpot_ms / 1000.0, self.attainment)


class TiersConfig(_Frozen):
    """The three tiers, tightest first: each must be at least as tight as the next in both ``ttft_ms`` and
    ``tpot_ms``; a tier given in part keeps the defaults of the keys it omits."""

    interactive: TierSLO = Field(TierSLO(ttft_ms=1_000, tpot_ms=100, attainment=0.9), description="The tightest tier: service_tier 'priority' or 'interactive'.")
    standard: TierSLO = Field(TierSLO(ttft_ms=4_000, tpot_ms=250, attainment=0.9), description="The middle tier: service_tier 'default' or 'standard'.")
    batch: TierSLO = Field(TierSLO(ttft_ms=60_000, tpot_ms=2_000, attainment=0.5), description="The loosest tier: service_tier 'flex' or 'batch', and Batch API rows; never refused for latency, only queued.")

    @model_validator(mode="before")
    @classmethod
    def _fill_from_defaults(cls, data: Any) -> Any:
        """A tier given in part (``standard: {ttft_ms: 2000}``) keeps the defaults of the keys it omits."""
        if not isinstance(data, dict):
            return data
        filled = dict(data)
        for name, field in cls.model_fields.items():
            given = data.get(name)
            if isinstance(given, dict) and isinstance(field.default, TierSLO):
                filled[name] = {**field.default.model_dump(), **given}
        return filled

    @model_validator(mode="after")
    def _ordered(self) -> TiersConfig:
        for tight, loose in (("interactive", "standard"), ("standard", "batch")):
            a, b = getattr(self, tight), getattr(self, loose)
            if a.ttft_ms > b.ttft_ms or a.tpot_ms > b.tpot_ms:
                raise ValueError(f"slo.tiers.{tight} must be at least as tight as slo.tiers.{loose} "
                                 f"(ttft_ms {a.ttft_ms} vs {b.ttft_ms}, tpot_ms {a.tpot_ms} vs {b.tpot_ms})")
        return self


class SLOConfig(_Frozen):
    """SLO tiers; a request picks one with OpenAI's ``service_tier`` (docs/admission.md)."""

    tiers: TiersConfig = Field(TiersConfig(), description="Each tier's SLOs and attainment target.")
    default_tier: TierLabel = Field("standard", description="Tier of a request that sends no service_tier (or 'auto').")

    def of(self, tier: Tier) -> SLO:
        """The SLO of ``tier``, in seconds."""
        slo: TierSLO = getattr(self.tiers, tier.label)
        return slo.slo

    @property
    def default(self) -> Tier:
        """The tier of a request that names none (``default_tier``)."""
        return Tier.from_label(self.default_tier)

    def ageing_s(self, tier: Tier) -> float:
        """Seconds after which a queued prefill request of ``tier`` is served as the tightest tier
        (0.0 for the tightest tier itself): when what is left of its TTFT SLO is the tightest
        tier's TTFT SLO, the time a request of that tier is promised; at least half its own TTFT
        SLO, so a tier whose SLO is close to the tightest one's keeps some precedence. From then on
        it is served in arrival order with the tightest tier's requests, so a looser request
        admitted just before a burst of tighter ones does not wait for the whole burst."""
        if tier == Tier.INTERACTIVE:
            return 0.0
        own, tightest = self.of(tier).ttft_s, self.of(Tier.INTERACTIVE).ttft_s
        return max(own - tightest, own / 2)


class AdmissionConfig(_Frozen):
    """Admission control in the API front end: hard bounds (always on) and the latency predictor (strict
    types: ``true`` is no count, ``"30"`` no number)."""

    predict: bool = Field(True, strict=True, description="Reject (429) a request whose predicted TTFT or TPOT misses its tier's SLO by more than margin (docs/admission.md); false (--no-admission) keeps only the bounds.")
    margin: float = Field(-0.2, strict=True, ge=-0.9, le=100, description="Refuse when a prediction exceeds the SLO x (1 + margin): negative = headroom for the prediction's spread (-0.2: refuse above 80 % of the SLO), positive = tolerance.")
    max_request_work_tokens: int = Field(262_144, strict=True, ge=1, description="One API call's work, prompts x n x (prompt tokens + max_tokens); more is a 400.")
    max_queued_requests: int = Field(1_024, strict=True, ge=1, description="Engine requests waiting for their first token (all callers); more gets 429.")
    max_queued_prompt_tokens: int = Field(524_288, strict=True, ge=1, description="Prompt tokens (image tokens included) of the requests waiting for their first token; more gets 429.")
    max_image_bytes_in_flight: int = Field(512 << 20, strict=True, ge=1 << 20, description="Bytes reserved by images being fetched, decoded and preprocessed in the API process at once: each image reserves its encoded size (a data URI's length, api.max_image_fetch_bytes for a URL) plus what decoding and preprocessing it will hold: for a data URI whose header declares its size, 16 bytes per declared pixel plus twice the model's preprocessed tensor for it (float32), else image_decode_reserve_bytes; a generation call's body holds its length in the same budget while it is read. A call that does not fit waits for room (first come, first served) up to image_wait_s, then gets 429 (code image_bytes) with Retry-After.")
    image_wait_s: float = Field(10.0, strict=True, ge=0, le=3600, description="Seconds a call (or a generation body about to be read) waits for room in max_image_bytes_in_flight before it is refused with 429 image_bytes; 0 = refuse at once.")
    profile: str | None = Field(None, description="An 'mm-serve profile' JSON file: the predictor starts from a fit of its prefill, encode and decode points instead of the built-in defaults (it is refitted online either way).")
    image_decode_reserve_bytes: int = Field(48 << 20, strict=True, ge=1 << 16, description="Bytes reserved per image for its decode and preprocessing (on top of its encoded size); 48 MiB holds a 4000x4000 RGB image.")
    attainment_feedback: bool = Field(True, strict=True, description="Tighten a tier's TTFT or TPOT limit while its admitted requests miss that SLO more often than half way from its attainment target to 100 % allows (docs/admission.md); false = the margin alone.")
    protect_admitted: bool = Field(True, strict=True, description="Refuse a call whose prefill, served before the queued requests of looser tiers, would make one of them that its prediction has on time miss its TTFT SLO (docs/admission.md); false = tighter tiers pass looser ones whatever it costs them.")
    decide_within_ms: int = Field(15, strict=True, ge=0, le=600_000, description="A call whose images are still being decoded (or prompts tokenized) this long after its arrival is admitted or refused then, on the early check (docs/admission.md); 0 = always decide after that work, however long it takes.")


class PlacementConfig(_Frozen):
    """How ``mm-serve serve`` picks the placement when the config pins none (docs/planner.md, "The placement at start")."""

    auto: bool = Field(True, strict=True, description="(--no-auto-placement sets false) When none of mode, compute.prefill_workers, compute.decode_workers, compute.prefill_cpus, compute.decode_cpus, compute.prefill_gpus and compute.decode_gpus is given (in the file or as flags) and cluster.backend is local, `mm-serve serve` profiles this machine once (cached; the path is printed), asks the planner for the placement with the best goodput for placement.workload at the default tier's SLOs, and runs it: colocated on every core, or N prefill + M decode workers on their planned cores. It prints the choice and each candidate's predicted goodput, and /health reports them. false: the config's placement keys as they are (their defaults: 1 prefill + 1 decode worker).")
    workload: str = Field("auto", min_length=1, description="The traffic the placement is planned for: a workload `mm-serve bench` knows (chatbot, code, summarization, llava, long-multimodal, caption, ...) or a JSONL workload file; auto = llava for a model with a vision tower, else chatbot.")
    front_end_ms_per_token: float = Field(0.35, ge=0, le=100, description="Milliseconds per running request that a colocated worker's step takes beyond its profile, as the planner prices it: the worker's threads run in lockstep on every core, so the CPU time that the serving process (and a load generator on the same machine) spends streaming each token stalls them all. 0.35: the excess measured on a 2-core Xeon under chatbot load, 0.34-0.40 (front end 0.28: API process 0.19, `mm-serve bench` client 0.09; the engine's work outside the forward pass 0.05); with the clients on other machines, ~0.25. One-thread workers are not charged it.")
    profile_dir: str | None = Field(None, description="Where machine profiles are cached; null = $MM_SERVE_PROFILE_DIR, else $MM_SERVE_CACHE_DIR/profiles, else $XDG_CACHE_HOME/mm-serve/profiles, else ~/.cache/mm-serve/profiles.")

    @field_validator("workload")
    @classmethod
    def _known_workload(cls, value: str) -> str:
        """auto, a built-in workload's name or an existing file: a misspelt name is an error at load, not a
        planner that quietly cannot choose."""
        if value == "auto" or value in BUILTIN_WORKLOADS or Path(value).is_file():
            return value
        raise ValueError(f"unknown workload {value!r}: choose auto, {', '.join(BUILTIN_WORKLOADS)}, or the path of "
                         "a JSONL workload file")


class ClusterConfig(_Frozen):
    """Where the workers run: local processes on this machine, or Ray actors on the nodes of a
    Ray cluster (docs/multi_node.md)."""

    backend: Literal["local", "ray"] = Field("local", description="Where the workers run (--cluster-backend): 'local', worker processes on this machine; 'ray', Ray actors on the cluster's nodes (the front end runs where mm-serve serve runs; mode 'colocated' runs on one machine only).")
    address: str = Field("auto", min_length=1, description="Ray cluster to join (ray.init address; --ray-address): 'auto' = the cluster started on this machine with `ray start`, or host:port of its head.")
    node_resource: str = Field("mm_serve_node", pattern=r"^[A-Za-z][A-Za-z0-9_]{0,63}$", description="Node i of prefill_nodes / decode_nodes is the Ray node started with the custom resource '<node_resource>_<i>' (e.g. ray start --resources '{\"mm_serve_node_0\": 1000}'); each worker takes one unit.")
    prefill_nodes: list[int] = Field(default_factory=list, description="Node index of each prefill worker, in worker order (one per prefill worker; needs backend 'ray'); empty = wherever Ray places it.")
    decode_nodes: list[int] = Field(default_factory=list, description="Node index of each decode worker, in worker order (one per decode worker; needs backend 'ray'); empty = wherever Ray places it.")
    advertise_host: str = Field("auto", min_length=1, description="Address the front end binds its worker sockets to (ZeroMQ over TCP; the workers connect to it): 'auto' = this node's address in the Ray cluster.")

    @field_validator("prefill_nodes", "decode_nodes")
    @classmethod
    def _non_negative(cls, value: list[int]) -> list[int]:
        if any(v < 0 for v in value):
            raise ValueError(f"node indices must be >= 0, got {value}")
        return value


class ServiceConfig(_Frozen):
    """The whole service: the model, how it runs, and one section per topic."""

    model: str = Field("embedded", description="Model directory (a llava-hf or Llama checkpoint), or a registered name such as 'embedded' (--model).")
    served_model_name: str | None = Field(None, description="The model id clients send and /v1/models lists (--served-model-name); null = the model value.")
    mode: Literal["disaggregated", "colocated"] = Field("disaggregated", description="'disaggregated': prefill and decode worker processes joined by the hand-off ring; 'colocated': one continuous-batching worker doing both, the baseline (--mode).")
    dtype: DTypeChoice = Field(_E.dtype, description="Weights, activations, KV cache, ring pages and features element type; auto: on a GPU the checkpoint's own (config.json dtype / torch_dtype, float32 when it declares none), on a CPU float32 (the compiled kernels and packed linear layers are float32; bf16 and fp16 decode slower there). The sampler works in float32 whatever this is.")
    seed: int = Field(_E.seed, description="Seed of the sampling generators of requests that bring no seed.")
    enforce_eager: bool = Field(_E.enforce_eager, description="Never capture decode steps in CUDA graphs (on a GPU they are captured by default; no effect on a CPU).")
    cpu_gemm: Literal["onednn", "torch"] = Field(_E.cpu_gemm, description="float32 on a CPU: 'onednn' runs linear layers from weights packed once for oneDNN (mm_serve/kernels/cpu_linear.py; layers under ~0.5 M weights also keep their plain copy, which MKL runs faster for 1-2 rows), 'torch' uses torch's default F.linear (MKL).")
    cpu_kernels: Literal["compiled", "torch"] = Field(_E.cpu_kernels, description="float32 on a CPU: 'compiled' runs decode attention (RoPE, K/V write, attention read in place from the KV pages) and RMSNorm from C++ kernels built once (kernels/csrc, compiled with c++ or $CXX and ninja by `make install`, else at the first start, into $MM_SERVE_CACHE_DIR, else $XDG_CACHE_HOME/mm-serve, else ~/.cache/mm-serve; falls back to 'torch' with one warning where they cannot be built), 'torch' uses torch ops (pages gathered, then SDPA).")
    attention_backend: Literal["auto", "flex", "torch"] = Field(_E.attention_backend, description="Attention over the paged KV cache: 'auto' takes flash-attn on a GPU where it is installed, the compiled C++ decode kernel for float32 on a CPU (cpu_kernels compiled), else the torch reference; 'flex' is FlexAttention everywhere (block masks over the pages in place, one call per layer for a whole prefill batch; compiled on a GPU, eager on a CPU, where it is exact but slow: for tests); 'torch' is the reference (pages gathered into a padded copy, then SDPA). docs/attention.md.")
    compute: ComputeConfig = ComputeConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    kv_cache: KVCacheConfig = KVCacheConfig()
    cache: CacheConfig = CacheConfig()
    api: APIConfig = APIConfig()
    fault: FaultConfig = FaultConfig()
    slo: SLOConfig = SLOConfig()
    admission: AdmissionConfig = AdmissionConfig()
    batch: BatchConfig = BatchConfig()
    cluster: ClusterConfig = ClusterConfig()
    placement: PlacementConfig = PlacementConfig()

    def ineffective_settings(self) -> list[str]:
        """Why each setting given here does nothing with the rest of this config (one line each; empty
        when none), for a warning at start: a valid config, but not what its author meant."""
        sched = self.scheduler
        paced = bool(sched.decode_step_pacing or sched.decode_step_interval_ms)
        lines = []
        if sched.decode_pacing_always and not paced:
            lines.append("scheduler.decode_pacing_always has no effect: no decode pacing is set "
                         "(scheduler.decode_step_pacing or scheduler.decode_step_interval_ms)")
        counts = [f"compute.{key} ({value})" for key in ("prefill_workers", "decode_workers")
                  if (value := getattr(self.compute, key)) != 1]
        if counts and self.mode == "colocated":
            lines.append(f"{' and '.join(counts)} {'has' if len(counts) == 1 else 'have'} no effect in colocated mode: "
                         "one worker runs both phases (on the cores of compute.prefill_cpus and compute.decode_cpus)")
        if paced and self.mode == "colocated":
            lines.append("decode pacing (scheduler.decode_step_pacing / decode_step_interval_ms) has no effect in "
                         "colocated mode: one worker runs both phases, there is no prefill worker to yield to")
        cluster, defaults = self.cluster, ClusterConfig()
        ray_only = [key for key in ("address", "advertise_host", "node_resource")
                    if getattr(cluster, key) != getattr(defaults, key)]  # a written-out default asks for nothing
        if ray_only and cluster.backend == "local":
            keys = " and ".join(f"cluster.{key}" for key in ray_only)
            lines.append(f"{keys} {'has' if len(ray_only) == 1 else 'have'} no effect with cluster.backend local "
                         "(--cluster-backend ray joins a Ray cluster)")
        return lines

    def serving_dtype(self, raw: dict[str, Any]) -> DTypeName:
        """The element type every worker and ring of this service uses for the checkpoint whose
        ``config.json`` is ``raw``: :attr:`dtype`, with ``auto`` settled by
        :func:`~mm_serve.ground.dtypes.resolve_dtype` (the checkpoint's with GPU workers, else float32)."""
        return resolve_dtype(self.dtype, raw, self.compute.uses_gpus)

    @model_validator(mode="after")
    def _placement_matches_workers(self) -> ServiceConfig:
        cluster = self.cluster
        for role in ("prefill", "decode"):
            nodes = getattr(cluster, f"{role}_nodes")
            if not nodes:
                continue
            if cluster.backend != "ray":
                raise ValueError(f"cluster.{role}_nodes places workers on nodes: it needs cluster.backend: ray")
            workers = getattr(self.compute, f"{role}_workers")
            if len(nodes) != workers:
                raise ValueError(f"cluster.{role}_nodes lists {len(nodes)} nodes but compute.{role}_workers is {workers}")
        if cluster.backend == "ray" and self.mode == "colocated":
            raise ValueError("cluster.backend: ray runs disaggregated workers only (mode: colocated runs on one machine)")
        interval, tightest = self.scheduler.decode_step_interval_ms, self.slo.tiers.interactive.tpot_ms
        if interval and self.scheduler.decode_step_pacing:
            raise ValueError("scheduler.decode_step_interval_ms and scheduler.decode_step_pacing both pace decode steps "
                             "(a fixed interval, a fraction of the running requests' TPOT SLO): set one")
        if interval >= tightest:
            raise ValueError(f"scheduler.decode_step_interval_ms ({interval:g}) must be below the tightest TPOT SLO, "
                             f"slo.tiers.interactive.tpot_ms ({tightest:g}): paced slower, no request could meet it")
        return self


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    node = tree
    *parents, leaf = dotted.split(".")
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: '{part}' is not a section")
        node = child
    node[leaf] = value


def _allowed_keys(loc: tuple[Any, ...]) -> list[str]:
    """Field names of the section that holds the key at ``loc``."""
    model: Any = ServiceConfig
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        if field is None or not isinstance(field.annotation, type) or not issubclass(field.annotation, BaseModel):
            return []
        model = field.annotation
    return sorted(model.model_fields)


def _format_errors(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "<root>"
        value = err.get("input")
        if err["type"] == "extra_forbidden":
            lines.append(f"{key}: unknown key; allowed here: {', '.join(_allowed_keys(err['loc']))}")
            continue
        lines.append(f"{key} = {value!r}: {err['msg']}")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def config_from_dict(data: dict[str, Any], overrides: dict[str, Any] | None = None) -> ServiceConfig:
    """Validate a nested dict (plus dotted-key ``overrides``) into a :class:`ServiceConfig`.

    Raises:
        ConfigError: an unknown key or a bad value; the message lists each one.
    """
    tree: dict[str, Any] = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    for dotted, value in (overrides or {}).items():
        _set_dotted(tree, dotted, value)
    try:
        return ServiceConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc)) from None


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> ServiceConfig:
    """Read a YAML file (or the defaults when ``path`` is None), validate it, then apply the dotted-key
    ``overrides`` (command-line flags) and validate the result.

    Raises:
        ConfigError: the file is missing, not YAML, not a mapping, or invalid on its own (whatever
            the overrides set), or the overrides are invalid.
    """
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if p.is_dir():
            raise ConfigError(f"config path is a folder, not a YAML file: {p}")
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p}: not valid YAML: {exc}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: top level must be a mapping, got {type(loaded).__name__}")
        data = loaded
        try:  # the file stands on its own (an override must not hide a bad value in it), and its errors name it
            config_from_dict(data)
        except ConfigError as exc:
            raise ConfigError(f"{p}: {exc}") from None
    return config_from_dict(data, overrides)


def dump_config(cfg: ServiceConfig) -> str:
    """Render ``cfg`` as YAML that :func:`load_config` reads back to an equal object."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
