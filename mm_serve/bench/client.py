"""The load generator: sends a planned run to an OpenAI-compatible server and times the streams.

Each request is a streaming POST (server-sent events) sent at its planned arrival
time, open-loop: a slow server does not slow the arrivals down. For every
non-empty content chunk the client stamps the monotonic clock; the final usage
chunk (``stream_options.include_usage``) gives the output token count used for
TPOT, and the cached prompt tokens (``prompt_tokens_details.cached_tokens``) when
the server reports them. Any OpenAI-compatible server works (mm-serve, vLLM,
``transformers serve``).

The turns of a conversation are the exception to open loop: each is sent once the
previous turn has been answered, with the whole history
(:mod:`mm_serve.bench.conversations`); a turn after a failed one is not sent and
counts as failed ("an earlier turn failed").

With an SLO and an attainment target, a run stops early once enough requests are
*certain* to miss (:meth:`RequestRecord.certainly_misses`) that the target can no
longer be met: in-flight requests are cancelled and unsent ones marked, all of them
counted as misses, so an overloaded probe of a rate sweep costs seconds, not minutes.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import httpx

from mm_serve.bench.conversations import History, request_chains
from mm_serve.bench.records import RequestRecord
from mm_serve.bench.requests import PlannedRequest
from mm_serve.ground.slo import SLO

Clock = Callable[[], float]


@dataclass(frozen=True)
class Endpoint:
    """Where to send requests: ``base_url`` + ``path``, optional bearer key, per-read timeout (s)."""

    base_url: str
    path: str = "/v1/chat/completions"
    api_key: str | None = None
    timeout_s: float = 300.0

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.path

    def headers(self) -> dict[str, str]:
        head = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if self.api_key:
            head["Authorization"] = f"Bearer {self.api_key}"
        return head


@dataclass(frozen=True)
class LoadResult:
    """The records of one run (plan order) and whether it was cut short."""

    records: list[RequestRecord]
    stopped_early: bool


def _http_client(endpoint: Endpoint) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    timeout = httpx.Timeout(endpoint.timeout_s, connect=30.0)
    return httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False)


def take_chunk(line: str, rec: RequestRecord, now: float) -> bool:
    """Apply one SSE line to ``rec``; returns False at the end of the stream."""
    if not line.startswith("data:"):
        return True
    data = line[5:].strip()
    if data == "[DONE]":
        return False
    chunk = json.loads(data)
    if "error" in chunk:
        err = chunk["error"]
        rec.error = str(err.get("message", err) if isinstance(err, dict) else err)
        return False
    usage = chunk.get("usage")
    if usage:
        rec.output_tokens = int(usage.get("completion_tokens") or 0)
        rec.prompt_tokens = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        rec.cached_tokens = cached if isinstance(cached, int) and not isinstance(cached, bool) else None
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta")
        text = delta.get("content") if delta is not None else choice.get("text")
        if text:
            rec.chunk_s.append(now)
            rec.content.append(text)
        elif choice.get("finish_reason") and not rec.chunk_s:
            # tokens that write no text (an EOS under ignore_eos, a special token) ended the answer: its
            # first token arrived by this chunk at the latest (a valid answer, not a failure)
            rec.chunk_s.append(now)
            rec.content.append("")
    return True


async def sse_lines(resp: httpx.Response) -> AsyncIterator[str]:
    """The lines of an event stream, split at LF (a CR before it dropped) only, as the SSE
    specification splits them: httpx's ``aiter_lines`` also splits at U+0085 and U+2028, which a
    JSON string in a ``data:`` line may hold raw."""
    pending = b""
    async for chunk in resp.aiter_bytes():
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.removesuffix(b"\r").decode("utf-8", errors="replace")
    if pending:
        yield pending.removesuffix(b"\r").decode("utf-8", errors="replace")


async def stream_one(http: httpx.AsyncClient, endpoint: Endpoint, req: PlannedRequest,
                     rec: RequestRecord, clock: Clock, body: bytes | None = None) -> None:
    """Send ``req`` now (``body`` instead of ``req.body`` if given) and fill ``rec`` from its
    event stream; never raises but on cancel."""
    rec.sent_s = clock()
    try:
        async with http.stream("POST", endpoint.url, content=req.body if body is None else body,
                               headers=endpoint.headers()) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread())[:300].decode(errors="replace")
                rec.error = f"HTTP {resp.status_code}: {detail}"
                return
            async for line in sse_lines(resp):
                if not take_chunk(line, rec, clock()):
                    break
    except asyncio.CancelledError:
        rec.error = rec.error or "cancelled"
        raise
    except (httpx.HTTPError, json.JSONDecodeError, ValueError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    finally:
        rec.end_s = clock()
        if rec.output_tokens == 0:
            rec.output_tokens = len(rec.chunk_s)
        if rec.error is None and not rec.chunk_s:
            rec.error = "no content in the stream"


def allowed_misses(num_requests: int, target: float) -> int:
    """Misses a run of ``num_requests`` can have while attainment stays >= ``target``."""
    return num_requests - math.ceil(target * num_requests - 1e-9)


EARLIER_TURN_FAILED = "an earlier turn failed"


def _records(plan: Sequence[PlannedRequest]) -> list[RequestRecord]:
    return [RequestRecord(p.index, p.max_tokens, tier=p.tier, turn=p.turn) for p in plan]


async def _send_chain(http: httpx.AsyncClient, endpoint: Endpoint, plan: Sequence[PlannedRequest],
                      records: Sequence[RequestRecord], chain: Sequence[int], clock: Clock,
                      wait: bool = True) -> None:
    """Send the requests of ``chain`` one after the other, each at its arrival time (``wait``)
    or when the one before it has finished, whichever is later; a conversation's history
    grows with every answer, and a failure ends the chain."""
    history = History()
    for pos, i in enumerate(chain):
        req, rec = plan[i], records[i]
        delay = req.arrival_s - clock()
        if wait and delay > 0:
            await asyncio.sleep(delay)
        await stream_one(http, endpoint, req, rec, clock, history.body(req))
        if not rec.ok:
            for j in chain[pos + 1:]:
                records[j].error = EARLIER_TURN_FAILED
            return
        history.answered(req, rec.answer)


async def run_load(endpoint: Endpoint, plan: Sequence[PlannedRequest], slo: SLO | None = None,
                   target: float | None = None, poll_s: float = 0.2) -> LoadResult:
    """Send ``plan`` open-loop at its arrival times (conversations closed-loop, turn after turn);
    stop early when ``slo``/``target`` fail for sure."""
    records = _records(plan)
    budget = allowed_misses(len(plan), target) if slo is not None and target is not None else None
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    async with _http_client(endpoint) as http:
        tasks = [asyncio.create_task(_send_chain(http, endpoint, plan, records, chain, clock))
                 for chain in request_chains(plan)]
        stopped = False
        pending = set(tasks)
        while pending:
            _, pending = await asyncio.wait(pending, timeout=poll_s)
            if budget is not None and slo is not None and pending:
                now = clock()
                if sum(1 for r in records if r.certainly_misses(now, slo)) > budget:
                    stopped = True
                    break
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    for rec in records:
        if rec.sent_s is None:
            rec.error = rec.error or "not sent"
    return LoadResult(records, stopped)


async def run_sequential(endpoint: Endpoint, plan: Sequence[PlannedRequest]) -> list[RequestRecord]:
    """Send ``plan`` one request at a time, ignoring arrival times: the unloaded latencies
    (a conversation's turns in a row, with their history)."""
    records = _records(plan)
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    async with _http_client(endpoint) as http:
        for chain in request_chains(plan):
            await _send_chain(http, endpoint, plan, records, chain, clock, wait=False)
    return records
