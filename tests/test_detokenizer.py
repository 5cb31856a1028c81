"""Incremental detokenization: multi-byte characters never split, stop strings never leaked."""

from __future__ import annotations

from pathlib import Path

import pytest

from mm_serve.inputs.input_processor import load_tokenizer
from mm_serve.runtime.detokenizer import IncrementalDetokenizer
from mm_serve.runtime.stop_strings import StopStrings

TEXT = "Caf\u00e9 na\u00efve \U0001f642 \u6771\u4eac \u041c\u043e\u0441\u043a\u0432\u0430 \U0001f680 done."


@pytest.fixture(scope="module")
def tokenizer(tiny_llava: Path) -> object:
    return load_tokenizer(tiny_llava)


def test_multibyte_characters_stream_whole(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    assert len(ids) > len(TEXT) // 2  # byte-level pieces: emoji span several tokens
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add([t]) for t in ids] + [detok.finish()]
    assert "".join(pieces) == TEXT
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_spanning_tokens_is_cut_and_never_leaked(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    stop = "\U0001f642 \u6771"
    detok = IncrementalDetokenizer(tokenizer, (stop,))
    pieces = []
    for t in ids:
        pieces.append(detok.add([t]))
        assert stop[:1] not in "".join(pieces)  # not even a prefix of the stop string went out
        if detok.stopped:
            break
    pieces.append(detok.finish())
    assert detok.stop_string == stop
    assert "".join(pieces) == TEXT[: TEXT.index(stop)]


def test_held_prefix_is_released_when_it_turns_out_not_to_be_a_stop(tokenizer) -> None:  # type: ignore[no-untyped-def]
    text = TEXT[:-1]  # ends with "done"
    detok = IncrementalDetokenizer(tokenizer, ("done!",))
    ids = tokenizer(text, add_special_tokens=False).input_ids
    out = "".join(detok.add([t]) for t in ids)
    assert out.endswith("\u0430 \U0001f680 ")  # "done" is held: it might still become "done!"
    assert not detok.stopped
    assert out + detok.finish() == text


def test_stop_strings_find_the_earliest_and_hold_the_longest_but_one() -> None:
    """The earliest occurrence wins (of two starting together, the first listed); a search from ``start``
    sees only occurrences starting there or later; the held tail is ``longest - 1`` characters."""
    stops = StopStrings(["cde", "c", "abcd", "ab"])
    assert stops.first("xabcdef") == (1, "abcd")  # "abcd" and "ab" start at 1: the first listed
    assert stops.first("xxcde") == (2, "cde")
    assert stops.first("xabcdef", 3) == (3, "cde")
    assert stops.first("nothing here") is None and stops.hold == 3
    many = StopStrings([f"stop-{i:04d}" for i in range(2000)] + ["END"])
    assert many.first("a long answer. END and more") == (15, "END")
    with pytest.raises(ValueError, match="non-empty"):
        StopStrings(["ok", ""])


class _CountingTokenizer:
    """Wraps a tokenizer and records how many ids each ``decode`` call was given."""

    def __init__(self, inner) -> None:  # type: ignore[no-untyped-def]
        self.inner = inner
        self.lengths: list[int] = []

    def decode(self, ids, **kwargs):  # type: ignore[no-untyped-def]
        self.lengths.append(len(ids))
        return self.inner.decode(ids, **kwargs)


def test_long_outputs_decode_a_short_window_per_step_and_match_the_full_decode(tokenizer) -> None:  # type: ignore[no-untyped-def]
    import random

    rng = random.Random(0)
    vocab = len(tokenizer)
    ids = [rng.randrange(vocab) for _ in range(600)]  # byte pieces, words and special tokens mixed
    counting = _CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting)
    text = "".join(detok.add([t]) for t in ids) + detok.finish()
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    assert max(counting.lengths) <= 16  # O(1) ids per step, not the whole output


@pytest.mark.parametrize("checkpoint", ["tiny_llava", "tiny_llava_sp"])
def test_streamed_text_equals_transformers_decode(checkpoint: str, request: pytest.FixtureRequest) -> None:
    """For byte-level and SentencePiece-style tokenizers alike, the streamed deltas join to exactly
    ``tokenizer.decode(ids, skip_special_tokens=True)``: a leading space appears where transformers
    keeps one (byte-level ``Ġ``) and not where its decoder strips it (Llama's ``▁``), at the first
    token and after special tokens, byte-fallback pieces and multi-byte characters."""
    import random

    tok = load_tokenizer(request.getfixturevalue(checkpoint))
    rng = random.Random(0)
    word_ids = tok(" the circle is red. " + TEXT, add_special_tokens=False).input_ids
    sequences = [word_ids, [tok.bos_token_id, *word_ids, tok.eos_token_id, *word_ids[:3]]]
    sequences += [[rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 24))] for _ in range(200)]
    for ids in sequences:
        detok = IncrementalDetokenizer(tok)
        streamed = "".join(detok.add([t]) for t in ids) + detok.finish()
        assert streamed == tok.decode(ids, skip_special_tokens=True), ids


@pytest.mark.parametrize("step", [1, 3], ids=["token-by-token", "three-at-a-time"])
def test_min_tokens_ignores_stop_strings_ending_within_its_tokens(tokenizer, step: int) -> None:  # type: ignore[no-untyped-def]
    """vLLM's rule: a stop string counts only where it ends in the text of a token past the first ``min_tokens``
    (an occurrence inside them is passed over; the next one stops the text), however the tokens arrive."""
    text = "one stop two stop three"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    first_end = next(k for k in range(1, len(ids) + 1) if "stop" in tokenizer.decode(ids[:k]))
    for min_tokens, cut in ((0, "one "), (first_end, "one stop two ")):
        detok = IncrementalDetokenizer(tokenizer, ("stop",), min_tokens=min_tokens)
        out = "".join(detok.add(ids[i:i + step]) for i in range(0, len(ids), step)) + detok.finish()
        assert detok.stop_string == "stop" and out == cut, (min_tokens, out)
