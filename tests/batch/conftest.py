"""One embedded-model server with the Batch API on a temporary data directory, behind two API keys
(tenants, whose caches are salted apart: ``api.cache_salt_by_api_key``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from mm_serve.models.named_models import EMBEDDED_MODEL_DIR
from tests.api.server_process import ServerProcess
from tests.batch.helpers import write_config

API_KEY = "sk-batch-test"
OTHER_KEY = "sk-batch-other-tenant"
MAX_FILE_BYTES = 512 << 10
MAX_TOTAL_BYTES = 2 << 20


@pytest.fixture(scope="package")
def batch_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    if not (EMBEDDED_MODEL_DIR / "model.safetensors").is_file():
        pytest.skip("the embedded checkpoint is not in this checkout")
    root = tmp_path_factory.mktemp("batch-server")
    config = write_config(root / "config.yaml", root / "data", max_file_bytes=MAX_FILE_BYTES,
                          max_total_bytes=MAX_TOTAL_BYTES)
    proc = ServerProcess(Path(EMBEDDED_MODEL_DIR), "--config", str(config), "--api-key", API_KEY, "--api-key", OTHER_KEY,
                         "--cache-salt-by-api-key", log_dir=root)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def client(batch_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{batch_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture
def other_client(batch_server: ServerProcess) -> openai.OpenAI:
    """A client with the server's second key: another tenant."""
    return openai.OpenAI(base_url=f"{batch_server.url}/v1", api_key=OTHER_KEY, max_retries=0, timeout=60)
