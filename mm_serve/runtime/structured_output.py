"""Grammar-constrained decoding (structured outputs) with xgrammar.

A request that asks for structured output carries a :data:`GrammarSpec` in its sampling parameters:
``("json", schema text)`` (OpenAI's ``response_format`` ``json_schema``, vLLM's ``guided_json``),
``("json_object", "")`` (any JSON object), ``("regex", pattern)``, ``("choice", JSON list of strings)`` or
``("grammar", EBNF)`` (vLLM's ``guided_grammar``, in xgrammar's EBNF dialect).
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

import functools
import json
import math
import re
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mm_serve.runtime.grammar_spec import (
    GRAMMAR_KINDS,
    GrammarAllowsNothing,
    GrammarError,
    GrammarSpec,
)
from mm_serve.runtime.json_closing import JsonClosing
from mm_serve.runtime.logit_controls import split_outputs
from mm_serve.runtime.schema_combinators import enforceable

if TYPE_CHECKING:
    import torch

    from mm_serve.runtime.request import Request

__all__ = ["GRAMMAR_KINDS", "GrammarBook", "GrammarError", "GrammarSpec", "choice_ebnf", "strings_as_patterns"]
_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # xgrammar's "[time] file.cc:line: " message prefix




# One character of a JSON string as it is written (RFC 8259 §7): a printable ASCII character but a quote or a
# backslash, any other Unicode scalar value (written as the characters themselves: xgrammar matches them as
# their UTF-8 bytes; surrogates excluded, their 3-byte forms are not UTF-8), or an escape.
_JSON_CHAR = ('(?:[\\x20\\x21\\x23-\\x5b\\x5d-\\x7e\u0080-\ud7ff\ue000-\uffff\U00010000-\U0010ffff]'
              '|\\\\["\\\\/bfnrt]|\\\\u[0-9a-fA-F]{4})')


MAX_OPTIONAL_PROPERTIES = 256  # in one object: xgrammar's compile time grows ~cubically with them (0.25 s at 300,
# 8 s at 1000 on a 2-core machine); required properties compile in linear time
MAX_OPTIONAL_PROPERTIES_TOTAL = 1024  # over the whole schema
SLOW_REMEMBERED = 1024  # grammars remembered as too slow to compile (refused at once when sent again)
MAX_SCHEMA_DEPTH = 64  # schemas within schemas: xgrammar's compile time grows ~cubically with the nesting
# (0.03 s at 64 levels, 0.2 s at 128, 9 s at 450 on a 2-core machine)
_LOOKAROUND = re.compile(r"\(\?<?[=!]")  # (?= (?! (?<= (?<!: xgrammar ignores them (the output could break them)
# keywords xgrammar (0.2.9) does not enforce: an output could break them, so a schema using one is refused
UNSUPPORTED_KEYWORDS = ("patternProperties", "propertyNames", "not", "if", "then", "else", "dependentSchemas",
                        "dependentRequired", "dependencies", "unevaluatedProperties", "unevaluatedItems",
                        "contains", "minContains", "maxContains", "uniqueItems")
# where a schema holds schemas: keyword -> how (one schema, a list of them, or a name -> schema map)
_ONE = ("additionalProperties", "items", "additionalItems", "contains")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "$defs", "definitions")


def _length(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise GrammarError(f"{key} must be a non-negative integer, got {value!r:.40}")
    return value


def strings_as_patterns(schema: Any, counted: list[int] | None = None, depth: int = 0, root: Any = None) -> Any:
    """``schema`` with each string schema (with no ``pattern``, ``format``, ``enum`` or ``const`` of its own)
    given the ``pattern`` of its ``minLength`` / ``maxLength`` (none: any length) instead: the same strings,
    counted in characters, written as valid JSON. xgrammar (0.2.9) lets a length-bounded string hold raw
    control characters, which no JSON parser accepts (RFC 8259 §7), and its "any character" admits the
    3-byte forms of surrogates, which decode as three replacement characters (a string over its length);
    its strings with a pattern follow the pattern. Only the places that hold schemas are walked (not
    ``const``, ``enum``, ``default`` or ``examples`` values).

    Combinators and ``$ref`` siblings are first put in a form xgrammar enforces
    (:func:`~mm_serve.runtime.schema_combinators.enforceable`; ``root`` is the whole schema, for ``$ref``).

    Raises:
        GrammarError: a keyword in :data:`UNSUPPORTED_KEYWORDS`, a ``$ref`` outside the schema, a length
            that is not a non-negative integer, more optional properties than :data:`MAX_OPTIONAL_PROPERTIES`
            in one object (:data:`MAX_OPTIONAL_PROPERTIES_TOTAL` in all), schemas nested deeper than
            :data:`MAX_SCHEMA_DEPTH`, a ``pattern`` with a lookaround or an anchor inside it, an integer bound
            past 64 bits, a combinator xgrammar would not enforce, a ``required`` property that the
            object's ``properties`` (if any) does not list (xgrammar enforces neither), or keywords it
            would not enforce together (:func:`_enforced_together`, which also rewrites the pairs it can).
    """
    counted = [0] if counted is None else counted
    if not isinstance(schema, dict):
        return schema
    root = schema if root is None else root
    if depth > MAX_SCHEMA_DEPTH:
        raise GrammarError(f"the schema nests schemas more than {MAX_SCHEMA_DEPTH} levels deep (its compile time "
                           "grows fast with the nesting)")
    schema = enforceable(schema, root)
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        check_pattern(pattern)
    _check_integer_bounds(schema)
    schema = _enforced_together(schema)
    for key in UNSUPPORTED_KEYWORDS:
        if key in schema:
            raise GrammarError(f"the JSON Schema keyword {key!r} is not supported by the grammar engine "
                               "(an output could break it)")
    ref = schema.get("$ref")
    if ref is not None and not (isinstance(ref, str) and ref.startswith("#")):
        raise GrammarError(f"only $ref within the schema (#/...) is supported, got {ref!r:.80}")
    properties = schema.get("properties")
    required = schema.get("required")
    required = required if isinstance(required, list) else []
    missing = [name for name in required if not isinstance(properties, dict) or name not in properties]
    if missing:
        raise GrammarError(f"required property {missing[0]!r:.60} is not in properties (the grammar engine "
                           "would leave it out)")
    if isinstance(properties, dict):
        optional = len(set(properties) - set(required))
        counted[0] += optional
        if optional > MAX_OPTIONAL_PROPERTIES or counted[0] > MAX_OPTIONAL_PROPERTIES_TOTAL:
            raise GrammarError(f"too many optional properties to compile in bounded time ({optional} in one "
                               f"object, {counted[0]} so far; at most {MAX_OPTIONAL_PROPERTIES} and "
                               f"{MAX_OPTIONAL_PROPERTIES_TOTAL}): list more of them in required")
    out = dict(schema)
    deeper = depth + 1
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = strings_as_patterns(out[key], counted, deeper, root)
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [strings_as_patterns(item, counted, deeper, root) for item in out[key]]
    if isinstance(out.get("items"), list):  # draft-4 tuple form
        out["items"] = [strings_as_patterns(item, counted, deeper, root) for item in out["items"]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: strings_as_patterns(sub, counted, deeper, root) for name, sub in out[key].items()}
    if out.get("type") == "string" and not {"pattern", "format", "enum", "const"} & set(out):
        out["pattern"] = _repeated(_JSON_CHAR, out.pop("minLength", 0), out.pop("maxLength", None))
    return out


def _repeated(atom: str, low: Any, high: Any, at_least: int = 0) -> str:
    """The pattern of ``atom`` (one character) repeated ``minLength`` ``low`` (at least ``at_least``) to
    ``maxLength`` ``high`` (None: no bound) times.

    Raises:
        GrammarError: a bound that is not a non-negative integer, or ``high`` below ``low``.
    """
    low = max(_length(low, "minLength"), at_least)
    high = None if high is None else _length(high, "maxLength")
    if high is not None and high < low:
        raise GrammarError(f"maxLength ({high}) is below minLength ({low})")
    return f"^{atom}{{{low},{'' if high is None else high}}}$"


def check_pattern(pattern: str) -> None:
    """Refuse a regular expression xgrammar would not enforce as written.

    Raises:
        GrammarError: a lookaround assertion (ignored by xgrammar), or ``^`` / ``$`` outside a character
            class anywhere but at the start / end of the pattern or of an alternative (``(^a|^b)$``):
            xgrammar reads an anchor as nothing, so ``a^b``, which matches no string, produced ``ab``.
    """
    if _SURROGATE_ESCAPE.search(pattern):
        raise GrammarError(f"the pattern {pattern!r:.80} escapes a lone surrogate (\\uD800-\\uDFFF), which is no "
                           "character (its output would not be valid UTF-8)")
    if _LOOKAROUND.search(pattern):
        raise GrammarError(f"the pattern {pattern!r:.80} has a lookaround assertion, which the grammar engine "
                           "does not enforce")
    in_class, i = False, 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":  # an escaped character, whatever it is
            i += 2
            continue
        if in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
            i += 1
            i += pattern[i: i + 1] == "^"  # a negated class
            i += pattern[i: i + 1] == "]"  # a ] first in a class is one of its members
            continue
        elif (char == "^" and i > 0 and pattern[i - 1] not in "(|") or (
                char == "$" and i < len(pattern) - 1 and pattern[i + 1] not in ")|"):
            raise GrammarError(f"the pattern {pattern!r:.80} has an anchor ({char}) inside it, which the grammar "
                               "engine does not enforce; anchors may only start (^) or end ($) a pattern or "
                               "one of its alternatives")
        i += 1


_INT64 = 2**63


def _check_integer_bounds(schema: dict[str, Any]) -> None:
    types = schema.get("type")
    if types != "integer" and not (isinstance(types, list) and "integer" in types):
        return
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        value = schema.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and not -_INT64 <= value < _INT64:
            raise GrammarError(f"{key} {value!r:.40} of an integer is outside the 64-bit range the grammar engine "
                               "handles")


_RANGE = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
MAX_MULTIPLES = 1024  # multipleOf within a range is compiled as the enum of the multiples, up to this many
FORMAT_LENGTHS_MET = 255  # a formatted string's maxLength from here on is not enforced (pydantic's HttpUrl: 2083)
# a pattern that is one character class repeated (pydantic's Field(pattern=..., min_length=..., max_length=...)):
# its length bounds can be written into it
_REPEATED_CLASS = re.compile(r"\^(\[(?:[^\]\\]|\\.)+\]|\\[wdsWDS]|\.)([+*])\$")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")  # \ud800 in a regex or EBNF: no character


def _is_string(types: Any) -> bool:
    return types is None or types == "string" or (isinstance(types, list) and "string" in types)


def _enforced_together(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with keyword pairs that xgrammar (0.2.9) compiles by keeping one and ignoring the other
    written in a form it enforces, or refused:

    - ``multipleOf`` of an integer within a finite range: the enum of its multiples there (at most
      :data:`MAX_MULTIPLES`); beside a half-open range, or on anything but ``type: "integer"``: refused;
    - a string's ``pattern`` with length bounds: a pattern that repeats one character class
      (``^[a-z0-9_]+$``) takes the bounds as its repeat count; any other pattern: refused;
    - a string's ``format`` with length bounds: a ``minLength`` up to 1 is met by every formatted string and
      a ``maxLength`` of :data:`FORMAT_LENGTHS_MET` or more is left unenforced (pydantic's ``AnyUrl`` /
      ``HttpUrl``: 1 and 2083); tighter bounds, or ``format`` with ``pattern``: refused;
    - an empty ``type`` list, and ``enum`` / ``const`` values the rest of the schema refuses (only the
      values are enforced): refused.

    Raises:
        GrammarError: naming the keywords.
    """
    types = schema.get("type")
    if types == []:
        raise GrammarError("type is an empty list: no value has a type in it")
    out = dict(schema)
    if "multipleOf" in out:
        out = _multiples(out)
    if _is_string(types):
        lengths = [key for key in ("minLength", "maxLength") if key in out]
        if "format" in out and "pattern" in out:
            raise GrammarError("a string's format and pattern together are not enforced by the grammar engine "
                               "(it keeps one only): write the format into the pattern")
        if "format" in out and lengths:
            if _length(out.get("minLength", 0), "minLength") > 1 or \
                    _length(out.get("maxLength", FORMAT_LENGTHS_MET), "maxLength") < FORMAT_LENGTHS_MET:
                raise GrammarError(f"a string's format and {' / '.join(lengths)} together are not enforced by the "
                                   "grammar engine (it keeps the format only): write them into a pattern")
            out.pop("minLength", None)
            out.pop("maxLength", None)
        elif isinstance(out.get("pattern"), str) and lengths:
            out["pattern"] = _bounded_pattern(out.pop("pattern"), out.pop("minLength", 0), out.pop("maxLength", None))
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    rest = {key: value for key, value in schema.items() if key not in ("enum", "const")}
    if isinstance(values, list) and rest and "$ref" not in json.dumps(rest):
        from jsonschema import Draft202012Validator, SchemaError

        try:
            Draft202012Validator.check_schema(rest)
            validator = Draft202012Validator(rest, format_checker=Draft202012Validator.FORMAT_CHECKER)
            for value in values:
                error = next(validator.iter_errors(value), None)
                if error is not None:
                    raise GrammarError(f"{'const' if 'const' in schema else 'enum'} value {json.dumps(value):.40} "
                                       f"breaks the schema's {error.validator} ({error.message:.80}); the grammar "
                                       "engine would enforce the value only")
        except SchemaError as exc:
            raise GrammarError(f"the schema is not valid: {exc.message:.120}") from None
    return out


def _multiples(schema: dict[str, Any]) -> dict[str, Any]:
    """An integer schema's ``multipleOf`` within its range as the enum of the multiples (see
    :func:`_enforced_together`)."""
    step, types = schema["multipleOf"], schema.get("type")
    if types != "integer" or isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise GrammarError("multipleOf is enforced on integers only (type: \"integer\", a whole multipleOf "
                           f"> 0), got type {json.dumps(types):.40} and multipleOf {json.dumps(step):.40}")
    if not any(key in schema for key in _RANGE):
        return schema
    low = max([math.ceil(schema[k] + (k == "exclusiveMinimum")) for k in ("minimum", "exclusiveMinimum")
               if isinstance(schema.get(k), int | float) and not isinstance(schema.get(k), bool)], default=None)
    high = min([math.floor(schema[k] - (k == "exclusiveMaximum")) for k in ("maximum", "exclusiveMaximum")
                if isinstance(schema.get(k), int | float) and not isinstance(schema.get(k), bool)], default=None)
    if low is None or high is None or (high - low) // step + 1 > MAX_MULTIPLES:
        raise GrammarError(f"multipleOf beside a range is enforced where the range holds at most {MAX_MULTIPLES} "
                           "multiples (compiled as their enum): give both bounds, closer together")
    first = -(-low // step) * step
    multiples = list(range(first, high + 1, step))
    if not multiples:
        raise GrammarError(f"no multiple of {step} lies in the range {low}..{high}")
    out = {key: value for key, value in schema.items() if key not in (*_RANGE, "multipleOf")}
    out["enum"] = multiples
    return out


def _bounded_pattern(pattern: str, low: Any, high: Any) -> str:
    """``pattern``, one character class repeated, with the length bounds as its repeat count."""
    match = _REPEATED_CLASS.fullmatch(pattern)
    if match is None:
        raise GrammarError(f"a string's pattern {pattern!r:.60} and its minLength / maxLength together are not "
                           "enforced by the grammar engine (it keeps the pattern only): write the length into the "
                           "pattern, e.g. ^[a-z]{3,16}$")
    atom, repeat = match.groups()
    return _repeated(atom, low, high, at_least=1 if repeat == "+" else 0)


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (each a string literal: quotes, backslashes and
    control characters escaped)."""
    def literal(text: str) -> str:
        out = []
        for ch in text:
            if ch in '"\\':
                out.append("\\" + ch)
            elif ord(ch) < 0x20 or ord(ch) == 0x7F:
                out.append(f"\\x{ord(ch):02x}")
            else:
                out.append(ch)
        return '"' + "".join(out) + '"'

    return "root ::= " + " | ".join(literal(c) for c in choices)


def _fast_tokenizer(model_dir: Path) -> Any:
    """The checkpoint's tokenizer for xgrammar's vocabulary: straight from its ``tokenizer.json`` when it has
    one (a millisecond; ``AutoTokenizer`` takes ~2 s resolving the checkpoint's configs, inside a worker's
    step), else through ``AutoTokenizer``."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if (model_dir / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    return AutoTokenizer.from_pretrained(str(model_dir))


def _choices(text: str) -> list[str]:
    """The strings of a ``choice`` spec's text (a JSON list of them).

    Raises:
        GrammarError: not JSON, or not a non-empty list of non-empty strings.
    """
    try:
        choices = json.loads(text)
    except ValueError as exc:
        raise GrammarError(f"the choices are not JSON: {exc}") from None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise GrammarError("the choices must be a non-empty list of non-empty strings (as guided_choice)")
    return choices


@functools.lru_cache(maxsize=256)
def _rewritten_schema(text: str) -> str:
    """A JSON schema's text as compiled (:func:`strings_as_patterns`), once per schema: xgrammar's cache is
    keyed by this text, so a schema seen before costs a lookup, not a walk.

    Raises:
        GrammarError: as :func:`strings_as_patterns`.
        ValueError: ``text`` is not JSON.
    """
    return json.dumps(strings_as_patterns(json.loads(text)))


class GrammarBook:
    """One process's compiler (and its cache) and its requests' matchers, over ``model_dir``'s tokenizer.

    Built lazily: nothing is loaded until :meth:`warm_in_background` (at a process's start) or the first
    structured request (the vocabulary size is the logits' width, which may exceed the tokenizer's).

    Raises (:meth:`compile`, :meth:`matcher`):
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
        self._compiling: dict[tuple[GrammarSpec, int], threading.Event] = {}  # prefetches under way
        self._decoded: list[bytes] = []
        self._single_byte: dict[bytes, int] = {}
        self._slow: OrderedDict[GrammarSpec, None] = OrderedDict()  # specs that compiled too slowly (most recent last)
        # seconds the steps spent setting up structured outputs, in all: importing xgrammar, building matchers
        # (the compiler's first load, a compile or the rest of its prefetch); a worker takes them out of the
        # step time it reports, which the admission predictor fits as model work
        self.setup_s = 0.0
        self._xgrammar: Any = None
        self._warm_guard = threading.Condition()  # the background warm-up against close()
        self._warming = False  # a background warm-up is building the compiler
        self._closed = False  # close() was called: no background warm-up starts

    def warm(self, vocab_size: int) -> None:
        """Build the compiler for ``vocab_size``-wide logits now (the vocabulary's tables: up to seconds for a
        large vocabulary), so that a later compile's time is the grammar's own."""
        self._compiler_for(vocab_size)

    def warm_in_background(self, vocab_size: int, after: threading.Event | None = None,
                           wanted: Callable[[], bool] | None = None) -> threading.Thread:
        """:meth:`warm` on a daemon thread of its own, once ``after`` is set (None: now) and if ``wanted()``
        says so then (None: always) and :meth:`close` was not called: a worker or the API process at start,
        so that its first structured request does not pay for importing xgrammar and building the
        vocabulary's tables (~0.7 s on a 2-core CPU). It runs at the process's priority: a structured
        request that comes meanwhile waits for it (niced, it would starve behind a loaded CPU). A failure is
        left for the first structured request to raise (a checkpoint without a fast tokenizer serves
        everything else). Returns the thread."""
        def run() -> None:
            if after is not None:
                after.wait()
            with self._warm_guard:
                if self._closed or (wanted is not None and not wanted()):
                    return
                self._warming = True
            try:
                self.warm(vocab_size)
            except Exception:  # noqa: BLE001 - raised again, with its reason, by the first structured request
                pass
            finally:
                with self._warm_guard:
                    self._warming = False
                    self._warm_guard.notify_all()

        thread = threading.Thread(target=run, name="grammar-warm", daemon=True)
        thread.start()
        return thread

    def close(self, timeout_s: float = 30.0) -> None:
        """Before the process exits: no background warm-up starts from now on, and one under way is waited
        for, up to ``timeout_s`` seconds (a process that exits in its middle is aborted by native code:
        "terminate called without an active exception", SIGABRT)."""
        with self._warm_guard:
            self._closed = True
            self._warm_guard.wait_for(lambda: not self._warming, timeout_s)

    def mark_slow(self, spec: GrammarSpec) -> None:
        """Remember that ``spec`` took too long to compile (the last :data:`SLOW_REMEMBERED` such specs)."""
        with self._lock:
            self._slow[spec] = None
            self._slow.move_to_end(spec)
            while len(self._slow) > SLOW_REMEMBERED:
                self._slow.popitem(last=False)

    def known_slow(self, spec: GrammarSpec) -> bool:
        """Whether ``spec`` was marked by :meth:`mark_slow`."""
        with self._lock:
            return spec in self._slow

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
                self._decoded = [bytes(piece) for piece in info.decoded_vocab]  # each token's bytes as written
                self._single_byte = {piece: i for i, piece in enumerate(self._decoded) if len(piece) == 1}
            return self._compiler

    def prefetch(self, request: Request, vocab_size: int) -> None:
        """Start compiling ``request``'s grammar (if it has one) on a thread of its own, when the request
        reaches the worker, so that its first sampling finds it compiled, or waits only for the rest,
        instead of compiling inside the step every request of the batch waits for (xgrammar compiles
        without the GIL; vLLM compiles asynchronously too). A spec compiled before is a cache hit."""
        spec = request.sampling_params.structured
        if spec is None or request.grammar_matcher is not None:
            return
        key = (spec, vocab_size)
        with self._lock:
            if key in self._compiling:
                return
            done = threading.Event()
            self._compiling[key] = done

        def run() -> None:
            try:
                self._compile_now(spec, vocab_size)
            except GrammarError:
                pass  # raised again, with its reason, where the request samples
            finally:
                with self._lock:
                    self._compiling.pop(key, None)
                done.set()

        threading.Thread(target=run, name="grammar-prefetch", daemon=True).start()

    def compile(self, spec: GrammarSpec, vocab_size: int) -> Any:
        """The compiled grammar of ``spec`` for a ``vocab_size``-wide logits row (cached by the compiler),
        after the :meth:`prefetch` of it under way, if any, has finished.

        Raises:
            GrammarError: an unknown kind, or the spec does not compile (xgrammar's reason in the message).
        """
        with self._lock:
            pending = self._compiling.get((spec, vocab_size))
        if pending is not None:
            pending.wait()
        return self._compile_now(spec, vocab_size)

    def check_start(self, spec: GrammarSpec, vocab_size: int) -> None:
        """Check that some output can start under ``spec``'s grammar (compiled first: :meth:`compile`): it
        allows a first token of the ``vocab_size`` ones, or is complete when empty. ``root ::= root``, a rule
        that derives no string, or a regex of a character no token writes compiles and allows nothing.

        Raises:
            GrammarAllowsNothing: it allows no first token and is not complete when empty.
            GrammarError: as :meth:`compile`.
        """
        compiled = self.compile(spec, vocab_size)
        xgrammar = self._xgrammar_module()
        matcher = xgrammar.GrammarMatcher(compiled, terminate_without_stop_token=True)
        if matcher.is_terminated():
            return
        bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
        matcher.fill_next_token_bitmask(bitmask)
        if not bool(bitmask.any()):
            raise GrammarAllowsNothing("no token of the vocabulary can start an output it accepts (a rule that "
                                       "derives no string, such as root ::= root, or a character no token writes)")

    def _compile_now(self, spec: GrammarSpec, vocab_size: int) -> Any:
        kind, text = spec
        if kind == "choice":
            kind, text = "grammar", choice_ebnf(_choices(text))
        try:
            text.encode("utf-8")  # xgrammar takes UTF-8: a lone surrogate (JSON's "\ud800") has none
        except UnicodeEncodeError as exc:
            raise GrammarError(f"the {spec[0]} holds {text[exc.start]!r}, a lone surrogate (half of a UTF-16 "
                               "pair), which is no Unicode character") from None
        compiler = self._compiler_for(vocab_size)
        try:
            if kind == "json":
                try:
                    schema = _rewritten_schema(text)
                except GrammarError:
                    raise
                except ValueError as exc:  # json's
                    raise GrammarError(f"the schema is not JSON: {exc}") from None
                return compiler.compile_json_schema(schema, any_whitespace=False)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                check_pattern(text)
                return compiler.compile_regex(text)
            if kind == "grammar":
                if _SURROGATE_ESCAPE.search(text):
                    raise GrammarError("the grammar escapes a lone surrogate (\\uD800-\\uDFFF), which is no "
                                       "character (its output would not be valid UTF-8)")
                return compiler.compile_grammar(text)
        except RuntimeError as exc:  # xgrammar's message; it gives none for, e.g., an integer past a double's range
            lines = str(exc).strip().splitlines()
            raise GrammarError(_LOCATION.sub("", lines[0]) if lines else
                               f"the {kind} cannot be compiled to a grammar (a number past a double's range?)") from None
        raise GrammarError(f"unknown grammar kind {kind!r}; known: {', '.join(GRAMMAR_KINDS)}")

    def matcher(self, request: Request, vocab_size: int) -> Any:
        """``request``'s matcher, built on first use and fed every output it has had (earlier attempts'
        too); it ends on the request's stop tokens (EOS folded in unless ``ignore_eos``), or, with none,
        as soon as the grammar is complete.

        Raises:
            GrammarError: as :meth:`compile`; or an output the grammar does not accept (a request whose
                outputs were not made under this grammar).
        """
        state = request.grammar_matcher
        if state is not None:
            return state
        xgrammar = self._xgrammar_module()  # its import is counted there
        started = time.monotonic()
        try:
            return self._new_matcher(xgrammar, request, vocab_size)
        finally:
            self.setup_s += time.monotonic() - started

    def _new_matcher(self, xgrammar: Any, request: Request, vocab_size: int) -> Any:
        params = request.sampling_params
        assert params.structured is not None
        stops = self._matcher_stops(request)
        matcher = xgrammar.GrammarMatcher(self.compile(params.structured, vocab_size),
                                          override_stop_tokens=stops or None, terminate_without_stop_token=not stops)
        closing = JsonClosing(object_only=True) if params.structured[0] == "json_object" else None
        for token in split_outputs(request)[1]:
            if not matcher.accept_token(token):
                raise GrammarError(f"output token {token} of {request.request_id!r} is outside its grammar")
            if closing is not None and token < len(self._decoded):
                closing.feed(self._decoded[token])
        request.grammar_matcher, request.json_closing = matcher, closing
        return matcher

    def _xgrammar_module(self) -> Any:
        """xgrammar, imported on first use (its import, ~0.3 s, counted in :attr:`setup_s`)."""
        if self._xgrammar is None:
            started = time.monotonic()
            import xgrammar

            self._xgrammar = xgrammar
            self.setup_s += time.monotonic() - started
        return self._xgrammar

    def mask(self, logits: torch.Tensor, batch: list[Request]) -> None:
        """Set to ``-inf``, in ``logits`` ``[B, V]`` (float32, in place), every token the grammar of a
        structured request of ``batch`` does not allow next (other rows are left as they are).

        Rows that would have no token to draw (masked whole, the sampler would pick token 0) are left
        unmasked, and their requests end in :func:`~mm_serve.runtime.post_step.process_step` with no token:

        - ``grammar_complete``: the grammar is complete already (it allows only an empty output and the
          request has no stop token); the request ends as stopped;
        - ``grammar_failure``: the grammar cannot go on: it allows no token next and is not complete (a rule
          that derives no string, ``root ::= "a" b`` with ``b ::= b``, or a character no token of the
          vocabulary writes), or the request's matcher cannot be built from its outputs (raised, that
          GrammarError would fail the step of the whole batch); the request ends with that error, alone."""
        rows = [i for i, r in enumerate(batch) if r.sampling_params.structured is not None
                and r.grammar_failure is None and not r.grammar_complete]
        if not rows:
            return
        xgrammar = self._xgrammar_module()
        vocab = logits.shape[-1]
        bitmask = xgrammar.allocate_token_bitmask(len(batch), vocab)
        live = []
        for i in rows:
            request = batch[i]
            try:
                matcher = self.matcher(request, vocab)
            except GrammarError as exc:
                request.grammar_failure = f"its grammar does not accept its own output: {exc}"
                continue
            if matcher.is_terminated():  # complete before any token (only an empty output, no stop token): it ends
                request.grammar_complete = True
                continue
            matcher.fill_next_token_bitmask(bitmask, i)
            if bool(bitmask[i].any()):
                live.append(i)
            else:
                request.grammar_failure = (f"its grammar allows no token after its {len(request.output_token_ids)} "
                                           "output token(s): no output can complete it (a rule that derives no "
                                           "string, or a character no token of the vocabulary writes)")
        if live:
            xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=live)

    def accept(self, batch: list[Request], tokens: list[int]) -> list[int]:
        """Feed each structured request's sampled token to its matcher (after :meth:`mask`); returns the
        tokens, where a ``json_object`` request's would leave too few tokens to close its JSON, the first
        byte of the shortest closing instead (:meth:`_closable`)."""
        out = list(tokens)
        for i, (request, token) in enumerate(zip(batch, tokens, strict=True)):
            matcher: Any = request.grammar_matcher
            if matcher is None or matcher.is_terminated() or request.grammar_failure is not None:
                continue
            spec = request.sampling_params.structured
            if spec is not None and spec[0] == "json_object":
                out[i] = token = self._closable(request, token)
            matcher.accept_token(token)
        return out

    def _closable(self, request: Request, token: int) -> int:
        """``token``, or the token of the next byte of the shortest closing of ``request``'s JSON when after
        ``token`` that closing would no longer fit in the tokens left (one byte per token): so a
        ``json_object`` output is always complete JSON by its ``max_tokens``
        (:mod:`mm_serve.runtime.json_closing`), unless ``max_tokens`` is below 2. An output closed so ends
        as ``length``, as any output the budget ended, also where the closing completed a token early and
        the stop token the grammar then allows came last (``request.json_closed_by_budget``)."""
        closing = request.json_closing
        assert isinstance(closing, JsonClosing)  # built with the matcher
        left = request.sampling_params.max_tokens - len(request.output_token_ids) - 1  # tokens after this one
        trial = closing.clone()
        trial.feed(self._decoded[token] if token < len(self._decoded) else b"")
        rest = closing.rest()
        forced = self._single_byte.get(rest[:1])
        if len(trial.rest()) <= left or not rest or forced is None:
            request.json_closing = trial
            return token
        closing.feed(rest[:1])
        request.json_closed_by_budget = True
        return forced

    def _matcher_stops(self, request: Request) -> list[int]:
        """The tokens that end ``request``'s output (EOS folded in unless ``ignore_eos``)."""
        params = request.sampling_params
        return sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids)))
