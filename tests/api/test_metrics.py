"""/metrics: histograms agree with what clients measure; gauges return to idle."""

from __future__ import annotations

import time

import httpx

from tests.api.server_process import ServerProcess, data_uri, requests_counted, scrape_metrics
from tests.factories import gradient_image


def _client_ttft(http: httpx.Client, url: str, i: int) -> float:
    """Client-side TTFT of a one-token completion with a long prompt (so prefill dominates)."""
    content: object = f"Question {i}: " + "tell me more about this. " * 300
    if i % 2:
        content = [{"type": "image_url", "image_url": {"url": data_uri(gradient_image(48, 40, i))}},
                   {"type": "text", "text": content}]
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 1,
            "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    r = http.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
    return time.perf_counter() - start


def test_ttft_histogram_matches_client_and_gauges_return_to_idle(server: ServerProcess) -> None:
    n = 8
    with httpx.Client() as http:  # one kept-alive connection: TCP set-up is not part of TTFT
        _client_ttft(http, server.url, 0)  # warm-up, before the baseline scrape
        before = scrape_metrics(server.url)
        client_sum = sum(_client_ttft(http, server.url, i) for i in range(n))
    time.sleep(0.2)
    after = scrape_metrics(server.url)
    key_count = ("mm_serve_time_to_first_token_seconds_count", ())
    key_sum = ("mm_serve_time_to_first_token_seconds_sum", ())
    count = after[key_count] - before.get(key_count, 0.0)
    server_sum = after[key_sum] - before.get(key_sum, 0.0)
    assert count == n
    assert abs(server_sum - client_sum) <= 0.2 * client_sum, (server_sum, client_sum)
    generated = after[("mm_serve_generation_tokens_total", ())] - before.get(("mm_serve_generation_tokens_total", ()), 0.0)
    assert generated == n
    images = after[("mm_serve_image_inputs_total", ())] - before.get(("mm_serve_image_inputs_total", ()), 0.0)
    assert images == n // 2
    # the requests with an image: a text-only request's empty encode span is no encode
    assert after[("mm_serve_encode_seconds_count", ())] - before.get(("mm_serve_encode_seconds_count", ()), 0.0) == n // 2
    deadline = time.monotonic() + 10
    while True:
        idle = scrape_metrics(server.url)
        running = [v for (name, _), v in idle.items() if name == "mm_serve_requests_running"]
        used = [v for (name, _), v in idle.items() if name == "mm_serve_kv_pages_used"]
        totals = [v for (name, _), v in idle.items() if name == "mm_serve_kv_pages_total"]
        if (running and all(v == 0 for v in running) and all(v == 0 for v in used)) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert running == [0.0, 0.0] and used == [0.0, 0.0] and all(t > 0 for t in totals)
    assert idle[("mm_serve_requests_in_flight", ())] == 0 and idle[("mm_serve_calls_admitting", ())] == 0


def test_rejected_requests_are_counted_by_status(server: ServerProcess) -> None:
    before = scrape_metrics(server.url)
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "tiny", "messages": []}, timeout=10)
    assert r.status_code == 400
    after = scrape_metrics(server.url)
    key = ("mm_serve_requests_total", (("finish_reason", "error"), ("status_code", "400")))
    assert after[key] - before.get(key, 0.0) == 1
    for path in ("/", "/favicon.ico", "/v1/files/file-nope", "/v1/batches/batch_nope"):  # not generation calls
        assert httpx.get(f"{server.url}{path}", timeout=10).status_code == 404
    assert requests_counted(after, scrape_metrics(server.url)) == {}


def test_a_calls_choices_count_its_prompt_and_images_once(server: ServerProcess) -> None:
    """n choices share one prompt: prompt tokens and images are counted once, generated tokens n times."""
    content = [{"type": "image_url", "image_url": {"url": data_uri(gradient_image(48, 40, 7))}},
               {"type": "text", "text": "What is this?"}]
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 2, "n": 3,
            "temperature": 1, "ignore_eos": True}
    before = scrape_metrics(server.url)
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    time.sleep(0.2)
    after = scrape_metrics(server.url)

    def grown(name: str) -> float:
        return after[(name, ())] - before.get((name, ()), 0.0)

    assert grown("mm_serve_image_inputs_total") == 1
    assert grown("mm_serve_prompt_tokens_total") == usage["prompt_tokens"]
    assert grown("mm_serve_generation_tokens_total") == usage["completion_tokens"] == 6
