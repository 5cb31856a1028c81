"""CPU seconds per process and py-spy's collapsed stacks (mm_serve.bench.process_cpu)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from mm_serve.bench.process_cpu import (
    cpu_seconds,
    cpu_table,
    descendants,
    format_cpu_table,
    top_functions,
)

RAW = """\
<module> (serve.py:3);run (loop.py:10);step (engine.py:20);forward (llama.py:5) 60
<module> (serve.py:3);run (loop.py:10);step (engine.py:21);sample (sampler.py:7) 25
<module> (serve.py:3);run (loop.py:12);poll (poll.py:40) 15
not a stack line
"""


def test_top_functions_gives_self_and_inclusive_shares_per_function() -> None:
    total, rows = top_functions(RAW, n=3)
    assert total == 100
    assert [(r.function, r.self_share, r.inclusive_share) for r in rows] == [
        ("forward (llama.py)", 0.60, 0.60),
        ("sample (sampler.py)", 0.25, 0.25),
        ("poll (poll.py)", 0.15, 0.15),
    ]
    _, everything = top_functions(RAW + "<module> (serve.py:3);step (engine.py:30) 100\n", n=10)
    step = next(r for r in everything if r.function == "step (engine.py)")
    assert step.self_share == 0.5 and step.inclusive_share == 0.5 + 0.85 / 2  # both lines of step count once
    assert top_functions("") == (0, [])


def test_cpu_table_per_token_and_shares() -> None:
    rows = cpu_table({"api": 1.0, "decode0": 10.0, "client": 0.0}, {"api": 3.0, "decode0": 16.0, "client": 2.0},
                     tokens=4000, measuring=frozenset({"client"}))
    assert [(r.name, r.cpu_s) for r in rows] == [
        ("decode0", 6.0), ("api", 2.0), ("client", 2.0), ("server total", 8.0), ("total", 10.0)]
    assert rows[0].ms_per_token == pytest.approx(1.5) and rows[0].share == pytest.approx(0.6)
    assert rows[-2].ms_per_token == pytest.approx(2.0) and rows[-2].share == pytest.approx(0.8)
    assert rows[-1].ms_per_token == pytest.approx(2.5) and rows[-1].share == 1.0
    with pytest.raises(ValueError, match="decode0 exited during the run"):
        cpu_table({"api": 1.0, "decode0": 2.0}, {"api": 2.0}, tokens=10)
    text = format_cpu_table(rows, wall_s=5.0)
    assert "decode0" in text.splitlines()[1] and text.splitlines()[1].endswith("1.20")  # 6 CPU s over 5 s
    with pytest.raises(ValueError, match="no output tokens"):
        cpu_table({}, {"api": 1.0}, tokens=0)


def test_cpu_seconds_reads_real_processes_and_descendants() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        deadline = time.monotonic() + 10
        while child.pid not in descendants(os.getpid()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "time.sleep(30)" in descendants(os.getpid())[child.pid]
        before = cpu_seconds({"me": os.getpid()})["me"]
        end = time.process_time() + 0.3
        while time.process_time() < end:
            pass
        assert cpu_seconds({"me": os.getpid()})["me"] - before >= 0.25
    finally:
        child.kill()
        child.wait()
    assert cpu_seconds({"gone": child.pid}) == {}
