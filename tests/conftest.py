"""Shared fixtures: small checkpoints built once per test session, offline."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import shutil  # noqa: E402
import tempfile  # noqa: E402

# torch's inductor (eager FlexAttention imports it, torch.compile writes there) makes a folder under
# /tmp unless told where: a folder of this session's, removed at its end.
_SESSION_DIR = tempfile.mkdtemp(prefix="mm-serve-tests-")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", _SESSION_DIR)
# machine profiles of servers that pick their placement (mm_serve.planner.auto_placement): this session's too
os.environ.setdefault("MM_SERVE_PROFILE_DIR", os.path.join(_SESSION_DIR, "profiles"))
# the Batch API's default data folder ($XDG_STATE_HOME/mm-serve/batches) of servers started without
# batch.data_dir: this session's, not the user's ~/.local/state
os.environ["XDG_STATE_HOME"] = os.path.join(_SESSION_DIR, "state")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from tests.factories import build_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llava-hf checkpoint: CLIP 56 px / patch 14 (16 image tokens), Llama 2 layers, GQA 4/2."""
    return build_checkpoint("llava", tmp_path_factory.mktemp("tiny_llava"))


@pytest.fixture(scope="session")
def tiny_llava_multilayer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llava-hf checkpoint with vision_feature_layer [-3, -1], strategy 'full', no center crop, tied embeddings."""
    return build_checkpoint("llava-multilayer", tmp_path_factory.mktemp("tiny_llava_ml"))


@pytest.fixture(scope="session")
def tiny_llava_sp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llava-hf checkpoint as tiny_llava, with a SentencePiece-style tokenizer that adds BOS and a
    chat template that does not emit it (llava-1.5-hf's arrangement)."""
    return build_checkpoint("llava-sp", tmp_path_factory.mktemp("tiny_llava_sp"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Text-only Llama checkpoint, 3 layers, GQA 4/1, llama3 RoPE scaling."""
    return build_checkpoint("llama", tmp_path_factory.mktemp("tiny_llama"))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(_SESSION_DIR, ignore_errors=True)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print the figures tests record with ``record_property("figure", text)`` (e.g. the
    planner's disaggregated / colocated ratio), so that ``make test`` shows them."""
    lines = [str(value) for report in terminalreporter.stats.get("passed", [])
             for key, value in report.user_properties if key == "figure"]
    if lines:
        terminalreporter.section("figures")
        for line in lines:
            terminalreporter.write_line(line)
