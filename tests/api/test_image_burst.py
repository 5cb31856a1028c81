"""A burst of small image calls on an idle server with the default config: queued, not refused with 5xx."""

from __future__ import annotations

import asyncio
import collections

import httpx

from tests.api.server_process import ServerProcess, data_uri
from tests.factories import gradient_image

BURST = 200


def test_200_small_image_calls_at_once_are_all_answered_and_a_normal_call_passes(server: ServerProcess) -> None:
    """200 chat calls with a 64x64 image each, sent at once, and a text call half a second into the burst:
    every image call gets 200 or (admission's choice) 429 with Retry-After, none a 5xx, and the text call
    is answered 200. (The image budget reserved 4 MiB for each small image and refused what did not fit
    with 503: 81 of 200 on the embedded model.)"""
    image = data_uri(gradient_image(64, 64))
    call = {"model": "tiny", "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "What is it?"}]}]}

    async def burst() -> tuple[list[httpx.Response], httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300,
                                     limits=httpx.Limits(max_connections=BURST + 8)) as client:
            calls = [asyncio.create_task(client.post("/v1/chat/completions", json=call)) for _ in range(BURST)]
            await asyncio.sleep(0.5)
            normal = await client.post("/v1/chat/completions", json={
                "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
            return await asyncio.gather(*calls), normal

    answers, normal = asyncio.run(burst())
    statuses = collections.Counter(r.status_code for r in answers)
    assert set(statuses) <= {200, 429}, statuses
    assert statuses[200] >= BURST // 2, statuses
    for r in answers:
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["type"] == "rate_limit_error"
        else:
            assert r.json()["choices"][0]["message"]["content"] is not None
    assert normal.status_code == 200, normal.text
