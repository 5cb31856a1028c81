"""``mm-serve serve --dtype bfloat16``: the disaggregated service in bf16 answers transformers' bf16 tokens."""

from __future__ import annotations

from pathlib import Path

import httpx
import torch

from mm_serve.cli.main import build_parser
from mm_serve.cli.serve import _overrides
from mm_serve.config import load_config
from tests.api.server_process import ServerProcess
from tests.golden import reference_generate


def test_dtype_and_attention_backend_flags_set_their_keys() -> None:
    args = build_parser().parse_args(["serve", "--dtype", "bfloat16", "--attention-backend", "flex"])
    cfg = load_config(None, _overrides(args))
    assert (cfg.dtype, cfg.attention_backend) == ("bfloat16", "flex")
    assert load_config(None, _overrides(build_parser().parse_args(["serve"]))).dtype == "auto"


def test_serving_flex_on_a_cpu_is_refused(tiny_llava: Path) -> None:
    """Eager FlexAttention scores every page of the cache: the service refuses it on a CPU, before any worker starts."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "mm_serve.cli.main", "serve", "--model", str(tiny_llava),
                           "--attention-backend", "flex"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "attention_backend flex" in done.stderr and "Traceback" not in done.stderr


def test_served_in_bfloat16_equals_transformers_in_bfloat16(tiny_llava: Path, tmp_path: Path) -> None:
    from transformers import LlavaForConditionalGeneration

    from mm_serve.inputs.input_processor import InputProcessor
    from mm_serve.models.registry import load_model_config

    reference = LlavaForConditionalGeneration.from_pretrained(str(tiny_llava), dtype=torch.bfloat16).eval()
    inputs = InputProcessor(tiny_llava, load_model_config(tiny_llava))
    prompts = ["Serving a language model means", "The quick brown fox jumps over the lazy dog and"]
    proc = ServerProcess(tiny_llava, "--dtype", "bfloat16", log_dir=tmp_path)
    try:
        proc.wait_ready()
        for prompt in prompts:
            expected, _ = reference_generate(reference, inputs.process({"prompt": prompt}), 16)
            r = httpx.post(f"{proc.url}/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                "logprobs": 1})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert len(choice["logprobs"]["tokens"]) == 16
            assert choice["text"] == inputs.tokenizer.decode(expected, skip_special_tokens=True)
    finally:
        assert proc.stop() == 0
