"""What the planner is asked: model, device, workload, SLOs, cluster and knobs."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from mm_serve.ground.slo import SLO
from mm_serve.planner.errors import PlannerError
from mm_serve.planner.hardware import Hardware
from mm_serve.planner.model_shape import ModelShape
from mm_serve.workloads import (
    JsonlWorkload,
    Workload,
    WorkloadError,
    check_burstiness,
    is_conversational,
)

Affinity = Literal["high", "low"]
MAX_NODES = 1024
MAX_GPUS_PER_NODE = 64
MAX_NUM_REQUESTS = 50_000  # ~2 min of search per 10 000 on one core; past that, no gain
MAX_FRONT_END_S_PER_TOKEN = 0.1  # seconds: a front end slower than this per token is a mistyped unit


@dataclass(frozen=True)
class PlanSpec:
    """Inputs of a placement search (DistServe §4: model, workload, SLOs, cluster).

    ``affinity="high"`` assumes fast inter-node links (DistServe Algorithm 1: any
    placement, KV may cross nodes); ``"low"`` keeps each prefill stage and its decode
    partner's stage on one node so KV moves over NVLink only (Algorithm 2).
    """

    shape: ModelShape
    hardware: Hardware
    workload: Workload
    slo: SLO
    attainment: float = 0.9  # fraction of requests that must meet both SLOs
    nodes: int = 1
    gpus_per_node: int = 8
    affinity: Affinity = "high"
    num_requests: int = 400  # simulated requests per probe
    seed: int = 0
    burstiness: float = 1.0  # CV of inter-arrival gaps; 1 = Poisson
    prefill_token_budget: int = 2048  # prompt tokens per prefill batch
    prefill_max_batch: int = 64  # requests per prefill batch
    decode_max_batch: int = 256  # running requests per decode / colocated instance
    colocated_mixed_tokens: int = 0  # colocated instances' mixed-step budget (0: prefill steps apart, vLLM's old policy)
    page_size: int = 16  # KV page, tokens: a mixed step prefills at least this many
    # CPU seconds the front end (the API process, and a load generator on the same machine) spends on each
    # streamed token, which stalls a CPU instance whose threads span several cores (tensor-parallel degree
    # above 1, pp 1): they run each step in lockstep, so a core taken from one thread holds up all of them
    # (0: GPU instances, or a front end on cores of its own; see the evaluator's decode_server)
    front_end_s_per_token: float = 0.0

    def __post_init__(self) -> None:
        checks = [
            (0 < self.attainment <= 1, f"attainment must be in (0, 1], got {self.attainment}"),
            (1 <= self.nodes <= MAX_NODES, f"nodes must be in 1..{MAX_NODES}, got {self.nodes}"),
            (1 <= self.gpus_per_node <= MAX_GPUS_PER_NODE,
             f"gpus per node must be in 1..{MAX_GPUS_PER_NODE}, got {self.gpus_per_node}"),
            (self.affinity in ("high", "low"), f"affinity must be high or low, got {self.affinity}"),
            (20 <= self.num_requests <= MAX_NUM_REQUESTS,
             f"num_requests must be in 20..{MAX_NUM_REQUESTS}, got {self.num_requests}"),
            (self.prefill_token_budget >= 1, "prefill token budget must be >= 1"),
            (self.prefill_max_batch >= 1, "prefill max batch must be >= 1"),
            (self.decode_max_batch >= 1, "decode max batch must be >= 1"),
            (self.colocated_mixed_tokens >= 0, "colocated mixed-step tokens must be >= 0"),
            (self.page_size >= 1, "page size must be >= 1"),
            (math.isfinite(self.front_end_s_per_token) and 0 <= self.front_end_s_per_token <= MAX_FRONT_END_S_PER_TOKEN,
             f"front-end seconds per token must be in 0..{MAX_FRONT_END_S_PER_TOKEN:g}, got {self.front_end_s_per_token}"),
        ]
        for ok, message in checks:
            if not ok:
                raise PlannerError(message)
        try:
            check_burstiness(self.burstiness)
        except WorkloadError as exc:
            raise PlannerError(str(exc)) from None
        self._check_workload()

    def _check_workload(self) -> None:
        """A trace or JSONL file must fit the model: context length, images only for a
        multimodal model (the built-in workloads are drawn within the context). A
        conversational workload is refused: a turn waits for the previous answer and
        resends the history, which the simulator does not model."""
        if is_conversational(self.workload):
            raise PlannerError(
                f"workload {self.workload.name} is conversational (each turn is sent after the previous "
                "answer, with the whole history): the planner's open-loop simulator cannot replay it; "
                "plan with a single-turn workload (llava, chatbot, shared-prompt, caption-repeat) or "
                "measure it with mm-serve bench")
        if not isinstance(self.workload, JsonlWorkload):
            return
        name, ctx = self.shape.name, self.shape.max_context
        for r in self.workload.rows:
            if r.num_images and self.shape.vision is None:
                raise PlannerError(f"workload {self.workload.name}: a request has {r.num_images} "
                                   f"image(s) but {name} has no vision tower")
            if r.total_prompt_tokens + r.output_tokens > ctx:
                raise PlannerError(
                    f"workload {self.workload.name}: a request of {r.total_prompt_tokens} prompt + "
                    f"{r.output_tokens} output tokens exceeds {name}'s context of {ctx} tokens")

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node
