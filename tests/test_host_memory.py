"""The start's check that the workers' KV caches fit this machine's memory: exact sizes for the tiny
checkpoint, refused past the usable share, and what a GPU worker does not count."""

from __future__ import annotations

from pathlib import Path

import pytest

from mm_serve.cluster.host_memory import (
    USABLE_SHARE,
    available_bytes,
    check_host_memory,
    host_kv_bytes,
    total_bytes,
)
from mm_serve.cluster.ring_sizing import ring_specs
from mm_serve.cluster.worker_state import WorkerStartError
from mm_serve.config import config_from_dict
from mm_serve.models.registry import load_model_config


def test_kv_bytes_count_the_cpu_workers_pools_and_the_rings(tiny_llava: Path) -> None:
    model = load_model_config(tiny_llava)
    text = model.text
    page = text.num_layers * 2 * 16 * text.num_kv_heads * text.head_dim * 4  # float32, 16-token pages
    cfg = config_from_dict({"compute": {"prefill_workers": 2, "decode_workers": 1}, "kv_cache": {"max_pages_per_gpu": 2000}})
    rings = ring_specs("t", cfg, model)
    workers, pool, ring = host_kv_bytes(cfg, model, rings)
    assert (workers, pool, len(rings)) == (3, 2000 * page, 2)
    assert ring == 2 * rings[0].num_pages * page and rings[0].num_pages == 500  # a quarter of a worker's pages
    colocated = config_from_dict({"mode": "colocated", "kv_cache": {"max_pages_per_gpu": 1000}})
    assert host_kv_bytes(colocated, model, []) == (1, 1000 * page, 0)
    on_gpus = config_from_dict({"compute": {"decode_gpus": [0]}, "kv_cache": {"max_pages_per_gpu": 1000}})
    assert host_kv_bytes(on_gpus, model, [])[0] == 1  # the prefill worker's pool only


def test_a_pool_past_the_usable_share_of_memory_is_refused_naming_the_key(tiny_llava: Path) -> None:
    model = load_model_config(tiny_llava)
    cfg = config_from_dict({"mode": "colocated", "kv_cache": {"max_pages_per_gpu": 1 << 20}})
    _, pool, _ = host_kv_bytes(cfg, model, [])
    check_host_memory(cfg, model, [], available=int(pool / USABLE_SHARE) + 1)  # fits
    with pytest.raises(WorkerStartError) as info:
        check_host_memory(cfg, model, [], available=int(pool / USABLE_SHARE) - 1024)
    message = str(info.value)
    assert "1 CPU worker(s)" in message and "kv_cache.max_pages_per_gpu = 1048576 pages" in message
    assert message.endswith("lower kv_cache.max_pages_per_gpu (and kv_cache.ring_pages)")


def test_available_and_total_memory_are_read_from_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:         1000 kB\nMemAvailable:   20000000 kB\n")
    assert available_bytes(meminfo) == 20_000_000 * 1024
    assert total_bytes(meminfo) == 24_000_000 * 1024
    assert total_bytes(tmp_path / "missing") is None
    assert available_bytes(tmp_path / "missing") is None
    real = available_bytes()
    assert real is None or real > 0


def test_serve_refuses_such_a_pool_in_one_line_with_exit_status_2(tiny_llava: Path, tmp_path: Path) -> None:
    """The documented maximum of kv_cache.max_pages_per_gpu on this machine: a usage error before any
    worker allocates, not a worker OOM-killed with an empty log."""
    import os
    import subprocess
    import sys

    config = tmp_path / "huge.yaml"
    config.write_text("kv_cache:\n  max_pages_per_gpu: 16777216\n")
    done = subprocess.run([sys.executable, "-m", "mm_serve", "serve", "--model", str(tiny_llava), "--mode", "colocated",
                           "--port", "0", "--config", str(config)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MM_SERVE_PROFILE_DIR": str(tmp_path)})
    output = done.stdout + done.stderr
    assert done.returncode == 2 and "Traceback" not in output, output[-2000:]
    assert "mm-serve: error: the KV caches need" in output and "lower kv_cache.max_pages_per_gpu" in output
