"""Worker specs from the service config: cores and niceness per role (mm_serve.cluster.worker_specs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mm_serve.cluster.launcher import available_cpus
from mm_serve.cluster.worker_specs import (
    build_worker_specs,
    check_cores,
    check_supported,
    core_ranges,
)
from mm_serve.config import ConfigError, load_config


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


def test_a_rings_feature_rows_never_exceed_a_context(tmp_path: Path) -> None:
    """Image tokens are prompt tokens: with Qwen2-VL pixel bounds that allow 16,384 tokens an image (a
    released checkpoint's), a ring slot holds at most a context's worth of feature rows, not the images'
    bound times the image count (gigabytes of shared memory)."""
    import json

    from mm_serve.cluster.ring_sizing import ring_specs
    from mm_serve.config import ServiceConfig
    from mm_serve.models.registry import load_model_config
    from tests.factories import build_checkpoint

    model_dir = build_checkpoint("qwen2-vl", tmp_path / "qwen2-vl")
    prep = json.loads((model_dir / "preprocessor_config.json").read_text())
    prep["size"]["longest_edge"] = 28 * 28 * 16384
    (model_dir / "preprocessor_config.json").write_text(json.dumps(prep))
    model = load_model_config(model_dir)
    assert model.vision is not None and model.vision.max_image_tokens == 16384
    cfg = ServiceConfig()
    (spec,) = ring_specs("t", cfg, model)
    context = model.text.max_position_embeddings
    assert spec.feature_rows == context * min(cfg.scheduler.ring_buffer_size, 4)


def test_cores_this_process_may_not_run_on_are_an_error_naming_the_key() -> None:
    """A core outside the usable set would leave its worker unpinned (on every core), silently."""
    usable = [0, 1]
    check_cores(load_config(None, {"compute.prefill_cpus": [0], "compute.decode_cpus": [1]}), usable)
    check_cores(load_config(None, {}), usable)  # no cores given: the default halves of the usable ones
    with pytest.raises(ConfigError) as err:
        check_cores(load_config(None, {"compute.prefill_cpus": [99], "compute.decode_cpus": [1]}), usable)
    assert str(err.value) == "compute.prefill_cpus: core 99 is not one this process may run on (usable: 0-1)"
    with pytest.raises(ConfigError, match=r"^compute.decode_cpus: cores 2, 7 are not ones this process may run on "
                                          r"\(usable: 0-1,4,8-10\)$"):
        check_cores(load_config(None, {"compute.prefill_cpus": [0], "compute.decode_cpus": [2, 1, 7]}),
                    [0, 1, 4, 8, 9, 10])
    with pytest.raises(ConfigError, match="^compute.decode_cpus: core 5 "):
        check_cores(load_config(None, {"mode": "colocated", "compute.decode_cpus": [5]}), usable)
    # Ray workers pin cores of the nodes Ray places them on: this machine's cores say nothing of theirs
    check_cores(load_config(None, {"cluster.backend": "ray", "cluster.prefill_nodes": [1],
                                   "compute.prefill_cpus": [99], "compute.decode_cpus": [1]}), usable)
    # checked at start, not when a config is read (it may be planned for another machine)
    far = load_config(None, {"compute.prefill_cpus": [max(available_cpus()) + 1]})
    with pytest.raises(ConfigError, match=r"^compute.prefill_cpus: core \d+ is not one this process may run on"):
        check_supported(far)
    assert core_ranges([3, 0, 1, 2, 5]) == "0-3,5" and core_ranges([]) == "none"


def test_serve_refuses_a_core_this_process_may_not_run_on(tmp_path: Path) -> None:
    """`mm-serve serve` exits 2 with one line naming the key, before any worker starts."""
    usable = available_cpus()
    config = tmp_path / "c.yaml"
    config.write_text(f"compute: {{prefill_cpus: [{max(usable) + 1}], decode_cpus: [{usable[0]}]}}\n")
    done = subprocess.run([sys.executable, "-m", "mm_serve", "serve", "--config", str(config), "--port", "8337"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"mm-serve: error: compute.prefill_cpus: core {max(usable) + 1} is not one this process may run on "
        f"(usable: {core_ranges(usable)})"]
