"""Add the ``processor_config.json`` that transformers' ``LlavaProcessor`` needs to a llava-hf checkpoint.

Released llava-hf checkpoints (e.g. ``llava-hf/llava-1.5-7b-hf``) ship it; the
random-weight bench checkpoint from ``mm_serve.models.builder`` does not, and
``transformers serve`` then fails on an image request (``patch_size`` is None).
Our own server does not read this file. Usage::

    python benchmarks/peers/processor_config.py out/bench-llava
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def write_processor_config(model_dir: Path) -> Path:
    """Write ``model_dir/processor_config.json`` from its ``config.json``; returns the path."""
    config = json.loads((model_dir / "config.json").read_text())
    vision = config["vision_config"]
    processor = {
        "processor_class": "LlavaProcessor",
        "image_token": "<image>",
        "patch_size": vision["patch_size"],
        "vision_feature_select_strategy": config.get("vision_feature_select_strategy", "default"),
        "num_additional_image_tokens": 1,  # the CLS position of a CLIP tower
    }
    path = model_dir / "processor_config.json"
    path.write_text(json.dumps(processor, indent=2) + "\n")
    return path


if __name__ == "__main__":
    for arg in sys.argv[1:] or ["out/bench-llava"]:
        print(write_processor_config(Path(arg)))
