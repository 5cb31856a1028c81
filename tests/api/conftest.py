"""A real server process shared by the API tests of a module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.api.server_process import ServerProcess


@pytest.fixture(scope="session")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="package")  # stopped after this package: idle workers poll
def server(tiny_llava: Path, media_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(tiny_llava, "--allowed-local-media-path", str(media_dir),
                         log_dir=tmp_path_factory.mktemp("logs"))
    try:
        proc.health_seen = proc.wait_ready()  # type: ignore[attr-defined]
        yield proc
    finally:
        proc.stop()
