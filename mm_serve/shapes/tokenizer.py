"""The embedded model's tokenizer: a small byte-level BPE trained with ``tokenizers``.

Byte-level BPE means every UTF-8 string round-trips (unknown characters fall back
to their bytes), so ``<unk>`` exists only for compatibility. The corpus is the
task's text (every question, answer and caption word, the chat roles) plus a
little general English written for this purpose (:data:`GENERAL_ENGLISH`).

The saved directory loads with ``AutoTokenizer.from_pretrained`` as a
``PreTrainedTokenizerFast``; encoding adds ``<s>`` in front (as llava-1.5 does),
and the chat template renders ``USER: <image>\\n{question} ASSISTANT:`` with the
image parts first (:data:`CHAT_TEMPLATE`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from mm_serve.shapes.scenes import COLOURS, SHAPES
from mm_serve.shapes.targets import CAPTION_PROMPTS, COUNT_QUESTION, COUNT_WORDS, phrase

BOS, EOS, UNK, PAD, IMAGE = "<s>", "</s>", "<unk>", "<pad>", "<image>"
SPECIAL_TOKENS: tuple[str, ...] = (UNK, BOS, EOS, PAD, IMAGE)
"""In id order: ``<unk>`` = 0, ``<s>`` = 1, ``</s>`` = 2, ``<pad>`` = 3, ``<image>`` = 4."""
VOCAB_SIZE = 768

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}"
    "{%- set images = '' -%}{%- set text = message['content'] -%}"
    "{%- else -%}"
    "{%- set images = message['content'] | selectattr('type', 'equalto', 'image') | list | length -%}"
    "{%- set images = '<image>\\n' * images -%}"
    "{%- set text = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join(' ') -%}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ 'ASSISTANT: ' + text + eos_token }}"
    "{%- elif message['role'] == 'system' -%}"
    "{{ text + ' ' }}"
    "{%- else -%}"
    "{{ 'USER: ' + images + text + ' ' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'ASSISTANT:' }}{%- endif -%}"
)
"""llava-1.5 style: ``USER: <image>\\n{question} ASSISTANT: {answer}</s>USER: ...``.

Content may be a string or a list of ``{"type": "image"}`` / ``{"type": "text"}``
parts; images render first as ``<image>\\n`` each, text parts join with a space.
"""

GENERAL_ENGLISH = """\
Hello! This is a small model that looks at pictures and answers questions about them.
It was trained on simple drawings, so it knows about colours and shapes, and not much else.
The quick brown fox jumps over the lazy dog. A cat sat on the mat while it rained outside.
Please tell me what you see. I would like to know more about the weather today.
What time is it? Where are we going? Who wrote this book, and when was it written?
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 2024. Punctuation: , . ; : ! ? ' " ( ) [ ] { } - _ / @ # % & *
People often ask short questions and expect short, clear answers. Thank you very much.
The service reads an image, turns it into tokens, and writes an answer one word at a time.
Left and right, top and bottom, large and small, light and dark, many and few, first and last.
Café, naïve, Straße, 東京, Привет, 🙂: text in any language still round-trips as bytes.
"""


def task_corpus() -> Iterator[str]:
    """Every task word in context: questions, answers, captions and the chat roles."""
    yield from CAPTION_PROMPTS
    yield COUNT_QUESTION
    yield " ".join(COUNT_WORDS) + " yes no"
    for shape in SHAPES:
        yield f"What color is the {shape}?"
        for colour in COLOURS:
            yield f"Is there {phrase(colour, shape)}? {phrase(colour, shape)}, {phrase(colour, shape)} and"
    for _ in range(20):
        yield "USER: ASSISTANT: USER: ASSISTANT:"


def train_tokenizer(vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Train the byte-level BPE on :func:`task_corpus` plus :data:`GENERAL_ENGLISH` (deterministic)."""
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [*task_corpus(), *GENERAL_ENGLISH.splitlines()]
    tokenizer.train_from_iterator(corpus * 3, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, out_dir: Path) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` (with the chat template) and ``special_tokens_map.json``.

    The template also goes to ``chat_template.jinja``, where ``AutoProcessor`` looks for it.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    special = {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": PAD}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "extra_special_tokens": {"image_token": IMAGE},
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": 512,
        "padding_side": "left",
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    special_map = {**special, "additional_special_tokens": [IMAGE]}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
