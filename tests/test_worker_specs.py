"""Worker specs from the service config: cores and niceness per role (mm_serve.cluster.worker_specs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mm_serve.cluster.worker_specs import build_worker_specs
from mm_serve.config import load_config


def _specs(tmp_path: Path, overrides: dict[str, Any]) -> list[tuple[str, int, list[int], int]]:
    cfg = load_config(None, overrides)
    n, m = cfg.compute.prefill_workers, cfg.compute.decode_workers
    rings: list[Any] = [object() for _ in range(n * m)]  # passed through untouched
    specs = build_worker_specs(tmp_path, cfg, None, rings, tmp_path, "ipc://out")  # type: ignore[arg-type]
    return [(s.role, s.index, s.cpus, s.nice) for s in specs]


def test_prefill_workers_may_yield_a_shared_core_to_decode(tmp_path: Path) -> None:
    placement = {"compute.prefill_workers": 2, "compute.decode_workers": 1,
                 "compute.prefill_cpus": [0, 1], "compute.decode_cpus": [1]}
    assert _specs(tmp_path, placement) == [("prefill", 0, [0], 5), ("prefill", 1, [1], 5), ("decode", 0, [1], 5)]
    lower = _specs(tmp_path, placement | {"compute.prefill_worker_nice": 12})
    # only the prefill worker on the decode worker's core yields; the one on core 0 has its own
    assert lower == [("prefill", 0, [0], 5), ("prefill", 1, [1], 12), ("decode", 0, [1], 5)]
    apart = _specs(tmp_path, {"compute.prefill_cpus": [0], "compute.decode_cpus": [1],
                              "compute.prefill_worker_nice": 12})
    assert apart == [("prefill", 0, [0], 5), ("decode", 0, [1], 5)]
    colocated = _specs(tmp_path, {"mode": "colocated", "compute.prefill_worker_nice": 12})
    assert [(role, nice) for role, _, _, nice in colocated] == [("colocated", 5)]  # not a prefill worker
