"""The offline API: ``LLM(model=...).generate(requests, sampling_params)``.

Example::

    from mm_serve import LLM, SamplingParams
    llm = LLM(model="path/to/llava-hf-checkpoint")
    out = llm.generate([{"prompt": "USER: <image>\\nWhat is this? ASSISTANT:", "images": [img]}],
                       SamplingParams(max_tokens=32, temperature=0.0))
    print(out[0].text, out[0].finish_reason, out[0].num_prompt_tokens)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from mm_serve.engine.engine_config import EngineConfig
from mm_serve.engine.llm_engine import LLMEngine
from mm_serve.engine.request import Request
from mm_serve.models.registry import resolve_model
from mm_serve.outputs import CompletionOutput, RequestOutput
from mm_serve.sampling_params import SamplingParams


class LLM:
    """Generate from a llava-hf or Llama checkpoint in this process.

    Args:
        model: a checkpoint directory or a registered name (``"embedded"``, the default).
        mode: ``"colocated"`` (one engine runs every phase).
        **engine_kwargs: :class:`EngineConfig` fields (``page_size``, ``num_pages``,
            ``max_running``, ``dtype``, ``seed``, ...).

    Raises:
        CheckpointError: the model cannot be found or loaded.
        ValueError: an unknown mode or a bad engine setting.
    """

    def __init__(self, model: str | Path | None = None, mode: str = "colocated", **engine_kwargs: Any) -> None:
        if mode != "colocated":
            raise ValueError(f"mode must be 'colocated', got {mode!r}")
        self.mode = mode
        self.model_dir = resolve_model(model)
        self.engine = LLMEngine(self.model_dir, EngineConfig(**engine_kwargs))
        self._counter = 0

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self, requests: dict[str, Any] | Sequence[dict[str, Any]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run ``requests`` to completion with continuous batching; outputs in input order.

        A request is ``{"prompt": str, "images": [PIL.Image, ...]}`` (the prompt holds
        the image token once per image), ``{"prompt_token_ids": [...], "images": [...]}``
        or ``{"messages": [...]}`` (chat, rendered with the checkpoint's template; image
        parts are ``{"type": "image", "image": PIL.Image}``).

        Raises:
            InvalidRequestError: a request is malformed or too long (nothing is run).
        """
        batch = [requests] if isinstance(requests, dict) else list(requests)
        params = self._params_for(batch, sampling_params)
        plan: list[tuple[str, list[str], int]] = []
        processed = [self.engine.inputs.process(r) for r in batch]
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
        with tqdm(total=total, disable=not use_tqdm, desc="generate") as bar:
            while self.engine.has_unfinished():
                for request in self.engine.step():
                    done[request.request_id] = request
                    bar.update(1)
        return [self._collect(rid, sub_ids, n_prompt, done) for rid, sub_ids, n_prompt in plan]

    def _collect(self, rid: str, sub_ids: list[str], n_prompt: int, done: dict[str, Request]) -> RequestOutput:
        outputs = []
        for i, sub_id in enumerate(sub_ids):
            request = done[sub_id]
            outputs.append(CompletionOutput(
                index=i, text=self.engine.output_text(request), token_ids=list(request.output_token_ids),
                finish_reason=request.finish_reason, stop_reason=request.stop_reason,
                logprobs=request.output_logprobs if request.sampling_params.logprobs is not None else None,
            ))
            self.engine.release(sub_id)
        return RequestOutput(request_id=rid, num_prompt_tokens=n_prompt, outputs=outputs)

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
