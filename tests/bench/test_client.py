"""The load client against a fake streaming server: timings, token counts, errors, early stop."""

from __future__ import annotations

import asyncio
import json

import pytest

from mm_serve.bench.client import Endpoint, run_load, run_sequential
from mm_serve.bench.requests import PlannedRequest, RequestFactory
from mm_serve.bench.runner import LoadRunner, LoadSpec
from mm_serve.ground.slo import SLO
from mm_serve.workloads import RequestSpec, make_workload
from tests.bench.fake_server import FakeServer


def plan(n: int, max_tokens: int, gap_s: float = 0.0) -> list[PlannedRequest]:
    factory = RequestFactory("fake-model")
    return factory.plan([RequestSpec(8, max_tokens)] * n, [i * gap_s for i in range(n)])


def test_timings_and_usage() -> None:
    with FakeServer(service_s=0.2, itl_s=0.05) as server:
        records = asyncio.run(run_sequential(Endpoint(server.url), plan(2, max_tokens=5)))
    for r in records:
        assert r.ok and r.output_tokens == 5 and r.prompt_tokens == 7
        # the server waits 0.2 s before the first token; above that is client, loop and
        # connection time, which a busy 2-core CI machine stretches
        assert 0.19 < r.ttft_s < 0.7
        # TPOT runs from the first chunk to the end of the stream (after the last token), over 4 gaps;
        # the server spaces tokens 0.05 s apart, and a busy machine only stretches gaps, so no upper
        # bound near 0.05
        assert len(r.itls_s) == 4 and min(r.itls_s) > 0.03
        assert sum(r.itls_s) / 4 <= r.tpot_s < 0.5 and r.tpot_s > 0.045


def test_request_bodies_follow_the_openai_schema() -> None:
    with FakeServer(service_s=0.0) as server:
        asyncio.run(run_sequential(Endpoint(server.url), plan(1, max_tokens=3)))
        body = server.app.state.bodies[0]
    assert body["model"] == "fake-model" and body["max_tokens"] == 3 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and body["ignore_eos"] is True
    assert isinstance(body["messages"][0]["content"], str)


def test_image_requests_carry_data_uris_and_differ_by_salt() -> None:
    factory = RequestFactory("m", image_size=32)
    spec = RequestSpec(8, 4, num_images=1, image_tokens=16)
    a, b = (json.loads(factory.body(spec, 0, salt)) for salt in (1, 2))
    part = a["messages"][0]["content"][0]
    assert part["type"] == "image_url" and part["image_url"]["url"].startswith("data:image/jpeg;base64,")
    assert a != b and json.loads(factory.body(spec, 0, 1)) == a
    with pytest.raises(ValueError, match="chat"):
        RequestFactory("m", api="completions").body(spec, 0)


def test_runs_at_one_rate_with_other_content_salts_share_shapes_and_times_not_content() -> None:
    """Repeated runs at one rate (batch_interference.py) must not be served from each other's caches."""
    workload = make_workload("llava", image_tokens=16, max_context=512)
    factory = RequestFactory("m", image_size=32)

    def planned(salt: int) -> list[PlannedRequest]:
        spec = LoadSpec(workload, seed=3, num_requests=5, content_salt=salt)
        return LoadRunner(Endpoint("http://127.0.0.1:9"), factory, spec, None, 0.9).plan_at(2.0)

    a, a_again, b = planned(0), planned(0), planned(1)
    assert [r.body for r in a] == [r.body for r in a_again]
    assert [(r.arrival_s, r.max_tokens) for r in a] == [(r.arrival_s, r.max_tokens) for r in b]
    images = [[json.loads(r.body)["messages"][0]["content"][0]["image_url"]["url"] for r in run] for run in (a, b)]
    assert not set(images[0]) & set(images[1])


def test_http_errors_are_recorded() -> None:
    with FakeServer(service_s=0.0, status=503) as server:
        result = asyncio.run(run_load(Endpoint(server.url), plan(3, max_tokens=4)))
    assert [r.ok for r in result.records] == [False] * 3
    assert all(r.error and r.error.startswith("HTTP 503") for r in result.records)


def test_overload_stops_early() -> None:
    # Capacity 2 req/s, offered 40 req/s for 40 requests: TTFT passes 0.3 s after a few.
    with FakeServer(service_s=0.5) as server:
        result = asyncio.run(run_load(Endpoint(server.url), plan(40, 4, gap_s=0.025),
                                      SLO(ttft_s=0.3, tpot_s=1.0), target=0.9))
    assert result.stopped_early
    errors = {r.error for r in result.records if not r.ok}
    assert errors <= {"cancelled", "not sent", None} and "cancelled" in errors


def test_event_stream_lines_split_at_line_feeds_only() -> None:
    """A ``data:`` line whose JSON holds a raw U+2028 or U+0085 (legal in JSON and in SSE) stays one
    line, CRLF endings lose their CR, and a line cut across network chunks is joined."""
    import httpx

    from mm_serve.bench.client import sse_lines

    text = 'data: {"text": "a\u2028b\u0085c"}\r\n\r\ndata: [DONE]\n'
    raw = text.encode()
    chunks = [raw[:9], raw[9:14], raw[14:]]  # the first cut falls inside a JSON string

    class Chunks(httpx.AsyncByteStream):
        async def __aiter__(self):  # type: ignore[override]
            for chunk in chunks:
                yield chunk

    async def lines() -> list[str]:
        return [line async for line in sse_lines(httpx.Response(200, stream=Chunks()))]

    got = asyncio.run(lines())
    assert got == ['data: {"text": "a\u2028b\u0085c"}', "", "data: [DONE]"]
    assert json.loads(got[0].removeprefix("data: "))["text"] == "a\u2028b\u0085c"


def test_an_answer_whose_tokens_write_no_text_is_not_a_failure() -> None:
    """One token that decodes to no text (an EOS under ignore_eos): a role chunk, then the finish chunk with no
    content. The answer is valid; its first token came by the finish chunk."""
    from mm_serve.bench.client import take_chunk
    from mm_serve.bench.records import RequestRecord

    rec = RequestRecord(0, 1, sent_s=0.0)
    lines = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
             {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
             {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8}}]
    for now, chunk in zip((0.1, 0.3, 0.31), lines, strict=True):
        assert take_chunk("data: " + json.dumps(chunk), rec, now)
    assert not take_chunk("data: [DONE]", rec, 0.32)
    rec.end_s = 0.32  # as stream_one sets it
    assert rec.ok and rec.ttft_s == 0.3 and rec.output_tokens == 1 and rec.answer == ""
