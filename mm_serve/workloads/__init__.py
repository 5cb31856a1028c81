"""Workloads: what the load generator (``mm-serve bench``) sends and the planner simulates.

A workload draws seeded :class:`RequestSpec` rows (lengths in tokens, images, and what
the requests share); an arrival process draws their send times in seconds. Both depend
only on the standard library, so :mod:`mm_serve.bench` and :mod:`mm_serve.planner`
replay exactly the same requests from one definition.

Modules: :mod:`~mm_serve.workloads.spec` (the request shape and the workload protocol),
:mod:`~mm_serve.workloads.builtin` (the built-in samplers and :func:`make_workload`),
:mod:`~mm_serve.workloads.shared_content` (workloads that repeat content, for the KV and
encoder caches), :mod:`~mm_serve.workloads.jsonl` (workload files, traces and
conversations), :mod:`~mm_serve.workloads.arrivals` (arrival processes).
"""

from mm_serve.workloads.arrivals import (
    MAX_BURSTINESS,
    MIN_BURSTINESS,
    check_burstiness,
    gamma_arrivals,
    poisson_arrivals,
    trace_arrivals,
    unit_rate_arrivals,
)
from mm_serve.workloads.builtin import (
    BUILTIN_WORKLOADS,
    IMAGE_WORKLOADS,
    VIDEO_WORKLOADS,
    CaptionWorkload,
    ChatbotWorkload,
    CodeWorkload,
    LlavaWorkload,
    LogNormalLength,
    LongMultimodalWorkload,
    SummarizationWorkload,
    TextWorkload,
    make_workload,
)
from mm_serve.workloads.jsonl import JsonlWorkload, load_jsonl_workload
from mm_serve.workloads.shared_content import (
    CaptionRepeatWorkload,
    MultiturnLlavaWorkload,
    SharedPromptWorkload,
)
from mm_serve.workloads.spec import RequestSpec, Workload, WorkloadError, is_conversational

__all__ = [
    "BUILTIN_WORKLOADS",
    "IMAGE_WORKLOADS",
    "VIDEO_WORKLOADS",
    "MAX_BURSTINESS",
    "MIN_BURSTINESS",
    "CaptionRepeatWorkload",
    "CaptionWorkload",
    "ChatbotWorkload",
    "CodeWorkload",
    "JsonlWorkload",
    "LlavaWorkload",
    "LogNormalLength",
    "LongMultimodalWorkload",
    "MultiturnLlavaWorkload",
    "RequestSpec",
    "SharedPromptWorkload",
    "SummarizationWorkload",
    "TextWorkload",
    "Workload",
    "WorkloadError",
    "check_burstiness",
    "gamma_arrivals",
    "is_conversational",
    "load_jsonl_workload",
    "make_workload",
    "poisson_arrivals",
    "trace_arrivals",
    "unit_rate_arrivals",
]
