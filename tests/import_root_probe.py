"""The child side of tests/test_import_root.py, run in a fresh interpreter.

It imports mm_serve (our kernels included), transformers and Hugging Face's ``kernels`` in one
process, has transformers' hub-kernels integration bind to ``kernels``, then loads a checkpoint
through mm_serve and through transformers and decodes greedily with both. It prints one line,
``PROBE <json>``, holding what it found, for the test to check.

Usage: ``python -m tests.import_root_probe CHECKPOINT [EXTRA_SITE_DIR]``. ``EXTRA_SITE_DIR`` (a
``pip install --target`` folder) goes at the END of ``sys.path``, so that only what the venv lacks
comes from it.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
from pathlib import Path
from typing import Any

PROMPT = "USER: <image>\nWhat is in this picture? ASSISTANT:"
NEW_TOKENS = 8


def import_facts() -> dict[str, Any]:
    """Import ours, then transformers (its hub-kernels integration too), then ``kernels``; say where
    each came from.

    Returns: ``transformers`` (version), ``kernels_file`` (``kernels.__file__``, None for a
    namespace package), ``kernels_dist_file`` (where the installed ``kernels`` distribution puts its
    ``__init__.py``), ``kernels_available`` (transformers' own check), ``hub_binds_hf_kernels``
    (transformers' hub integration holds ``kernels.LayerRepository``), ``mm_serve_kernels_file``.
    Raises ImportError or PackageNotFoundError when any of them is missing.
    """
    names = ("mm_serve.kernels", "transformers", "transformers.integrations.hub_kernels",
             "transformers.utils.import_utils", "kernels")  # ours before transformers binds ``kernels``
    ours, transformers, hub_kernels, import_utils, kernels = [importlib.import_module(n) for n in names]
    dist = importlib.metadata.distribution("kernels")
    return {
        "transformers": transformers.__version__,
        "kernels_file": kernels.__file__,
        "kernels_dist_file": str(dist.locate_file("kernels/__init__.py")),
        "kernels_available": import_utils.is_kernels_available(),
        "hub_binds_hf_kernels": getattr(hub_kernels, "LayerRepository", None) is kernels.LayerRepository,
        "mm_serve_kernels_file": ours.__file__,
    }


def generate_both(checkpoint: Path) -> dict[str, list[int]]:
    """Greedy ``NEW_TOKENS`` token ids for one image prompt: ``ours`` (mm_serve's colocated LLM)
    and ``reference`` (transformers' LlavaForConditionalGeneration, float32)."""
    from mm_serve import LLM, SamplingParams
    from tests.factories import gradient_image
    from tests.golden import load_reference, reference_generate

    request = {"prompt": PROMPT, "images": [gradient_image(80, 60, 1)]}
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(model=checkpoint, mode="colocated", num_pages=64) as llm:
        assert llm.engine is not None  # the colocated mode runs its engine in this process
        inputs = llm.engine.inputs.process(request)
        ours = llm.generate(request, params)[0].token_ids
    expected, _ = reference_generate(load_reference(checkpoint, multimodal=True), inputs, NEW_TOKENS)
    return {"ours": list(ours), "reference": expected}


def main(argv: list[str]) -> int:
    """Print ``PROBE <json>`` with :func:`import_facts` and :func:`generate_both`; 0 on success."""
    if len(argv) > 1:
        sys.path.append(argv[1])
    facts = import_facts()
    facts.update(generate_both(Path(argv[0])))
    print("PROBE " + json.dumps(facts), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
