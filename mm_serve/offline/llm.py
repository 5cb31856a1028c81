"""The offline API: ``LLM(model=...).generate(requests, sampling_params)``.

Example::

    from mm_serve import LLM, SamplingParams
    llm = LLM(model="path/to/llava-hf-checkpoint")
    out = llm.generate([{"prompt": "USER: <image>\\nWhat is this? ASSISTANT:", "images": [img]}],
                       SamplingParams(max_tokens=32, temperature=0.0))
    print(out[0].text, out[0].finish_reason, out[0].num_prompt_tokens)
"""

from __future__ import annotations

import atexit
import uuid
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from mm_serve.cluster.worker_specs import check_supported, engine_sizing, worker_device
from mm_serve.colocated.llm_engine import LLMEngine
from mm_serve.config import ServiceConfig, config_from_dict
from mm_serve.engine.engine_client import EngineClient
from mm_serve.engine.request_state import RequestState
from mm_serve.ground.roles import Role
from mm_serve.inputs.input_processor import InvalidRequestError, ProcessedInputs
from mm_serve.media.errors import ImageError
from mm_serve.media.video_loading import VideoError
from mm_serve.models.named_models import resolve_model
from mm_serve.offline.outputs import CompletionOutput, RequestOutput
from mm_serve.runtime.engine_config import EngineConfig
from mm_serve.runtime.grammar_spec import GrammarAllowsNothing, GrammarError
from mm_serve.runtime.request import Request
from mm_serve.runtime.sampling_params import SamplingParams
from mm_serve.runtime.structured_output import GrammarBook

# LLM keyword -> dotted ServiceConfig key, for the worker-process modes.
_SERVICE_KEYS = {
    "num_pages": "kv_cache.max_pages_per_gpu", "page_size": "kv_cache.page_size",
    "ring_pages": "kv_cache.ring_pages", "max_running": "scheduler.decode_max_concurrent",
    "prefill_token_budget": "scheduler.prefill_token_budget", "prefill_batch_size": "scheduler.prefill_batch_size",
    "prefill_chunk_tokens": "scheduler.prefill_chunk_tokens", "mixed_step_tokens": "scheduler.mixed_step_tokens",
    "decode_step_interval_ms": "scheduler.decode_step_interval_ms", "decode_step_pacing": "scheduler.decode_step_pacing",
    "decode_pacing_always": "scheduler.decode_pacing_always",
    "ring_buffer_size": "scheduler.ring_buffer_size", "prefill_workers": "compute.prefill_workers",
    "decode_workers": "compute.decode_workers", "prefill_cpus": "compute.prefill_cpus",
    "decode_cpus": "compute.decode_cpus", "threads_per_worker": "compute.threads_per_worker",
    "dtype": "dtype", "seed": "seed", "max_images_per_request": "api.max_images_per_request",
    "enforce_eager": "enforce_eager", "cpu_gemm": "cpu_gemm",
    "cpu_kernels": "cpu_kernels", "attention_backend": "attention_backend", "enable_prefix_caching": "kv_cache.enable_prefix_caching",
    "encoder_cache_bytes": "cache.encoder_cache_bytes",
}


_ENGINE_KEYS = list(EngineConfig.field_names())


def _grammar_name(kind: str) -> str:
    """How a message names a structured output's grammar of ``kind``."""
    return "the grammar" if kind == "grammar" else f"the {kind} grammar"


def _colocated_engine_config(config: ServiceConfig | None, kwargs: dict[str, Any]) -> EngineConfig:
    """The in-process engine's settings: ``config`` as its colocated worker would get it, then ``kwargs``.

    Raises:
        ValueError: a keyword that is not an :class:`EngineConfig` field, or a bad value.
        ConfigError: ``config`` asks for what the runtime cannot run (TP/PP > 1, GPUs without CUDA).
    """
    unknown = sorted(set(kwargs) - set(_ENGINE_KEYS))
    if unknown:
        raise ValueError(f"unknown LLM arguments {unknown} for mode='colocated'; allowed: {_ENGINE_KEYS}")
    if config is None:
        return EngineConfig(**kwargs)
    if not isinstance(config, ServiceConfig):
        raise ValueError(f"config must be a ServiceConfig (mm_serve.config.load_config), got {type(config).__name__}")
    check_supported(config)
    return engine_sizing(config, worker_device(config, Role.COLOCATED, 0)).replace(**kwargs)


class LLM:
    """Generate from a llava-hf or Llama checkpoint.

    Args:
        model: a checkpoint directory or a registered name (``"embedded"``, the default).
        mode: ``"disaggregated"`` (default: prefill and decode worker processes joined by
            the cross-modal ring buffer), ``"colocated"`` (one engine in this process runs
            every phase) or ``"colocated-worker"`` (the colocated engine in a worker process,
            as ``mm-serve serve --mode colocated`` runs it).
        config: a full :class:`~mm_serve.config.ServiceConfig`; in ``"colocated"`` mode its
            engine settings (KV cache, scheduler, dtype, seed, ``cpu_gemm``, ...) as the
            colocated worker would get them.
        **kwargs: settings that override ``config``: sizing (``page_size``, ``num_pages``,
            ``max_running``, ``dtype``, ``seed``, ``cpu_gemm``, ``cpu_kernels``, ...); the worker modes also take
            ``prefill_workers``, ``decode_workers``, ... (see ``_SERVICE_KEYS``), the colocated
            mode the :class:`~mm_serve.runtime.engine_config.EngineConfig` fields.

    Use as a context manager, or call :meth:`close`, to stop worker processes; they
    also stop when this process exits.

    Raises:
        CheckpointError: the model cannot be found or loaded.
        ValueError: an unknown mode or a bad setting.
        WorkerStartError: a worker process failed to start.
    """

    def __init__(
        self, model: str | Path | None = None, mode: str = "disaggregated", config: ServiceConfig | None = None,
        **kwargs: Any,
    ) -> None:
        if mode not in ("disaggregated", "colocated", "colocated-worker"):
            raise ValueError(f"mode must be 'disaggregated', 'colocated' or 'colocated-worker', got {mode!r}")
        self.mode = mode
        self.model_dir = resolve_model(model)
        self._counter = 0
        self.engine: LLMEngine | None = None
        self.client: EngineClient | None = None
        if mode == "colocated":
            self.engine = LLMEngine(self.model_dir, _colocated_engine_config(config, kwargs))
            self.inputs = self.engine.inputs
            self.grammars = self.engine.grammars
            return
        unknown = sorted(set(kwargs) - set(_SERVICE_KEYS))
        if unknown:
            raise ValueError(f"unknown LLM arguments {unknown}; allowed: {sorted(_SERVICE_KEYS)}")
        overrides = {_SERVICE_KEYS[k]: v for k, v in kwargs.items()}
        overrides["mode"] = "colocated" if mode == "colocated-worker" else "disaggregated"
        base = config.model_dump() if config is not None else {}
        service = config_from_dict(base, overrides)
        self.client = EngineClient(self.model_dir, service)
        self.inputs = self.client.inputs
        self.grammars = GrammarBook(self.model_dir)  # checks the grammars before anything runs (as the server's front end)
        self.client.start()
        atexit.register(self.close)

    @property
    def tokenizer(self) -> Any:
        return self.inputs.tokenizer

    def close(self) -> None:
        """Stop the worker processes and free shared memory (no-op in colocated mode)."""
        if self.client is not None:
            self.client.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self, requests: str | dict[str, Any] | Sequence[str | dict[str, Any]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run ``requests`` to completion with continuous batching; outputs in input order.

        A request is ``{"prompt": str, "images": [PIL.Image, ...]}`` (the prompt holds
        the image token once per image), ``{"prompt_token_ids": [...], "images": [...]}``
        or ``{"messages": [...]}`` (chat, rendered with the checkpoint's template; image
        parts are ``{"type": "image", "image": X}`` or ``{"type": "image_url", "image_url":
        {"url": X}}``, ``X`` a PIL image, a path, bytes or a data URI); a bare string is
        ``{"prompt": string}``. Any of them may add ``"mm_processor_kwargs": {"min_pixels": N,
        "max_pixels": M}`` for a Qwen2-VL checkpoint's images; another key is an error.

        Raises:
            InvalidRequestError: a request is malformed or too long, or a structured output's grammar does not
                compile or allows no output (nothing is run).
            RuntimeError: a request failed (a worker fault past its migrations, or a grammar that allows no
                token at some point: its message says why).
        """
        if isinstance(requests, str | dict):
            requests = [requests]
        batch = [{"prompt": r} if isinstance(r, str) else r for r in requests]
        params = self._params_for(batch, sampling_params)
        self._check_grammars(params)
        processed = [self._process(r) for r in batch]
        if self.client is not None:
            return self._generate_with_workers(processed, params, use_tqdm)
        assert self.engine is not None
        plan: list[tuple[str, list[str], int]] = []
        for inputs, p in zip(processed, params, strict=True):
            rid = f"req-{self._counter}"
            self._counter += 1
            sub_ids = []
            for i in range(p.n):
                seed = None if p.seed is None else p.seed + i
                sub_id = f"{rid}/{i}"
                self.engine.add_request(sub_id, inputs, replace(p, seed=seed, n=1))
                sub_ids.append(sub_id)
            plan.append((rid, sub_ids, len(inputs.prompt_token_ids)))
        done: dict[str, Request] = {}
        total = sum(len(s) for _, s, _ in plan)
        try:
            with tqdm(total=total, disable=not use_tqdm, desc="generate") as bar:
                while self.engine.has_unfinished():
                    for request in self.engine.step():
                        done[request.request_id] = request
                        bar.update(1)
        except BaseException:  # a failed step (or Ctrl-C): the call's requests go, so the engine serves the next call
            for _, sub_ids, _ in plan:
                for sub_id in sub_ids:
                    self.engine.abort(sub_id)
                    self.engine.release(sub_id)
            raise
        failed = [r for r in done.values() if r.grammar_failure is not None]
        if failed:  # as with workers: a request that cannot go on fails the call
            for request in done.values():
                self.engine.release(request.request_id)
            raise RuntimeError(f"{len(failed)} request(s) failed: {failed[0].grammar_failure}")
        return [self._collect(rid, sub_ids, n_prompt, done) for rid, sub_ids, n_prompt in plan]

    def _check_grammars(self, params: list[SamplingParams]) -> None:
        """Compile each structured output's grammar and check that some output can start under it, as the
        server's front end does (:meth:`~mm_serve.runtime.structured_output.GrammarBook.check_start`).

        Raises:
            InvalidRequestError: a grammar that does not compile or allows no output (param ``structured``).
        """
        if self.engine is not None:
            model_config = self.engine.model_config
        else:
            assert self.client is not None
            model_config = self.client.model_config
        for spec in dict.fromkeys(p.structured for p in params if p.structured is not None):
            try:
                self.grammars.check_start(spec, model_config.text.vocab_size)
            except GrammarAllowsNothing as exc:
                raise InvalidRequestError(f"{_grammar_name(spec[0])} allows no output: {exc}", "structured") from None
            except GrammarError as exc:
                raise InvalidRequestError(f"{_grammar_name(spec[0])} cannot be compiled: {exc}", "structured") from None

    def _process(self, request: dict[str, Any]) -> ProcessedInputs:
        """``request`` processed; an image or video the model's processor refuses (Qwen2-VL's aspect ratio over
        200) is an :class:`InvalidRequestError` too, as every other bad input (the server's 400 ``invalid_image``).

        Raises:
            InvalidRequestError: as :meth:`~mm_serve.inputs.input_processor.InputProcessor.process`.
        """
        try:
            return self.inputs.process(request)
        except VideoError as exc:
            raise InvalidRequestError(f"video: {exc}") from None
        except ImageError as exc:
            raise InvalidRequestError(f"image: {exc}") from None

    def _generate_with_workers(
        self, processed: list[ProcessedInputs], params: list[SamplingParams], use_tqdm: bool
    ) -> list[RequestOutput]:
        assert self.client is not None
        plan: list[tuple[str, list[RequestState]]] = []
        all_states: list[RequestState] = []
        try:
            for inputs, p in zip(processed, params, strict=True):
                rid = f"req-{uuid.uuid4().hex[:8]}-{self._counter}"
                self._counter += 1
                states = []
                for i in range(p.n):
                    states.append(self.client.submit(f"{rid}/{i}", inputs,
                                                     replace(p, seed=None if p.seed is None else p.seed + i, n=1)))
                    all_states.append(states[-1])
                plan.append((rid, states))
            with tqdm(total=len(all_states), disable=not use_tqdm, desc="generate") as bar:
                for state in all_states:
                    state.wait()
                    bar.update(1)
        except BaseException:  # Ctrl-C, or a submission refused: the call's requests stop running on the workers
            for state in all_states:
                if not state.finished:
                    self.client.abort(state.request_id)
            raise
        failed = [s for s in all_states if s.error]
        if failed:
            raise RuntimeError(f"{len(failed)} request(s) failed: {failed[0].error}")
        return [
            RequestOutput(request_id=rid, num_prompt_tokens=states[0].num_prompt_tokens,
                          num_cached_tokens=states[0].cached_tokens, prompt_logprobs=states[0].prompt_logprobs, outputs=[
                CompletionOutput(index=i, text=s.text, token_ids=list(s.token_ids), finish_reason=s.finish_reason,
                                 stop_reason=s.stop_reason, logprobs=s.logprobs or None)
                for i, s in enumerate(states)
            ])
            for rid, states in plan
        ]

    def _collect(self, rid: str, sub_ids: list[str], n_prompt: int, done: dict[str, Request]) -> RequestOutput:
        assert self.engine is not None
        outputs = []
        for i, sub_id in enumerate(sub_ids):
            request = done[sub_id]
            outputs.append(CompletionOutput(
                index=i, text=self.engine.output_text(request), token_ids=list(request.output_token_ids),
                finish_reason=request.finish_reason, stop_reason=request.stop_reason,
                logprobs=request.output_logprobs if request.sampling_params.logprobs is not None else None,
            ))
            self.engine.release(sub_id)
        cached = min(done[sub_ids[0]].num_prompt_cached_tokens, n_prompt)
        return RequestOutput(request_id=rid, num_prompt_tokens=n_prompt, outputs=outputs, num_cached_tokens=cached,
                             prompt_logprobs=done[sub_ids[0]].prompt_logprobs)

    @staticmethod
    def _params_for(batch: list[dict[str, Any]], sampling_params: Any) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * len(batch)
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * len(batch)
        params = list(sampling_params)
        if len(params) != len(batch):
            raise ValueError(f"{len(params)} sampling params for {len(batch)} requests")
        return params
