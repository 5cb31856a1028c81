"""Tokenizer: byte-level round trip, special tokens, chat template, conversation encoding."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from mm_serve.shapes.dataset import IGNORE_INDEX, ConversationEncoder, user_prompt
from mm_serve.shapes.model_config import NUM_IMAGE_TOKENS
from mm_serve.shapes.targets import QA
from mm_serve.shapes.tokenizer import SPECIAL_TOKENS, save_tokenizer, train_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    out: Path = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(train_tokenizer(), out)
    return AutoTokenizer.from_pretrained(out)


def test_special_token_ids(tokenizer: PreTrainedTokenizerBase) -> None:
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [0, 1, 2, 3, 4]
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.unk_token) == (
        "<s>",
        "</s>",
        "<pad>",
        "<unk>",
    )
    assert len(tokenizer) < 2048


@pytest.mark.parametrize("text", ["a red circle and a blue square", "Café naïve Straße 東京 🙂 ∑ x²", "  tabs\tand\nnewlines  "])
def test_utf8_round_trip(tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_task_words_are_single_tokens(tokenizer: PreTrainedTokenizerBase) -> None:
    for word in ("red", "purple", "orange", "circle", "triangle", "square", "yes", "three"):
        assert len(tokenizer(" " + word, add_special_tokens=False)["input_ids"]) == 1


def test_chat_template_string_and_parts(tokenizer: PreTrainedTokenizerBase) -> None:
    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]}]
    text = [{"role": "user", "content": "<image>\nDescribe the image."}]
    expected = "USER: <image>\nDescribe the image. ASSISTANT:"
    for messages in (parts, text):
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert rendered == expected == user_prompt("Describe the image.", with_image=True)
    text_first = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image"}]}]
    assert tokenizer.apply_chat_template(text_first, add_generation_prompt=True, tokenize=False) == (
        "USER: <image>\nHi ASSISTANT:"
    )


def test_encoder_matches_template_and_masks_prompt(tokenizer: PreTrainedTokenizerBase) -> None:
    turns = [QA("count", "How many shapes are there?", "two"), QA("exists", "Is there a red circle?", "no")]
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": turns[0].question}]},
        {"role": "assistant", "content": turns[0].answer},
        {"role": "user", "content": turns[1].question},
        {"role": "assistant", "content": turns[1].answer},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == "USER: <image>\nHow many shapes are there? ASSISTANT: two</s>USER: Is there a red circle? ASSISTANT: no</s>"
    reference = tokenizer(rendered)["input_ids"]
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    ids, labels = ConversationEncoder(tokenizer, image_id).encode(turns)
    assert ids.count(image_id) == NUM_IMAGE_TOKENS
    collapsed = [t for i, t in enumerate(ids) if t != image_id or ids[i - 1] != image_id]
    assert collapsed == reference
    supervised = [t for t, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX]
    assert tokenizer.decode(supervised) == " two</s> no</s>"
    assert all(label in (IGNORE_INDEX, t) for t, label in zip(ids, labels, strict=True))
