"""Train a small BPE tokenizer offline (``tokenizers``) for test and demo checkpoints.

Two styles:

* ``bytelevel`` (default): byte-level BPE (Radford et al. 2019, GPT-2), covering every
  UTF-8 string; the tokenizer adds no BOS and the chat template starts with it.
* ``llama``: SentencePiece-style, as llava-1.5-hf's Llama tokenizer (Metaspace ``▁``
  word boundaries, byte fallback, the decoder strips the leading space); the tokenizer
  adds BOS and the chat template does not emit it.

The result is saved as a ``PreTrainedTokenizerFast`` directory (``tokenizer.json``,
``tokenizer_config.json`` with a LLaVA-1.5-style chat template,
``special_tokens_map.json``) that ``transformers.AutoTokenizer`` loads offline.
"""

from __future__ import annotations

from collections.abc import Iterable
from importlib import resources
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>", "<image>")
VIDEO_TOKEN = "<video>"  # id 5 of a tokenizer built with ``video=True`` (Qwen2-VL test checkpoints)

# LLaVA-1.5 conversation format: "USER: <image>\n{question} ASSISTANT: {answer}</s>".
# Content may be a string or a list of parts ({"type": "text"|"image"|"image_url"}).
_CONVERSATION = (
    "{% for message in messages %}"
    "{% if message['content'] is string %}{% set parts = [{'type': 'text', 'text': message['content']}] %}"
    "{% else %}{% set parts = message['content'] %}{% endif %}"
    "{% if message['role'] == 'system' %}"
    "{% for part in parts %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{{ '\\n' }}"
    "{% elif message['role'] == 'user' %}USER: "
    "{% for part in parts %}"
    "{% if part['type'] in ('image', 'image_url') %}<image>{{ '\\n' }}"
    "{% elif part['type'] in ('video', 'video_url') %}<video>{{ '\\n' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %} "
    "{% elif message['role'] == 'assistant' %}ASSISTANT: "
    "{% for part in parts %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{{ eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
CHAT_TEMPLATE = "{{ bos_token }}" + _CONVERSATION  # bytelevel: the template emits BOS
CHAT_TEMPLATE_NO_BOS = _CONVERSATION  # llama: the tokenizer adds BOS (as llava-1.5-hf)
TOKENIZER_STYLES = ("bytelevel", "llama")


def shipped_corpus() -> list[str]:
    """Lines of the English text shipped in ``mm_serve/models/corpus/``."""
    text = resources.files("mm_serve.models").joinpath("corpus/english.txt").read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()]


def train_bpe(lines: Iterable[str], vocab_size: int, extra_special: tuple[str, ...] = ()) -> Tokenizer:
    """A byte-level BPE tokenizer with :data:`SPECIAL_TOKENS` at ids 0..4 (``<s>`` = 1, ``</s>`` = 2), then
    ``extra_special``."""
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[*SPECIAL_TOKENS, *extra_special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(lines), trainer=trainer)
    return tokenizer


def train_sentencepiece_style(lines: Iterable[str], vocab_size: int, extra_special: tuple[str, ...] = ()) -> Tokenizer:
    """A Llama-style BPE tokenizer (``▁`` word marks, byte fallback), :data:`SPECIAL_TOKENS` at
    ids 0..4, then ``extra_special``, whose post-processor prepends BOS as Llama's does."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tokenizer.normalizer = None
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)
    tokenizer.decoder = decoders.Sequence([
        decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
    ])
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[*SPECIAL_TOKENS, *extra_special, *byte_tokens], show_progress=False,
    )
    tokenizer.train_from_iterator(list(lines), trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)],
    )
    return tokenizer


def save_tokenizer(
    tokenizer: Tokenizer, out_dir: str | Path, model_max_length: int = 2048, style: str = "bytelevel",
    video: bool = False,
) -> None:
    """Write ``tokenizer.json`` + config files that ``AutoTokenizer.from_pretrained`` reads."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        extra_special_tokens={"image_token": "<image>", **({"video_token": VIDEO_TOKEN} if video else {})},
        model_max_length=model_max_length,
        add_bos_token=style == "llama",
    )
    fast.chat_template = CHAT_TEMPLATE_NO_BOS if style == "llama" else CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))


def build_tokenizer(
    out_dir: str | Path, vocab_size: int = 512, extra_lines: Iterable[str] = (), style: str = "bytelevel",
    video: bool = False,
) -> int:
    """Train on the shipped corpus (plus ``extra_lines``), save to ``out_dir``; returns the vocab size.
    ``video``: a :data:`VIDEO_TOKEN` special at id 5 (the template's video parts).

    Raises:
        ValueError: ``style`` is not one of :data:`TOKENIZER_STYLES`.
    """
    if style not in TOKENIZER_STYLES:
        raise ValueError(f"tokenizer style must be one of {TOKENIZER_STYLES}, got {style!r}")
    lines = [*shipped_corpus(), *extra_lines]
    extra = (VIDEO_TOKEN,) if video else ()
    if style == "llama":
        tokenizer = train_sentencepiece_style(lines, vocab_size, extra)
    else:
        tokenizer = train_bpe(lines, vocab_size, extra)
    save_tokenizer(tokenizer, out_dir, style=style, video=video)
    return tokenizer.get_vocab_size()
