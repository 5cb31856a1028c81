"""SIGKILL the job part-way, re-run it: every input appears exactly once.

The killed job is ``mm-serve caption`` with its in-process engine, in a process
group of its own (the job and its worker processes all get SIGKILL). The re-run
goes through the same resume path on the shared engine, which saves starting a
second engine; the command-line re-run is covered by ``test_server_job.py``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from mm_serve.caption.engine_backend import EngineBackend
from mm_serve.caption.output import OutputFile
from tests.caption.local_job import run_job
from tests.caption.scene_folder import BROKEN

_SEGMENT = re.compile(r"/dev/shm/(mmsrv-([0-9a-f]{12})-\S+)")


def _line_count(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def _segments_of(pid: int) -> set[tuple[str, str]]:
    """(shm name, engine instance) of every ring segment ``pid`` maps."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return set()
    return {(m[1], m[2]) for m in _SEGMENT.finditer(maps)}


def _clean_up_after_kill(segments: set[tuple[str, str]]) -> None:
    """Remove what a SIGKILLed engine could not: its shm segments and its run folder."""
    for name, instance in segments:
        Path("/dev/shm", name).unlink(missing_ok=True)
        for run_dir in Path(tempfile.gettempdir()).glob(f"mmsrv-{instance}-*"):
            shutil.rmtree(run_dir, ignore_errors=True)


def test_sigkill_then_rerun_gives_every_input_exactly_once(
    scene_folder: tuple[Path, dict[str, str]], tiny_llava: Path, tiny_engine: EngineBackend, tmp_path: Path,
) -> None:
    root, truth = scene_folder
    out = tmp_path / "out.jsonl"
    command = [sys.executable, "-m", "mm_serve.cli.main", "caption", str(root), "--out", str(out),
               "--model", str(tiny_llava), "--max-tokens", "48", "--concurrency", "1", "--no-progress"]
    log = (tmp_path / "first.log").open("wb")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, HF_HUB_OFFLINE="1"),
                            start_new_session=True)
    segments: set[tuple[str, str]] = set()
    try:
        deadline = time.monotonic() + 180
        while _line_count(out) < 5 and proc.poll() is None and time.monotonic() < deadline:
            segments |= _segments_of(proc.pid)
            time.sleep(0.02)
        segments |= _segments_of(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)  # the job and its worker processes, mid-write or not
        proc.wait(30)
    finally:
        log.close()
        _clean_up_after_kill(segments)
    done_at_kill = _line_count(out)
    assert 5 <= done_at_kill < len(truth) + len(BROKEN), (tmp_path / "first.log").read_text()
    with out.open("ab") as handle:  # a torn write, as a kill during write() would leave
        handle.write(b'{"id": "odd/scene001.bmp", "path": "/x", "capt')

    writer, resume = OutputFile.open(out, "folder")
    writer.close()
    assert resume.repaired_tail and len(resume.done) == done_at_kill
    stats = run_job(tiny_engine, root, out, concurrency=64)
    assert stats.skipped == done_at_kill and stats.finished == len(truth) + len(BROKEN) - done_at_kill
    rows = [json.loads(line) for line in out.read_text().splitlines()]  # every line is valid JSON
    counts = Counter(row["id"] for row in rows)
    assert set(counts) == {*truth, *BROKEN} and set(counts.values()) == {1}
