"""Run ``mm-serve serve`` as a real subprocess for end-to-end tests."""

from __future__ import annotations

import base64
import io
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import yaml
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def data_uri(image: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    mime = {"JPEG": "jpeg", "PNG": "png", "WEBP": "webp", "GIF": "gif", "BMP": "bmp"}[fmt]
    return f"data:image/{mime};base64," + base64.b64encode(buf.getvalue()).decode()


def worker_children(pid: int, role: str = "") -> list[int]:
    """Process ids of the worker processes whose parent is ``pid`` (``role``: of that role only), read
    from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and b"mm_serve.cluster.worker_main" in cmdline and f'"role":"{role}'.encode() in cmdline:
            found.append(int(entry.name))
    return found


class ServerProcess:
    """``mm-serve serve`` on a free port; waits for /health 200."""

    def __init__(self, model_dir: Path, *extra: str, log_dir: Path, auto_placement: bool = False) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"server-{self.port}.log"
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "mm_serve.cli.main", "serve", "--model", str(model_dir),
               "--port", str(self.port), "--served-model-name", "tiny", *extra]
        if not auto_placement:  # the placement the test was written for (the config's), not the planner's
            cmd.append("--no-auto-placement")
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout_s: float = 180.0) -> list[dict]:
        """Poll /health until 200; returns the bodies seen (warming ones first)."""
        seen = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited:\n{self.log.read_text()}")
            try:
                r = httpx.get(f"{self.url}/health", timeout=2)
                seen.append({"status_code": r.status_code, **r.json()})
                if r.status_code == 200:
                    return seen
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready:\n{self.log.read_text()}")

    def output(self) -> str:
        return self.log.read_text()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)


@contextmanager
def configured_server(model_dir: Path, config: dict, folder: Path) -> Iterator[ServerProcess]:
    """A ready server on ``model_dir`` with ``config`` (written to ``folder/config.yaml``), stopped after."""
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    proc = ServerProcess(model_dir, "--config", str(folder / "config.yaml"), log_dir=folder)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def chat_error(server: ServerProcess, body: dict, status: int = 400) -> dict:
    """POST ``body`` (with the model ``tiny`` and ``max_tokens`` 4 unless given) to ``server``'s chat
    completions; assert the answer's ``status``; return its OpenAI ``error`` object."""
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={"model": "tiny", "max_tokens": 4, **body})
    assert r.status_code == status, r.text
    return r.json()["error"]


def scrape_metrics(url: str) -> Samples:
    """Every sample of the server's ``/metrics``, parsed by prometheus-client: ``(name, sorted labels) -> value``."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def requests_counted(before: Samples, after: Samples) -> dict[tuple[str, str], float]:
    """``mm_serve_requests_total`` increments between two :func:`scrape_metrics`: ``(finish_reason,
    status_code) -> count``, the labels that grew only."""
    grown = {}
    for (name, labels), value in after.items():
        if name == "mm_serve_requests_total" and value > before.get((name, labels), 0.0):
            label = dict(labels)
            grown[(label["finish_reason"], label["status_code"])] = value - before.get((name, labels), 0.0)
    return grown
