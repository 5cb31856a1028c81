"""``mm-serve caption --server`` against a real ``mm-serve serve`` process (one small case each)."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from mm_serve.caption.engine_backend import EngineBackend
from mm_serve.cli.main import main
from tests.api.server_process import ServerProcess
from tests.caption.local_job import run_job
from tests.caption.scene_folder import BROKEN, write_scene_folder


@pytest.fixture(scope="module")
def server(tiny_llava: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(tiny_llava, log_dir=tmp_path_factory.mktemp("caption_server_logs"))
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_folder_via_server_matches_the_in_process_engine(
    server: ServerProcess, tiny_engine: EngineBackend, tmp_path: Path,
) -> None:
    root = tmp_path / "in"
    write_scene_folder(root, 3)
    local = tmp_path / "local.jsonl"
    run_job(tiny_engine, root, local)
    remote = tmp_path / "remote.jsonl"
    code = main(["caption", str(root), "--out", str(remote), "--server", server.url, "--max-tokens", "8",
                 "--in-order", "--no-progress"])
    assert code == 0
    rows = _rows(remote)
    assert [r["id"] for r in rows] == sorted(r["id"] for r in rows)  # --in-order
    strip = [{k: v for k, v in r.items() if k != "latency_s"} for r in rows]
    expected = [{k: v for k, v in r.items() if k != "latency_s"} for r in _rows(local)]
    assert sorted(strip, key=lambda r: r["id"]) == sorted(expected, key=lambda r: r["id"])
    assert sum("error" in r for r in rows) == len(BROKEN)


def test_wrong_model_name_stops_the_job(
    server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    root = tmp_path / "in"
    write_scene_folder(root, 2)
    out = tmp_path / "out.jsonl"
    code = main(["caption", str(root), "--out", str(out), "--server", server.url, "--served-model", "nope",
                 "--no-progress"])
    assert code == 1
    printed = capsys.readouterr().out
    assert "stopped: " in printed and "answered 404" in printed
    assert {r["id"] for r in _rows(out)} <= set(BROKEN)  # only local image errors; the scenes are left to a re-run


def test_openai_batch_round_trip_via_server(server: ServerProcess, tmp_path: Path) -> None:
    png = tmp_path / "in"
    write_scene_folder(png, 1)
    uri = "data:image/png;base64," + base64.b64encode((png / "even/scene000.png").read_bytes()).decode()
    rows = [
        {"custom_id": f"req-{k}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [
             {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe the image."}]}]}}
        for k, url in enumerate([uri, "data:image/png;base64,AAAA", uri])
    ]
    # a row asking for a stream is answered whole, as the server's Batch API and the in-process job do
    # (it was an error row: the server's event stream is not one JSON body)
    rows[2]["body"].update(stream=True, stream_options={"include_usage": True})
    source = tmp_path / "batch.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    assert main(["caption", str(source), "--out", str(out), "--server", server.url, "--no-progress"]) == 0
    got = {r["custom_id"]: r for r in _rows(out)}
    assert sorted(got) == ["req-0", "req-1", "req-2"]
    for key in ("req-0", "req-2"):
        assert got[key]["error"] is None and got[key]["response"]["status_code"] == 200
        assert got[key]["response"]["body"]["object"] == "chat.completion"
    assert got["req-1"]["response"]["status_code"] == 400 and got["req-1"]["error"]["code"] == "invalid_image"
    # Resume: nothing left but the error row, which --retry-errors re-sends; it fails the same way, and a run
    # whose every input failed exits 1
    assert main(["caption", str(source), "--out", str(out), "--server", server.url, "--no-progress",
                 "--retry-errors"]) == 1
    again = _rows(out)
    assert sorted(r["custom_id"] for r in again) == ["req-0", "req-1", "req-2"]


def test_ctrl_c_writes_finished_rows_and_exits_130(
    server: ServerProcess, scene_folder: tuple[Path, dict[str, str]], tmp_path: Path,
) -> None:
    root, truth = scene_folder
    out = tmp_path / "out.jsonl"
    command = [sys.executable, "-m", "mm_serve.cli.main", "caption", str(root), "--out", str(out),
               "--server", server.url, "--max-tokens", "64", "--no-progress"]
    proc = subprocess.Popen([*command, "--concurrency", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    deadline = time.monotonic() + 120
    while (not out.exists() or out.read_text().count("\n") < 3) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "interrupted" in stdout
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert 3 <= len(written) < len(truth) + len(BROKEN)
    finish = subprocess.run([*command, "--concurrency", "16"], capture_output=True, text=True, timeout=120)
    assert finish.returncode == 0, finish.stderr
    counts = Counter(json.loads(line)["id"] for line in out.read_text().splitlines())
    assert set(counts) == {*truth, *BROKEN} and set(counts.values()) == {1}
