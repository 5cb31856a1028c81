"""Grammar-constrained decoding in the engine: the same tokens colocated and disaggregated (the first token
sampled on the prefill worker under the grammar, the rest on the decode worker, whose matcher is rebuilt
from it), with requests preempted and recomputed; every output parses and validates; and the schema rewrite
that keeps xgrammar's strings valid JSON."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from mm_serve import LLM, SamplingParams
from mm_serve.runtime.structured_output import (
    GrammarBook,
    GrammarError,
    choice_ebnf,
    strings_as_patterns,
)
from tests.schemas_gen import random_schema

PROMPT = {"messages": [{"role": "user", "content": "Describe the scene as JSON."}]}
N = 24


def _params(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=150, temperature=0.0 if seed % 3 == 0 else 1.0, seed=seed,
                          structured=("json", json.dumps(random_schema(seed))))


@pytest.fixture(scope="module")
def colocated(tiny_llava: Path) -> list[list[int]]:
    llm = LLM(tiny_llava, mode="colocated")
    outputs = llm.generate([PROMPT] * N, [_params(s) for s in range(N)])
    for seed, out in enumerate(outputs):
        assert out.finish_reason == "stop", (seed, out.text)
        jsonschema.validate(json.loads(out.text), random_schema(seed))
        assert "\ufffd" not in out.text
    return [o.token_ids for o in outputs]


def test_disaggregated_and_preempted_requests_give_the_colocated_tokens(tiny_llava: Path,
                                                                          colocated: list[list[int]]) -> None:
    """A decode pool of 48 four-token pages (one long request and a little): requests are preempted and
    recompute, their matchers kept."""
    with LLM(tiny_llava, mode="disaggregated", num_pages=48, page_size=4) as llm:
        outputs = llm.generate([PROMPT] * N, [_params(s) for s in range(N)])
        assert llm.client is not None
        preempted = llm.client.query_stats()[("decode", 0)].num_preemptions
    assert [o.token_ids for o in outputs] == colocated
    assert preempted > 0


def test_strings_are_compiled_as_patterns_of_json_characters() -> None:
    schema = {"type": "object", "properties": {
        "a": {"type": "string", "maxLength": 3}, "b": {"type": "string"}, "c": {"type": "string", "enum": ["x"]},
        "d": {"type": "array", "items": {"type": "string", "minLength": 2, "maxLength": 2}}}}
    out = strings_as_patterns(schema)
    assert out["properties"]["a"]["pattern"].endswith("{0,3}$") and "maxLength" not in out["properties"]["a"]
    assert out["properties"]["b"]["pattern"].endswith("{0,}$")
    assert out["properties"]["c"] == {"type": "string", "enum": ["x"]}
    pattern = re.compile(out["properties"]["d"]["items"]["pattern"])
    assert pattern.fullmatch('ab') and pattern.fullmatch('\\"\\u00e9') and pattern.fullmatch("é😀")
    assert not pattern.fullmatch("a\x0b") and not pattern.fullmatch('a"') and not pattern.fullmatch("abc")


def test_choices_are_escaped_and_bad_grammars_name_the_problem(tiny_llava: Path) -> None:
    assert choice_ebnf(['say "hi"', "a\\b\n"]) == 'root ::= "say \\"hi\\"" | "a\\\\b\\x0a"'
    book = GrammarBook(tiny_llava)
    book.compile(("choice", json.dumps(['say "hi"', "a\\b\n"])), 512)
    with pytest.raises(GrammarError, match="frobnicate"):
        book.compile(("json", '{"type": "frobnicate"}'), 512)
    with pytest.raises(GrammarError, match="parenthesis"):
        book.compile(("regex", "a(b"), 512)
    # xgrammar raises with no message for a number past a double's range: still a GrammarError (it was
    # an IndexError, a 500)
    with pytest.raises(GrammarError, match="cannot be compiled"):
        book.compile(("json", '{"type": "number", "maximum": 1' + "0" * 320 + "}"), 512)
    with pytest.raises(GrammarError, match="outside the 64-bit range"):  # an integer's: named before xgrammar
        book.compile(("json", '{"type": "integer", "maximum": 1' + "0" * 320 + "}"), 512)


def test_a_prefetched_grammar_is_compiled_off_the_step_and_a_bad_one_fails_where_it_samples(tiny_llava: Path) -> None:
    """``prefetch`` compiles on a thread of its own: the matcher built after it needs no compile of its own
    (the thread is gone and the compiler's cache holds the grammar); a spec that does not compile is not
    raised by the prefetch, but by the matcher, with xgrammar's reason."""
    import threading

    from mm_serve.runtime.request import Request

    book = GrammarBook(tiny_llava)
    good = Request("good", [1, 2, 3], SamplingParams(max_tokens=8, structured=("json", json.dumps(random_schema(5)))))
    bad = Request("bad", [1, 2, 3], SamplingParams(max_tokens=8, structured=("json", '{"type": "frobnicate"}')))
    for request in (good, bad):
        book.prefetch(request, 512)
    assert any(t.name == "grammar-prefetch" for t in threading.enumerate()) or not book._compiling
    matcher = book.matcher(good, 512)
    assert not matcher.is_terminated() and not book._compiling.get((good.sampling_params.structured, 512))
    with pytest.raises(GrammarError, match="frobnicate"):
        book.matcher(bad, 512)
    book.prefetch(good, 512)  # it has its matcher: nothing to do
    assert not book._compiling


def test_the_compiler_is_warmed_in_the_background_once_the_event_is_set(tiny_llava: Path, tmp_path: Path) -> None:
    """A process warms its compiler on a thread of its own once ``after`` is set (a worker once it has
    reported ready); a checkpoint whose tokenizer cannot be read leaves the error to the first structured
    request."""
    import threading
    import time

    gate = threading.Event()
    book = GrammarBook(tiny_llava)
    thread = book.warm_in_background(512, after=gate)
    thread.join(0.3)
    assert thread.is_alive() and book._compiler is None
    gate.set()
    thread.join(60)
    assert not thread.is_alive() and book._compiler is not None and book._vocab == 512
    broken = GrammarBook(tmp_path)
    broken.warm_in_background(512).join(60)
    assert broken._compiler is None
    with pytest.raises(ValueError, match="tokenizer"):  # transformers' reason
        broken.warm(512)
    unwanted = GrammarBook(tiny_llava)  # the API process's after a start that failed: no warm-up
    unwanted.warm_in_background(512, wanted=lambda: False).join(60)
    assert unwanted._compiler is None
    closing, gate = GrammarBook(tiny_llava), threading.Event()
    late = closing.warm_in_background(512, after=gate)
    closing.close()  # nothing under way: returns at once, and none starts after it
    gate.set()
    late.join(60)
    assert closing._compiler is None
    busy = GrammarBook(tiny_llava)
    busy.warm_in_background(512)
    while not busy._warming and busy._compiler is None:  # until it has begun
        time.sleep(0.001)
    busy.close()  # waits for the warm-up under way (the process exits next)
    assert busy._compiler is not None and not busy._warming


def test_a_grammar_with_no_token_next_ends_its_request_alone(tiny_llava: Path) -> None:
    """A grammar that allows a letter and then nothing: at its dead end its request gets no token, ends
    ``FINISHED_ABORTED`` and reports finish ``error`` with the reason, its row left unmasked (masked, a
    sampled draw from it had no token at all); its batch-mates are masked and go on. A request whose own
    outputs its grammar refuses (a matcher rebuilt after a migration) ends the same way."""
    import torch

    from mm_serve.runtime.post_step import StopCriteria, process_step, token_update
    from mm_serve.runtime.request import Request, RequestStatus

    def finish(request: Request, status: RequestStatus) -> None:
        request.status = status

    book = GrammarBook(tiny_llava)
    dead = Request("dead", [1, 2, 3], SamplingParams(max_tokens=8, structured=("grammar", "root ::= [a-z] r\nr ::= r")))
    live = Request("live", [1, 2, 3], SamplingParams(max_tokens=8, structured=("regex", "[a-z]+"), stop_token_ids=[2]))
    plain = Request("plain", [1, 2, 3], SamplingParams(max_tokens=8))
    refused = Request("refused", [1, 2, 3], SamplingParams(max_tokens=8, structured=("regex", "[a-z]+")))
    refused.output_token_ids = [0]  # not a letter
    batch, criteria = [dead, live, plain], StopCriteria(frozenset(), 1000)
    logits = torch.zeros(3, 512)
    book.mask(logits, batch)
    letter = int(torch.argmax(logits[0]))
    assert dead.grammar_failure is None and torch.isinf(logits[0]).sum() > 0
    assert process_step(batch, book.accept(batch, [letter, letter, 7]), [None] * 3, criteria, finish) == []
    batch.append(refused)
    logits = torch.zeros(4, 512)
    book.mask(logits, batch)
    assert dead.grammar_failure is not None and "allows no token after its 1 output token(s)" in dead.grammar_failure
    assert refused.grammar_failure is not None and "does not accept its own output" in refused.grammar_failure
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[3]).all() and torch.isfinite(logits[2]).all()
    assert torch.isinf(logits[1]).sum() > 0
    finished = process_step(batch, book.accept(batch, [5, letter, 7, 5]), [None] * 4, criteria, finish)
    assert finished == [dead, refused] and dead.status is RequestStatus.FINISHED_ABORTED
    assert dead.output_token_ids == [letter] and live.output_token_ids == [letter, letter]
    update = token_update(dead)
    assert (update.finish_reason, update.error, update.token_ids) == ("error", dead.grammar_failure, [letter])
    assert token_update(live).finish_reason is None


def test_a_grammar_complete_when_empty_ends_its_request_with_no_token(tiny_llava: Path) -> None:
    """``root ::= ""`` without a stop token (``ignore_eos``): nothing may follow, so the request ends with no
    output (its all-masked row drew token 0, outside the grammar); with EOS it ends on EOS."""
    llm = LLM(tiny_llava, mode="colocated")
    empty = SamplingParams(max_tokens=8, ignore_eos=True, structured=("grammar", 'root ::= ""'))
    out = llm.generate([PROMPT, PROMPT], [empty, SamplingParams(max_tokens=3, ignore_eos=True)])
    assert (out[0].token_ids, out[0].text, out[0].finish_reason) == ([], "", "stop")
    assert len(out[1].token_ids) == 3
    with_eos = llm.generate(PROMPT, SamplingParams(max_tokens=8, structured=("grammar", 'root ::= ""')))[0]
    assert with_eos.finish_reason == "stop" and len(with_eos.token_ids) == 1 and with_eos.text == ""


def test_the_offline_api_fails_a_call_whose_grammar_dead_ends_and_serves_the_next(tiny_llava: Path) -> None:
    """In-process (colocated), as with workers: ``generate`` raises with the reason, the engine keeps no
    request of the call, and the next call is served."""
    llm = LLM(tiny_llava, mode="colocated")
    dead = SamplingParams(max_tokens=8, structured=("grammar", "root ::= [a-z] r\nr ::= r"))
    with pytest.raises(RuntimeError, match="1 request\\(s\\) failed: its grammar allows no token after its 1"):
        llm.generate([PROMPT, PROMPT], [dead, SamplingParams(max_tokens=8)])
    assert llm.engine is not None and not llm.engine.has_unfinished() and not llm.engine.requests
    assert len(llm.generate(PROMPT, SamplingParams(max_tokens=5, ignore_eos=True))[0].token_ids) == 5


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_the_offline_api_refuses_grammars_before_anything_runs_and_serves_on(tiny_llava: Path, mode: str) -> None:
    """As the server's 400s: a grammar that does not compile (a schema or choices that are not JSON: they
    raised a bare JSONDecodeError in the colocated engine's step and left it failing every later call) or
    that allows no output is an InvalidRequestError before anything runs; the next call is served."""
    from mm_serve.inputs.input_processor import InvalidRequestError

    with LLM(tiny_llava, mode=mode) as llm:
        for spec, words in [(("json", "{bad"), "cannot be compiled: the schema is not JSON"),
                            (("choice", "not json"), "cannot be compiled: the choices are not JSON"),
                            (("choice", "[]"), "a non-empty list of non-empty strings"),
                            (("choice", '[""]'), "a non-empty list of non-empty strings"),
                            (("grammar", "root ::= ("), "the grammar cannot be compiled"),
                            (("grammar", "root ::= root"), "the grammar allows no output")]:
            with pytest.raises(InvalidRequestError, match=re.escape(words)) as caught:
                llm.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, structured=spec)])
            assert caught.value.param == "structured"
        out = llm.generate(PROMPT, SamplingParams(max_tokens=5, ignore_eos=True))[0]
        assert len(out.token_ids) == 5


def test_the_setup_a_worker_takes_out_of_its_step_time_is_counted_once_per_matcher(tiny_llava: Path) -> None:
    """``setup_s`` adds the seconds spent importing xgrammar and building a request's matcher (the
    compiler's first load and the compile: the first structured request's decode step took 0.68 s, and
    the admission predictor fitted it as model work); a matcher already built costs nothing more."""
    import time

    from mm_serve.runtime.request import Request

    book = GrammarBook(tiny_llava)
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=8, structured=("json", json.dumps(random_schema(7)))))
    started = time.monotonic()
    book.matcher(request, 512)
    took = time.monotonic() - started
    assert 0 < book.setup_s <= took
    before = book.setup_s
    book.matcher(request, 512)
    assert book.setup_s == before


@pytest.mark.parametrize("schema,compiled", [
    ({"type": "string", "format": "uri", "minLength": 1, "maxLength": 2083}, {"type": "string", "format": "uri"}),
    ({"type": "string", "minLength": 3, "maxLength": 16, "pattern": "^[a-z0-9_]+$"},
     {"type": "string", "pattern": "^[a-z0-9_]{3,16}$"}),
    ({"type": "string", "maxLength": 5, "pattern": "^\\w*$"}, {"type": "string", "pattern": "^\\w{0,5}$"}),
    ({"type": "integer", "multipleOf": 5, "exclusiveMinimum": 0, "maximum": 20},
     {"type": "integer", "enum": [5, 10, 15, 20]}),
    ({"type": "integer", "format": "int64", "maxLength": 3}, {"type": "integer", "format": "int64", "maxLength": 3}),
], ids=["HttpUrl", "constrained str", "max_length and a class", "multiple_of in a range", "lengths off strings"])
def test_pydantic_keyword_pairs_compile_in_a_form_the_grammar_enforces(schema: dict, compiled: dict) -> None:
    """pydantic writes keyword pairs xgrammar would compile by dropping one (a URL's format and lengths, a
    constrained string's pattern and lengths, multiple_of with ge / le): those it can are rewritten (the
    pattern takes the lengths, the multiples become an enum, a formatted string's loose lengths go), the
    others are refused (tests/api/test_structured_outputs_api.py)."""
    assert strings_as_patterns(schema) == compiled
