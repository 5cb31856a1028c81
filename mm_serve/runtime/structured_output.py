"""Grammar-constrained decoding (structured outputs) with xgrammar.

A request that asks for structured output carries a :data:`GrammarSpec` in its sampling parameters:
``("json", schema text)`` (OpenAI's ``response_format`` ``json_schema``, vLLM's ``guided_json``),
``("json_object", "")`` (any JSON object), ``("regex", pattern)`` or ``("choice", JSON list of strings)``.
Every process that samples (the prefill worker's first token, the decode worker, the colocated engine)
holds a :class:`GrammarBook`: the checkpoint's tokenizer as xgrammar's ``TokenizerInfo``, one
``GrammarCompiler`` whose cache keeps each compiled grammar by its spec, and each request's
``GrammarMatcher``. Before each sampling step the matcher's bitmask of the tokens its grammar allows next
is applied to the request's logits (``-inf`` elsewhere); the sampled token is then accepted into it.

The matcher's state is never shipped: a process builds a request's matcher on first use from the tokens
it has output so far (those before a migration are the tail of its prompt), so a hand-off, a preemption
by recompute (the same request, its matcher kept) and a migration all continue the same grammar.

Why xgrammar (Dong et al., "XGrammar: Flexible and Efficient Structured Generation Engine for Large
Language Models", MLSys 2025): it is vLLM's and SGLang's default backend, its masks are precomputed for
most tokens per grammar state (context-independent tokens), so a step costs microseconds, and it compiles
JSON Schema, regular expressions and EBNF. llguidance computes masks lazily and is a good alternative;
outlines-core compiles regular expressions to automata up front, slower on large schemas.

JSON is generated compact (xgrammar's ``any_whitespace=False``: no free whitespace between tokens), so a
model cannot loop on spaces and newlines inside a valid document.
"""

from __future__ import annotations

import json
import re
import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from mm_serve.runtime.request import Request

GrammarSpec = tuple[str, str]  # (kind, text): kinds in GRAMMAR_KINDS
GRAMMAR_KINDS = ("json", "json_object", "regex", "choice")
_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # xgrammar's "[time] file.cc:line: " message prefix


class GrammarError(ValueError):
    """A grammar xgrammar cannot compile (the message names the problem), or an unknown kind."""


# One character of a JSON string as it is written (RFC 8259 §7): a printable ASCII character but a quote or a
# backslash, any other Unicode scalar value (written as the characters themselves: xgrammar matches them as
# their UTF-8 bytes; surrogates excluded, their 3-byte forms are not UTF-8), or an escape.
_JSON_CHAR = ('(?:[\\x20\\x21\\x23-\\x5b\\x5d-\\x7e\u0080-\ud7ff\ue000-\uffff\U00010000-\U0010ffff]'
              '|\\\\["\\\\/bfnrt]|\\\\u[0-9a-fA-F]{4})')


def strings_as_patterns(schema: Any) -> Any:
    """``schema`` with each string schema (with no ``pattern``, ``format``, ``enum`` or ``const`` of its own)
    given the ``pattern`` of its ``minLength`` / ``maxLength`` (none: any length) instead: the same strings,
    counted in characters, written as valid JSON. xgrammar (0.2.9) lets a length-bounded string hold raw
    control characters, which no JSON parser accepts (RFC 8259 §7), and its "any character" admits the
    3-byte forms of surrogates, which decode as three replacement characters (a string over its length);
    its strings with a pattern follow the pattern.
    """
    if isinstance(schema, list):
        return [strings_as_patterns(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strings_as_patterns(value) for key, value in schema.items()}
    if out.get("type") == "string" and not {"pattern", "format", "enum", "const"} & set(out):
        low, high = int(out.pop("minLength", 0)), out.pop("maxLength", None)
        out["pattern"] = f"^{_JSON_CHAR}{{{low},{'' if high is None else int(high)}}}$"
    return out


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (each a string literal, escaped)."""
    def literal(text: str) -> str:
        escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
        return '"' + escaped.replace("\t", "\\t") + '"'

    return "root ::= " + " | ".join(literal(c) for c in choices)


def _fast_tokenizer(model_dir: Path) -> Any:
    """The checkpoint's tokenizer for xgrammar's vocabulary: straight from its ``tokenizer.json`` when it has
    one (a millisecond; ``AutoTokenizer`` takes ~2 s resolving the checkpoint's configs, inside a worker's
    step), else through ``AutoTokenizer``."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if (model_dir / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    return AutoTokenizer.from_pretrained(str(model_dir))


class GrammarBook:
    """One process's compiler (and its cache) and its requests' matchers, over ``model_dir``'s tokenizer.

    Built lazily: nothing is loaded until the first structured request (the vocabulary size is the logits'
    width then, which may exceed the tokenizer's).

    Raises (:meth:`compile`, :meth:`prepare`):
        GrammarError: the spec does not compile.
    """

    def __init__(self, model_dir: str | Path, eos_token_ids: frozenset[int] = frozenset(),
                 tokenizer: Any = None) -> None:
        self.model_dir = str(model_dir)
        self.eos_token_ids = eos_token_ids
        self._tokenizer = tokenizer
        self._compiler: Any = None
        self._vocab = 0
        self._lock = threading.Lock()  # the front end compiles from threads

    def _compiler_for(self, vocab_size: int) -> Any:
        with self._lock:
            if self._compiler is None or self._vocab != vocab_size:
                import xgrammar

                tokenizer = self._tokenizer or _fast_tokenizer(Path(self.model_dir))
                with warnings.catch_warnings():  # "stop_token_ids ... automatically detected": every matcher is
                    warnings.simplefilter("ignore", UserWarning)  # given its request's stop tokens (matcher())
                    info = xgrammar.TokenizerInfo.from_huggingface(
                        tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(self.eos_token_ids) or None)
                self._compiler, self._vocab = xgrammar.GrammarCompiler(info, max_threads=1), vocab_size
            return self._compiler

    def compile(self, spec: GrammarSpec, vocab_size: int) -> Any:
        """The compiled grammar of ``spec`` for a ``vocab_size``-wide logits row (cached by the compiler).

        Raises:
            GrammarError: an unknown kind, or the spec does not compile (xgrammar's reason in the message).
        """
        kind, text = spec
        compiler = self._compiler_for(vocab_size)
        try:
            if kind == "json":
                schema = strings_as_patterns(json.loads(text))
                return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "choice":
                return compiler.compile_grammar(choice_ebnf(json.loads(text)))
        except RuntimeError as exc:
            raise GrammarError(_LOCATION.sub("", str(exc).strip().splitlines()[0])) from None
        raise GrammarError(f"unknown grammar kind {kind!r}; known: {', '.join(GRAMMAR_KINDS)}")

    def matcher(self, request: Request, vocab_size: int) -> Any:
        """``request``'s matcher, built on first use and fed every output it has had (earlier attempts'
        too); it ends on the request's stop tokens (EOS folded in unless ``ignore_eos``), or, with none,
        as soon as the grammar is complete.

        Raises:
            GrammarError: as :meth:`compile`; or an output the grammar does not accept (a request whose
                outputs were not made under this grammar).
        """
        import xgrammar

        state = request.grammar_matcher
        if state is not None:
            return state
        params = request.sampling_params
        assert params.structured is not None
        stops = sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids)))
        matcher = xgrammar.GrammarMatcher(self.compile(params.structured, vocab_size),
                                          override_stop_tokens=stops or None, terminate_without_stop_token=not stops)
        cut = len(request.prompt_token_ids) - request.output_offset
        for token in request.prompt_token_ids[cut:] + request.output_token_ids:
            if not matcher.accept_token(token):
                raise GrammarError(f"output token {token} of {request.request_id!r} is outside its grammar")
        request.grammar_matcher = matcher
        return matcher

    def mask(self, logits: torch.Tensor, batch: list[Request]) -> None:
        """Set to ``-inf``, in ``logits`` ``[B, V]`` (float32, in place), every token the grammar of a
        structured request of ``batch`` does not allow next (other rows are left as they are)."""
        import xgrammar

        rows = [i for i, r in enumerate(batch) if r.sampling_params.structured is not None]
        if not rows:
            return
        vocab = logits.shape[-1]
        bitmask = xgrammar.allocate_token_bitmask(len(batch), vocab)
        for i in rows:
            self.matcher(batch[i], vocab).fill_next_token_bitmask(bitmask, i)
        xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)

    @staticmethod
    def accept(batch: list[Request], tokens: list[int]) -> None:
        """Feed each structured request's sampled token to its matcher (after :meth:`mask`)."""
        for request, token in zip(batch, tokens, strict=True):
            matcher: Any = request.grammar_matcher
            if matcher is not None and not matcher.is_terminated():
                matcher.accept_token(token)
