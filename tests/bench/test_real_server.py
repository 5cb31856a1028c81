"""The benchmark client against a real ``mm-serve serve`` process (tiny llava, disaggregated)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mm_serve.bench.client import Endpoint
from mm_serve.bench.launch import LaunchError, LocalServer
from mm_serve.bench.requests import RequestFactory
from mm_serve.bench.runner import LoadRunner, LoadSpec
from mm_serve.bench.session import default_slo
from mm_serve.models.registry import load_model_config
from mm_serve.workloads import LlavaWorkload


def test_llava_workload_at_a_low_rate(tiny_llava: Path, tmp_path: Path) -> None:
    vision = load_model_config(tiny_llava).vision
    assert vision is not None
    load = LoadSpec(LlavaWorkload(vision.num_image_tokens), seed=1, duration_s=3.0, min_requests=6)
    with LocalServer(tmp_path / "server.log", model=str(tiny_llava)) as server:
        factory = RequestFactory("bench", tokenizer_dir=tiny_llava, image_size=vision.image_size)
        # no early stop: one late request on a busy machine would end the run and cancel the rest
        runner = LoadRunner(Endpoint(server.url), factory, load, slo=None, target=0.9, early_stop=False)
        unloaded = runner.unloaded(num_requests=2)
        runner.slo = default_slo(unloaded)
        run = runner.run_at(2.0)
    assert factory.exact_lengths
    assert unloaded.num_ok == 2 and 0 < unloaded.ttft.p50 < 5.0
    assert run.num_requests == 6 and run.num_ok == 6, (run.errors, run)
    assert 0 < run.ttft.p50 <= run.ttft.p99 < 10.0
    assert 0 < run.tpot.p50 < 1.0 and run.itl.count > 0
    specs = load.workload.sample(6, seed=1)
    assert run.mean_output_tokens == sum(s.output_tokens for s in specs) / 6  # ignore_eos honoured
    text_and_image = sum(s.total_prompt_tokens for s in specs) / 6
    assert text_and_image < run.mean_prompt_tokens < text_and_image + 24  # plus the chat template
    assert 0 < run.attainment <= 1 and run.request_throughput > 0


def test_extra_server_arguments_reach_the_command(tmp_path: Path) -> None:
    server = LocalServer(tmp_path / "server.log", model="embedded", mode="colocated", extra_args=("--no-admission",))
    assert server._cmd[-3:] == ["--mode", "colocated", "--no-admission"] and server.pid is None


def test_a_server_that_cannot_start_raises(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("mode: sideways\n")
    with pytest.raises(LaunchError, match="mode"):
        LocalServer(tmp_path / "server.log", config=str(bad)).start(timeout_s=60)


def test_a_benchmark_stopped_with_sigterm_stops_its_server(tiny_llava: Path, tmp_path: Path) -> None:
    """``kill`` of a benchmark script must not leave its ``mm-serve serve`` running, orphaned."""
    script = (f"import time\nfrom pathlib import Path\nfrom mm_serve.bench.launch import LocalServer\n"
              f"with LocalServer(Path({str(tmp_path / 'server.log')!r}), model={str(tiny_llava)!r}) as s:\n"
              f"    print(s._proc.pid, flush=True)\n    time.sleep(600)\n")
    bench = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert bench.stdout is not None
        server_pid = int(bench.stdout.readline())
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _alive(server_pid):
            time.sleep(0.2)
        assert not _alive(server_pid), "the server outlived its benchmark"
    finally:
        bench.kill()
        bench.wait()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped) counts as gone
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"
