"""Fixtures of the caption-job tests: a folder of drawn scenes plus broken files, a shared engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from mm_serve.caption.engine_backend import EngineBackend
from mm_serve.config import config_from_dict
from tests.caption.scene_folder import NUM_SCENES, write_scene_folder


@pytest.fixture(scope="session")
def scene_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """60 scenes + 3 broken files (read-only for tests: copy it before changing anything)."""
    root = tmp_path_factory.mktemp("scenes")
    return root, write_scene_folder(root, NUM_SCENES)


@pytest.fixture(scope="package")  # stopped after this package: idle workers poll
def tiny_engine(tiny_llava: Path) -> Iterator[EngineBackend]:
    """An in-process engine on the random tiny checkpoint, 8 new tokens per caption."""
    config = config_from_dict({"model": str(tiny_llava)})
    backend = EngineBackend.start(tiny_llava, config, max_tokens=8, model_name="tiny")
    try:
        yield backend
    finally:
        backend.close()
