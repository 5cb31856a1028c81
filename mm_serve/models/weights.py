"""Read checkpoint weights from safetensors and map them to our module names.

Accepted layouts: ``model.safetensors``, or shards listed in
``model.safetensors.index.json``. Accepted key spellings:

* llava-hf (transformers 4.x and what 5.x writes): ``language_model.model.*``,
  ``language_model.lm_head.*``, ``vision_tower.[vision_model.]*``,
  ``multi_modal_projector.*``;
* transformers 5.x in-memory names: ``model.language_model.*``, ``lm_head.*``,
  ``model.vision_tower.*``, ``model.multi_modal_projector.*``;
* plain Llama: ``model.*``, ``lm_head.*``;
* Qwen2-VL: ``model.*`` and ``lm_head.*`` (the decoder), ``visual.*`` / ``model.visual.*`` (the tower).

Every key becomes one of ``lm.<decoder key>`` (e.g. ``lm.layers.0.self_attn.q_proj.weight``,
``lm.lm_head.weight``), ``vision.<tower key>``, ``projector.<key>`` or ``newline.image_newline``
(LLaVA-NeXT).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from mm_serve.models.model_config import CheckpointError

PARTS = ("lm", "vision", "projector", "newline")  # the canonical parts of a checkpoint

# (prefix in the checkpoint, canonical prefix); the first match wins, so longer first.
_PREFIX_MAP: tuple[tuple[str, str], ...] = (
    ("model.image_newline", "newline.image_newline"),  # LLaVA-NeXT's row separator, [text hidden]
    ("image_newline", "newline.image_newline"),
    ("model.language_model.", "lm."),
    ("language_model.model.", "lm."),
    ("language_model.lm_head.", "lm.lm_head."),
    ("language_model.", "lm."),
    ("model.vision_tower.vision_model.", "vision."),
    ("model.vision_tower.", "vision."),
    ("vision_tower.vision_model.", "vision."),
    ("vision_tower.", "vision."),
    ("model.visual.", "vision."),  # Qwen2-VL: the tower, its merger included
    ("visual.", "vision."),
    ("model.multi_modal_projector.", "projector."),
    ("multi_modal_projector.", "projector."),
    ("lm_head.", "lm.lm_head."),
    ("model.", "lm."),
)


def canonical_name(key: str) -> str | None:
    """Map a checkpoint key to ``lm.*`` / ``vision.*`` / ``projector.*``; None if unknown."""
    for prefix, target in _PREFIX_MAP:
        if key.startswith(prefix):
            return target + key[len(prefix):]
    return None


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The weight files of a checkpoint, single-file or sharded.

    Raises:
        CheckpointError: no safetensors weights, or the index names a missing shard.
    """
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = [root / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names missing shards: {missing}")
        return files
    single = root / "model.safetensors"
    if single.is_file():
        return [single]
    shards = sorted(root.glob("*.safetensors"))
    if shards:
        return shards
    raise CheckpointError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


def iter_weights(model_dir: str | Path, parts: Collection[str] = PARTS) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(canonical_name, tensor)`` for every known weight of the checkpoint in ``parts``
    (the others are not read from disk).

    Keys that belong to no known part (e.g. rotary ``inv_freq`` buffers) are skipped.

    Raises:
        CheckpointError: no weights, a missing shard, or a file that is not readable safetensors (cut short,
            corrupt), naming the file.
    """
    for path in safetensors_files(model_dir):
        with _opened(path) as handle:
            for key in handle.keys():
                name = canonical_name(key)
                if name is None or name.endswith("rotary_emb.inv_freq") or name.partition(".")[0] not in parts:
                    continue
                yield name, handle.get_tensor(key)


@contextmanager
def _opened(path: Path) -> Iterator[Any]:
    """``safe_open`` of ``path``; what it or reading through it raises is a :class:`CheckpointError` naming the file.

    Raises:
        CheckpointError: not a readable safetensors file (cut short, corrupt).
    """
    try:
        with safe_open(str(path), framework="pt") as handle:
            yield handle
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file (cut short or corrupt?): {exc}") from None


def check_weight_files(model_dir: str | Path) -> None:
    """Read the header of every weight file of the checkpoint (milliseconds: no tensor is read), so that a
    checkpoint without weights, or with a file cut short, is refused before anything is built from it.

    Raises:
        CheckpointError: as :func:`iter_weights`.
    """
    for path in safetensors_files(model_dir):
        with _opened(path) as handle:
            handle.keys()


def load_state_dicts(model_dir: str | Path, parts: Collection[str] = PARTS) -> dict[str, dict[str, torch.Tensor]]:
    """The weights of ``parts`` grouped by part: ``{"lm": {...}, "vision": {...}, "projector": {...}}``
    (a part not asked for is empty)."""
    grouped: dict[str, dict[str, torch.Tensor]] = {part: {} for part in PARTS}
    for name, tensor in iter_weights(model_dir, parts):
        part, _, rest = name.partition(".")
        grouped[part][rest] = tensor
    return grouped
