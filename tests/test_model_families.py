"""Model families beyond LLaVA-1.5: a SigLIP tower, a Qwen2 decoder (with a tower, and text-only),
FastVLM (a timm tower, FastViTHD, built by timm and read at its last feature map), against transformers' own classes and processors, token for token (greedy, float32, CPU); and the
registry's refusal of an architecture it does not serve."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from mm_serve import LLM, SamplingParams
from mm_serve.models.model_config import CheckpointError
from mm_serve.models.registry import load_model_config
from tests.factories import build_checkpoint, gradient_image
from tests.golden import assert_matches_reference, reference_generate

NEW_TOKENS = 16
LOGITS_RTOL = 1e-4
Q = "USER: <image>\nWhat is in this picture? ASSISTANT:"
Q2 = "USER: <image>\nCompare this <image>\nwith the first one. ASSISTANT:"
TEXT = {"prompt": "Serving a language model means"}
ONE_IMAGE = {"prompt": Q, "images": [gradient_image(80, 60, 1)]}
TWO_IMAGES = {"prompt": Q2, "images": [gradient_image(30, 200, 2), gradient_image(300, 40, 3)]}  # tall, wide
TINY_IMAGE = {"prompt": Q, "images": [gradient_image(3, 5, 4)]}
MULTIMODAL_KINDS = ["llava-siglip", "llava-qwen2", "fast-vlm"]
REFERENCE = {"qwen2": "AutoModelForCausalLM", "fast-vlm": "FastVlmForConditionalGeneration"}


@pytest.fixture(scope="module", params=[*MULTIMODAL_KINDS, "qwen2"])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    return request.param, build_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def _reference(kind: str, model_dir: Path) -> torch.nn.Module:
    import transformers

    cls = getattr(transformers, REFERENCE.get(kind, "LlavaForConditionalGeneration"))
    return cls.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def _greedy() -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def test_each_family_matches_transformers_token_for_token(family: tuple[str, Path]) -> None:
    kind, model_dir = family
    llm = LLM(model=model_dir, mode="colocated", num_pages=256, page_size=16)
    reference = _reference(kind, model_dir)
    cases = [TEXT] if kind == "qwen2" else [TEXT, ONE_IMAGE, TWO_IMAGES, TINY_IMAGE]
    assert llm.engine is not None
    for request in cases:
        out = assert_matches_reference(llm, reference, request, NEW_TOKENS, logits_rtol=LOGITS_RTOL)
        assert len(out.token_ids) == NEW_TOKENS


@pytest.mark.parametrize("kind", MULTIMODAL_KINDS)
def test_prompt_ids_and_pixels_equal_the_transformers_processor(kind: str, tmp_path: Path) -> None:
    """transformers' ``LlavaProcessor`` (from the checkpoint's own processor files, the Pillow image
    backend our preprocessing follows) makes the same prompt ids, image-token count included (SigLIP
    has no class token: one position fewer than CLIP), and the same pixels (SigLIP's square resize
    without a crop)."""
    from transformers import AutoImageProcessor, AutoProcessor

    model_dir = build_checkpoint(kind, tmp_path / kind)
    image_processor = AutoImageProcessor.from_pretrained(str(model_dir), backend="pil")
    processor = AutoProcessor.from_pretrained(str(model_dir), image_processor=image_processor)
    llm = LLM(model=model_dir, mode="colocated", num_pages=64, page_size=16)
    assert llm.engine is not None
    for request in (ONE_IMAGE, TWO_IMAGES):
        ours = llm.engine.inputs.process(request)
        theirs = processor(text=request["prompt"], images=request["images"], return_tensors="pt")
        assert ours.prompt_token_ids == theirs["input_ids"][0].tolist()
        assert ours.pixel_values is not None
        # equal, but for a rare pixel a uint8 level or two off where a tall image's resize is cut to the
        # band the crop keeps (mm_serve.media.image_processor: Pillow's box arithmetic)
        level = 1 / 255 / min(image_processor.image_std)
        diff = (ours.pixel_values - theirs["pixel_values"]).abs()
        assert float(diff.max()) <= 2 * level + 1e-5 and float((diff > 1e-5).float().mean()) < 1e-4
    vision = load_model_config(model_dir).vision
    assert vision is not None and vision.num_image_tokens == (15 if kind == "llava-siglip" else 16)


@pytest.mark.parametrize("kind", ["llava-qwen2", "fast-vlm"])
def test_a_qwen2_llava_matches_transformers_disaggregated(kind: str, tmp_path: Path) -> None:
    """Prefill and decode in separate workers, the KV handed over: the same greedy tokens."""
    model_dir = build_checkpoint(kind, tmp_path / kind)
    reference = _reference(kind, model_dir)
    colocated = LLM(model=model_dir, mode="colocated", num_pages=64, page_size=16)
    assert colocated.engine is not None
    expected = [reference_generate(reference, colocated.engine.inputs.process(r), NEW_TOKENS)[0]
                for r in (TEXT, ONE_IMAGE, TWO_IMAGES)]
    with LLM(model=model_dir, mode="disaggregated", num_pages=256) as llm:
        outputs = llm.generate([TEXT, ONE_IMAGE, TWO_IMAGES], _greedy())
    assert [o.token_ids for o in outputs] == expected


def test_an_unsupported_architecture_is_refused_naming_those_supported(tiny_llama: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "gpt2"
    shutil.copytree(tiny_llama, model_dir)
    config: dict[str, Any] = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(CheckpointError, match=r"architecture 'GPT2LMHeadModel' is not supported; supported "
                                              r"architectures: LlavaForConditionalGeneration, "
                                              r"LlavaNextForConditionalGeneration, "
                                              r"LlavaOnevisionForConditionalGeneration, "
                                              r"FastVlmForConditionalGeneration, Qwen2VLForConditionalGeneration, "
                                              r"Qwen2_5_VLForConditionalGeneration, LlamaForCausalLM, "
                                              r"MistralForCausalLM, Qwen2ForCausalLM"):
        load_model_config(model_dir)


@pytest.mark.parametrize(("key", "value"), [("num_hidden_layers", -1), ("hidden_size", 0), ("vocab_size", "512"),
                                            ("num_key_value_heads", 2.5), ("intermediate_size", True)])
def test_a_size_that_is_not_a_positive_integer_is_named(tiny_llama: Path, tmp_path: Path, key: str,
                                                        value: object) -> None:
    """A size in config.json that no model can have is refused naming it (``num_hidden_layers: -1`` was
    blamed on the weights, as "unexpected weights")."""
    model_dir = tmp_path / "bad-size"
    shutil.copytree(tiny_llama, model_dir)
    config: dict[str, Any] = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(CheckpointError, match=re.escape(f"config.json {key} must be a positive integer, got {value!r}")):
        load_model_config(model_dir)


def test_a_sliding_window_caps_the_served_context(tiny_llama: Path, tmp_path: Path) -> None:
    """Our layers attend to the whole context, which equals sliding-window attention while the context
    fits the window: a decoder with one is served up to the window."""
    model_dir = tmp_path / "windowed"
    shutil.copytree(tiny_llama, model_dir)
    config: dict[str, Any] = json.loads((model_dir / "config.json").read_text())
    windowed = {**config, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": True,
                "sliding_window": 256, "max_window_layers": 0}
    (model_dir / "config.json").write_text(json.dumps(windowed))
    assert load_model_config(model_dir).text.max_position_embeddings == 256
    (model_dir / "config.json").write_text(json.dumps({**windowed, "use_sliding_window": False}))
    assert load_model_config(model_dir).text.max_position_embeddings == config["max_position_embeddings"]


def test_a_fast_vlm_whose_token_count_does_not_fit_its_input_is_refused(tmp_path: Path) -> None:
    """FastVLM's image tokens (``image_seq_length``) must be a square grid dividing the crop size
    (the timm tower's input), and the crop size must be readable: each broken one is a clear error."""
    model_dir = build_checkpoint("fast-vlm", tmp_path / "fast-vlm")
    vision = load_model_config(model_dir).vision
    assert vision is not None and (vision.tower, vision.num_image_tokens, vision.patch_size) == ("timm_wrapper", 16, 64)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "image_seq_length": 15}))
    with pytest.raises(CheckpointError, match="image_seq_length 15 is not a square grid dividing the 256 px input"):
        load_model_config(model_dir)
    (model_dir / "config.json").write_text(json.dumps(config))
    (model_dir / "preprocessor_config.json").unlink()
    with pytest.raises(CheckpointError, match="no readable crop_size"):
        load_model_config(model_dir)


def test_a_mistral_decoder_matches_transformers(tmp_path: Path) -> None:
    """A Mistral decoder (what llava-v1.6-mistral runs; no sliding window, as Mistral 7B v0.2+): under a
    CLIP tower, and text only as ``MistralForCausalLM``. Token for token against transformers' classes."""
    import transformers

    model_dir = build_checkpoint("llava", tmp_path / "llava-mistral")
    config: dict[str, Any] = json.loads((model_dir / "config.json").read_text())
    config["text_config"] = {**config["text_config"], "model_type": "mistral", "architectures": ["MistralForCausalLM"],
                             "sliding_window": None}
    (model_dir / "config.json").write_text(json.dumps(config))
    reference = transformers.LlavaForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    assert type(reference.model.language_model).__name__ == "MistralModel"
    llm = LLM(model=model_dir, mode="colocated", num_pages=256, page_size=16)
    assert llm.engine is not None
    for request in [TEXT, ONE_IMAGE, TWO_IMAGES]:
        expected, _ = reference_generate(reference, llm.engine.inputs.process(request), NEW_TOKENS)
        assert llm.generate(request, _greedy())[0].token_ids == expected
    text_only = tmp_path / "mistral"
    text_only.mkdir()
    reference.model.language_model.config.tie_word_embeddings = False
    lm = transformers.MistralForCausalLM(reference.model.language_model.config)
    lm.model.load_state_dict(reference.model.language_model.state_dict())
    lm.lm_head.load_state_dict(reference.lm_head.state_dict())
    lm.save_pretrained(str(text_only))
    for name in model_dir.iterdir():
        if name.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(name, text_only / name.name)
    assert load_model_config(text_only).vision is None
    llm = LLM(model=text_only, mode="colocated", num_pages=256, page_size=16)
    assert llm.engine is not None
    expected, _ = reference_generate(lm.eval(), llm.engine.inputs.process(TEXT), NEW_TOKENS)
    assert llm.generate(TEXT, _greedy())[0].token_ids == expected


def _broken_copies(tiny_llama: Path, tmp_path: Path) -> dict[str, Path]:
    """Copies of ``tiny_llama`` broken as a download or an edit breaks a checkpoint."""
    copies = {}
    for name in ("cut-short", "wrong-shape", "no-weights", "no-tokenizer"):
        copies[name] = tmp_path / name
        shutil.copytree(tiny_llama, copies[name])
    weights = (tiny_llama / "model.safetensors").read_bytes()
    (copies["cut-short"] / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    config = json.loads((tiny_llama / "config.json").read_text())
    (copies["wrong-shape"] / "config.json").write_text(json.dumps({**config, "intermediate_size": 2 * config["intermediate_size"]}))
    (copies["no-weights"] / "model.safetensors").unlink()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (copies["no-tokenizer"] / name).unlink(missing_ok=True)
    return copies


BROKEN = {
    "cut-short": r"model\.safetensors: not a readable safetensors file \(cut short or corrupt\?\)",
    "wrong-shape": r"language-model weights do not match config\.json \(\d+\): layers\.0\.mlp\.down_proj\.weight is "
                   r"\(\d+, \d+\), config\.json gives",
    "no-weights": r"no model\.safetensors or model\.safetensors\.index\.json",
    "no-tokenizer": r"(the tokenizer has no vocabulary|cannot load the tokenizer).*; a checkpoint directory needs "
                    r"tokenizer\.json or tokenizer\.model with tokenizer_config\.json",
}


def test_a_broken_checkpoint_is_one_clear_error_offline_and_from_serve(tiny_llama: Path, tmp_path: Path) -> None:
    """A weights file cut short, weights of another shape than config.json's, no weights, no tokenizer files
    (transformers then builds an empty tokenizer, and every call was "prompt is empty"): the offline API
    raises CheckpointError saying which; ``mm-serve serve`` says that one line, exit status 2, with no
    traceback or log tail, from a worker's load and from the start's profile alike."""
    import subprocess
    import sys

    for name, model_dir in _broken_copies(tiny_llama, tmp_path).items():
        with pytest.raises(CheckpointError, match=BROKEN[name]):
            LLM(model=model_dir, mode="colocated", num_pages=64)
        # the weight files' headers are read before anything else (one start says it); a shape or a tokenizer
        # shows when the model loads: in a worker (colocated), or in the start's profile (planned)
        modes = {"cut-short": ("disaggregated",), "no-weights": ("disaggregated",), "wrong-shape": ("colocated",),
                 "no-tokenizer": ("colocated", "planned")}[name]
        for mode in modes:
            pinned = [] if mode == "planned" else ["--mode", mode]
            done = subprocess.run(
                [sys.executable, "-m", "mm_serve", "serve", "--model", str(model_dir), "--port", "0", *pinned],
                capture_output=True, text=True, timeout=300, env={**os.environ, "MM_SERVE_PROFILE_DIR": str(tmp_path)})
            output = done.stdout + done.stderr
            assert done.returncode == 2 and "Traceback" not in output, (name, mode, output[-2000:])
            assert "workers failed to start" not in output and "--- " not in output  # one line, no log tail
            assert re.search(BROKEN[name], output), (name, mode, output[-2000:])
