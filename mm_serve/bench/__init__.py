"""Benchmark workloads shared by ``mm-serve bench`` and the placement planner."""

from mm_serve.bench.workloads import (
    BUILTIN_WORKLOADS,
    CaptionWorkload,
    ChatbotWorkload,
    JsonlWorkload,
    LlavaWorkload,
    RequestSpec,
    Workload,
    WorkloadError,
    gamma_arrivals,
    load_jsonl_workload,
    make_workload,
    poisson_arrivals,
    trace_arrivals,
    unit_rate_arrivals,
)

__all__ = [
    "BUILTIN_WORKLOADS",
    "CaptionWorkload",
    "ChatbotWorkload",
    "JsonlWorkload",
    "LlavaWorkload",
    "RequestSpec",
    "Workload",
    "WorkloadError",
    "gamma_arrivals",
    "load_jsonl_workload",
    "make_workload",
    "poisson_arrivals",
    "trace_arrivals",
    "unit_rate_arrivals",
]
