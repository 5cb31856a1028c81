"""Resolve a model argument: a checkpoint directory, or a name the project ships (``embedded``)."""

from __future__ import annotations

from pathlib import Path

from mm_serve.models.model_config import CheckpointError

EMBEDDED_MODEL_DIR = Path(__file__).resolve().parent / "embedded"
NAMED_MODELS: dict[str, Path] = {"embedded": EMBEDDED_MODEL_DIR}
DEFAULT_MODEL = "embedded"


def resolve_model(model: str | Path | None) -> Path:
    """The checkpoint directory for ``model`` (None means :data:`DEFAULT_MODEL`).

    Raises:
        CheckpointError: not a registered name and not a directory with a config.json.
    """
    name = str(model) if model is not None else DEFAULT_MODEL
    path = NAMED_MODELS.get(name, Path(name).expanduser())
    if not (path / "config.json").is_file():
        known = ", ".join(sorted(NAMED_MODELS))
        raise CheckpointError(
            f"model {name!r} is neither a registered name ({known}) nor a directory with a config.json"
        )
    return path
