"""Prompt ids and greedy text equal transformers' on every entry path, with one BOS.

Two checkpoints: ``tiny_llava`` (its chat template emits BOS; its tokenizer adds none) and
``tiny_llava_sp`` (llava-1.5-hf's arrangement: a Llama-style tokenizer that adds BOS, a
template without it). The reference is transformers' documented LLaVA usage:
``LlavaProcessor.apply_chat_template(..., tokenize=True)`` for the prompt ids, then
``LlavaForConditionalGeneration.generate`` (greedy) and ``tokenizer.decode(...,
skip_special_tokens=True)`` for the text. Entry paths: the offline ``LLM`` with
``messages``, the chat API (``usage.prompt_tokens`` and the text, streamed and not) and the
caption job.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from PIL import Image

from mm_serve import LLM, SamplingParams
from mm_serve.caption.engine_backend import EngineBackend
from mm_serve.config import config_from_dict
from tests.api.server_process import ServerProcess, data_uri
from tests.caption.local_job import run_job
from tests.factories import gradient_image

NEW_TOKENS = 10
BOS = 1
CAPTION_PROMPT = "Describe the image."
IMAGES = [gradient_image(80, 60, seed=1), gradient_image(50, 90, seed=2)]

# (name, messages with {"type": "image", "index": i} parts)
CASES: list[tuple[str, list[dict[str, Any]]]] = [
    ("text", [{"role": "user", "content": "What shape is red?"}]),
    ("image", [{"role": "user", "content": [{"type": "image", "index": 0},
                                            {"type": "text", "text": "Describe the image."}]}]),
    ("system-image", [{"role": "system", "content": "Answer in one word."},
                      {"role": "user", "content": [{"type": "image", "index": 1},
                                                   {"type": "text", "text": "How many shapes?"}]}]),
    ("two-images", [{"role": "user", "content": [{"type": "image", "index": 0}, {"type": "image", "index": 1},
                                                 {"type": "text", "text": "Compare them."}]}]),
]
CHECKPOINTS = ["tiny_llava", "tiny_llava_sp"]


def _images_of(messages: list[dict[str, Any]]) -> list[Image.Image]:
    return [IMAGES[p["index"]] for m in messages if isinstance(m["content"], list)
            for p in m["content"] if p["type"] == "image"]


def _offline_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**m, "content": [{"type": "image", "image": IMAGES[p["index"]]} if p["type"] == "image" else p
                              for p in m["content"]]} if isinstance(m["content"], list) else m for m in messages]


def _api_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**m, "content": [{"type": "image_url", "image_url": {"url": data_uri(IMAGES[p["index"]])}}
                              if p["type"] == "image" else p for p in m["content"]]}
            if isinstance(m["content"], list) else m for m in messages]


class Reference:
    """transformers' processor and model for one checkpoint."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import (
            AutoTokenizer,
            CLIPImageProcessor,
            LlavaForConditionalGeneration,
            LlavaProcessor,
        )

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.processor = LlavaProcessor(
            image_processor=CLIPImageProcessor.from_pretrained(str(model_dir)), tokenizer=self.tokenizer,
            patch_size=14, vision_feature_select_strategy="default", num_additional_image_tokens=1,
            chat_template=self.tokenizer.chat_template,
        )
        self.model = LlavaForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    def inputs(self, messages: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        images = _images_of(messages)
        return dict(self.processor.apply_chat_template(
            [{**m, "content": [{"type": p["type"], **({"text": p["text"]} if p["type"] == "text" else {})}
                               for p in m["content"]]} if isinstance(m["content"], list) else m for m in messages],
            add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt",
            processor_kwargs={"images": images} if images else {},
        ))

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        return [int(t) for t in self.inputs(messages)["input_ids"][0]]

    @torch.inference_mode()
    def text(self, messages: list[dict[str, Any]]) -> str:
        inputs = self.inputs(messages)
        out = self.model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False,
                                  eos_token_id=self.tokenizer.eos_token_id, pad_token_id=0)
        return str(self.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))


@pytest.fixture(scope="module", params=CHECKPOINTS)
def checkpoint(request: pytest.FixtureRequest) -> tuple[Path, Reference]:
    model_dir = request.getfixturevalue(request.param)
    return model_dir, Reference(model_dir)


TEMPLATE_EMITS_BOS = {"tiny_llava": True, "tiny_llava_sp": False}


@pytest.fixture(scope="module")
def server(checkpoint: tuple[Path, Reference], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(checkpoint[0], log_dir=tmp_path_factory.mktemp("logs"))
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def test_templates_differ_in_who_adds_bos(checkpoint: tuple[Path, Reference], request: pytest.FixtureRequest) -> None:
    """The two checkpoints cover both arrangements (else the BOS tests below prove nothing)."""
    _, ref = checkpoint
    rendered = ref.tokenizer.apply_chat_template(CASES[0][1], add_generation_prompt=True, tokenize=False)
    name = request.node.callspec.params["checkpoint"]
    assert rendered.startswith("<s>") == TEMPLATE_EMITS_BOS[name]
    assert ref.prompt_ids(CASES[0][1]).count(BOS) == 1


def test_offline_prompt_ids_and_text_equal_transformers(checkpoint: tuple[Path, Reference]) -> None:
    """The offline LLM (in-process and worker modes) gives transformers' ids, one BOS, and its text."""
    model_dir, ref = checkpoint
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    expected = [(ref.prompt_ids(m), ref.text(m)) for _, m in CASES]
    for mode in ("colocated", "disaggregated"):
        with LLM(model=model_dir, mode=mode, num_pages=512) as llm:
            outs = llm.generate([{"messages": _offline_messages(m)} for _, m in CASES], params)
            for (name, messages), out, (ids, text) in zip(CASES, outs, expected, strict=True):
                assert llm.inputs.process({"messages": _offline_messages(messages)}).prompt_token_ids == ids, name
                assert ids[0] == BOS and ids.count(BOS) == 1, name
                assert out.num_prompt_tokens == len(ids), (mode, name)
                assert out.outputs[0].text == text, (mode, name)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[name for name, _ in CASES])
def test_chat_api_prompt_tokens_and_text_equal_transformers(
    checkpoint: tuple[Path, Reference], server: ServerProcess, case: int,
) -> None:
    """``usage.prompt_tokens`` and the greedy text of the chat API (streamed and not) equal transformers'."""
    _, ref = checkpoint
    name, messages = CASES[case]
    body = {"model": "tiny", "messages": _api_messages(messages), "max_tokens": NEW_TOKENS, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["usage"]["prompt_tokens"] == len(ref.prompt_ids(messages)), name
    text = ref.text(messages)
    assert answer["choices"][0]["message"]["content"] == text, name
    streamed = []
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                streamed.extend(c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"])
    assert "".join(streamed) == text, name


def test_caption_job_equals_transformers(checkpoint: tuple[Path, Reference], tmp_path: Path) -> None:
    """The caption job's prompt (image, then the prompt text) and caption equal transformers' (caption stripped)."""
    model_dir, ref = checkpoint
    folder = tmp_path / "images"
    folder.mkdir()
    for i, image in enumerate(IMAGES):
        image.save(folder / f"img{i}.png")
    backend = EngineBackend.start(model_dir, config_from_dict({"model": str(model_dir)}),
                                  max_tokens=NEW_TOKENS, model_name="tiny")
    try:
        run_job(backend, folder, tmp_path / "out.jsonl")
    finally:
        backend.close()
    rows = {row["id"]: row for row in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    for i in range(len(IMAGES)):
        messages = [{"role": "user", "content": [{"type": "image", "index": i},
                                                 {"type": "text", "text": CAPTION_PROMPT}]}]
        row = rows[f"img{i}.png"]
        assert row["caption"] == ref.text(messages).strip()
        assert row["prompt_tokens"] == len(ref.prompt_ids(messages))
