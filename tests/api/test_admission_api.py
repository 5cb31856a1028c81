"""Admission at the API: service_tier values, the work limit, the image byte budget, 429s."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from mm_serve.admission.media_load import MediaWork
from mm_serve.config import load_config
from mm_serve.engine.engine_holder import EngineHolder
from mm_serve.engine.load_ledger import LoadLedger
from mm_serve.engine.router import Router
from mm_serve.media.image_loading import declared_size
from mm_serve.models.registry import load_model_config
from mm_serve.pipeline.chat_prompt import ChatPrompt, DeclaredImage
from mm_serve.pipeline.context import ServerContext
from mm_serve.pipeline.gate import (
    BYTES_PER_DECLARED_PIXEL,
    PREPROCESS_COPIES,
    UNDECLARED_IMAGE_MEGAPIXELS,
    image_reservation,
    media_size,
    preprocessed_bytes,
)
from mm_serve.protocol.schemas import ChatMessage
from mm_serve.runtime import messages
from mm_serve.server.app import build_app
from tests.api.server_process import data_uri
from tests.factories import gradient_image


def _chat(**overrides: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **overrides}


@pytest.fixture(scope="module")
def unstarted(tiny_llava: Path) -> TestClient:
    """No workers: every check before the engine answers; what passes them gets 503."""
    cfg = load_config(None, {"model": str(tiny_llava), "admission.max_request_work_tokens": 1000,
                             "admission.max_image_bytes_in_flight": 1 << 20,
                             "admission.image_decode_reserve_bytes": 600 << 10})
    ctx = ServerContext(holder=EngineHolder(tiny_llava, cfg), config=cfg, served_model_name="tiny")
    return TestClient(build_app(ctx, start_engine=False))


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_an_unknown_service_tier_is_a_400_naming_the_allowed_values(unstarted: TestClient, path: str) -> None:
    body = _chat(service_tier="scale") if "chat" in path else {"model": "tiny", "prompt": "hi", "service_tier": "scale"}
    r = unstarted.post(path, json=body)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "service_tier" and error["code"] == "invalid_service_tier"
    assert "allowed: auto, priority, default, flex, interactive, standard, batch" in error["message"]


@pytest.mark.parametrize("value", [1, True, ["priority"], {"tier": "flex"}])
def test_a_service_tier_that_is_not_a_string_is_the_same_400(unstarted: TestClient, value: object) -> None:
    r = unstarted.post("/v1/chat/completions", json=_chat(service_tier=value))
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "service_tier" and error["code"] == "invalid_service_tier"
    assert f"got {type(value).__name__}" in error["message"] and "allowed: auto, priority" in error["message"]


@pytest.mark.parametrize("tier", ["auto", "default", "priority", "flex", "batch"])
def test_valid_service_tiers_pass_validation(unstarted: TestClient, tier: str) -> None:
    r = unstarted.post("/v1/chat/completions", json=_chat(service_tier=tier))
    assert r.status_code == 503, r.text  # validated; no worker in this app


def test_a_call_over_the_work_limit_is_a_400_naming_the_limit(unstarted: TestClient) -> None:
    r = unstarted.post("/v1/completions", json={"model": "tiny", "prompt": ["hi", "there"], "n": 8, "max_tokens": 100})
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "work_limit" and error["type"] == "invalid_request_error"
    assert "admission.max_request_work_tokens" in error["message"] and "limit is 1000" in error["message"]
    r = unstarted.post("/v1/chat/completions", json=_chat(n=16, max_tokens=100))
    assert r.status_code == 400 and r.json()["error"]["code"] == "work_limit"
    assert r.json()["error"]["param"] == "max_tokens"
    r = unstarted.post("/v1/chat/completions", json=_chat(n=16, max_completion_tokens=100))
    error = r.json()["error"]
    assert r.status_code == 400 and (error["code"], error["param"]) == ("work_limit", "max_completion_tokens")
    assert "a smaller n or max_completion_tokens" in error["message"]
    assert unstarted.post("/v1/chat/completions", json=_chat(n=2)).status_code == 503  # under it


def test_images_over_the_byte_budget_wait_then_get_429_with_retry_after(tiny_llava: Path) -> None:
    """A call whose images do not fit what other calls hold now waits ``admission.image_wait_s`` for room,
    then is refused (429 ``image_bytes``, retry); one that needs more than the whole budget runs alone,
    holding all of it."""
    cfg = load_config(None, {"model": str(tiny_llava), "admission.max_image_bytes_in_flight": 1 << 20,
                             "admission.image_decode_reserve_bytes": 600 << 10, "admission.image_wait_s": 0.5})
    ctx = ServerContext(holder=EngineHolder(tiny_llava, cfg), config=cfg, served_model_name="tiny")
    client = TestClient(build_app(ctx, start_engine=False))
    flat = Image.new("RGB", (1500, 1500), (90, 20, 200))  # a few KB of PNG declaring 2.25 M pixels: the whole reserve
    image = {"type": "image_url", "image_url": {"url": data_uri(flat)}}
    one = [{"role": "user", "content": [image, {"type": "text", "text": "hi"}]}]
    two = [{"role": "user", "content": [image, image, {"type": "text", "text": "hi"}]}]
    vision = ctx.holder.model_config.vision
    assert image_reservation(ChatPrompt.parse([ChatMessage(**m) for m in two]).images, cfg, vision) > 1 << 20
    assert ctx.image_budget.try_reserve(700 << 10)  # another call's images being decoded
    start = time.monotonic()
    r = client.post("/v1/chat/completions", json=_chat(messages=one))
    error = r.json()["error"]
    assert r.status_code == 429 and error["code"] == "image_bytes" and r.headers["retry-after"] == "1"
    assert 0.5 <= time.monotonic() - start < 5
    assert "admission.max_image_bytes_in_flight" in error["message"] and "716800 of 1048576" in error["message"]
    ctx.image_budget.release(700 << 10)
    for messages_ in (one, two):
        r = client.post("/v1/chat/completions", json=_chat(messages=messages_))
        assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable", r.text
        assert r.headers["retry-after"] == "5"  # past the budget: refused only for want of a worker ("warming")
    assert ctx.image_budget.reserved == 0


def test_small_data_uri_images_reserve_by_their_declared_size(tiny_llava: Path) -> None:
    """A small image's header lets it reserve far less than admission.image_decode_reserve_bytes: its
    decoded pixels and the model's preprocessed tensor for it; a large one, a URL, or a header that cannot
    be read reserves the whole reserve."""
    cfg = load_config(None)
    reserve = cfg.admission.image_decode_reserve_bytes
    vision = load_model_config(tiny_llava).vision
    assert vision is not None

    def reserved(url: str) -> int:
        message = ChatMessage(role="user", content=[{"type": "image_url", "image_url": {"url": url}}])
        return image_reservation(ChatPrompt.parse([message]).images, cfg, vision)

    small = data_uri(gradient_image(64, 48))
    tensor = 3 * vision.image_size ** 2 * 4  # one float32 tile
    assert preprocessed_bytes(vision, 64, 48) == tensor
    assert reserved(small) == len(small) + BYTES_PER_DECLARED_PIXEL * 64 * 48 + PREPROCESS_COPIES * tensor
    assert reserved(small) < 200_000  # the 4 MiB per image held before made 200 such calls overflow 512 MiB
    large = data_uri(gradient_image(2000, 1800))
    assert reserved(large) == len(large) + reserve  # 16 B x 3.6 M pixels is more than the reserve
    assert reserved("data:image/png;base64,AAAA") == len("data:image/png;base64,AAAA") + reserve
    assert reserved("http://127.0.0.1/x.png") == cfg.api.max_image_fetch_bytes + reserve
    assert declared_size(small) == (64, 48) and declared_size("data:image/png,notbase64") is None


@pytest.mark.parametrize("on", [True, False])
def test_the_router_weighs_prefill_workers_by_the_speed_the_predictor_measures(tiny_llava: Path, on: bool) -> None:
    """The app's step listeners pass each prefill worker's measured speed to the router: after
    worker 1's batches take twice worker 0's time for the same work, a shorter queue there no
    longer wins (unless ``scheduler.prefill_speed_routing`` is off)."""
    cfg = load_config(None, {"model": str(tiny_llava), "scheduler.prefill_speed_routing": on})
    ctx = ServerContext(holder=EngineHolder(tiny_llava, cfg), config=cfg, served_model_name="tiny")
    build_app(ctx, start_engine=False)
    client = ctx.holder.client
    ledger = LoadLedger(2, 1, 64)  # what start() builds once the workers are ready
    client.flights.ledger, client.flights.router = ledger, Router(ledger, 8)
    ledger.dispatched("a", prefill=0, decode=0, tokens=100, pages=1)
    ledger.dispatched("b", prefill=1, decode=0, tokens=60, pages=1)
    assert client.router is not None and client.router.pick_prefill(tokens=50) == 1  # not measured yet: 150 against 110 tokens
    for _ in range(40):
        for index, seconds in ((0, 0.1), (1, 0.2)):
            step = messages.StepTiming("prefill", seconds, requests=1, tokens=200, images=0)
            for listener in client.step_listeners:  # as the receiver thread calls them
                listener("prefill", index, step)
    predictor = ctx.admission.predictor
    speeds = client.router.prefill_speed
    assert predictor.prefill_scale(1) / predictor.prefill_scale(0) == pytest.approx(2.0, rel=0.1)  # measured either way
    if not on:
        assert speeds == [1.0, 1.0] and client.router.pick_prefill(tokens=50) == 1
        return
    assert speeds == [predictor.prefill_scale(0), predictor.prefill_scale(1)]
    assert speeds[1] / speeds[0] == pytest.approx(2.0, rel=0.1)
    assert client.router.pick_prefill(tokens=50) == 0  # 150 against 110 x 2 at worker 0's speed


@pytest.mark.parametrize("body", [_chat(n=16, max_tokens=100), {"model": "tiny"}, _chat()])
def test_every_response_says_how_long_the_application_took_in_server_timing(unstarted: TestClient,
                                                                            body: dict[str, Any]) -> None:
    """A refusal (400 over the work limit), a validation error and a 503 all carry
    ``Server-Timing: app;dur=MS``: the milliseconds from arrival to the response's start,
    no more than the client measured around the call; then the phases the handler got through
    (none for a body that fails validation: the handler never runs), which add up to no more."""
    start = time.monotonic()
    r = unstarted.post("/v1/chat/completions", json=body)
    client_ms = 1000 * (time.monotonic() - start)
    assert r.status_code in (400, 503)
    metrics = [entry.strip().partition(";dur=") for entry in r.headers["server-timing"].split(",")]
    names, durations = [m[0] for m in metrics], [float(m[2]) for m in metrics]
    assert names[0] == "app" and 0.0 <= durations[0] <= client_ms
    if body == {"model": "tiny"}:
        assert names == ["app"]
    else:  # passed validation and the early check; refused over the work limit or for no worker (503)
        assert names == ["app", "parse", "precheck", "media"]
        assert all(d >= 0 for d in durations) and sum(durations[1:]) <= durations[0] + 0.1


def test_a_calls_media_work_is_known_only_when_every_image_declares_its_size() -> None:
    """Images sent as data: URIs declare their size; a URL's is unknown until fetched (priced at
    UNDECLARED_IMAGE_MEGAPIXELS) and a video's is priced at its largest: such calls are priced, not
    learned from (mm_serve/admission/media_load.py)."""
    photo = data_uri(gradient_image(400, 300))
    declared = DeclaredImage(photo, declared_size(photo))
    assert declared.size == (400, 300)
    assert media_size([declared, declared], prompts=2) == MediaWork(2, 0.24, known=True)
    assert media_size([]) == MediaWork(1, 0.0, known=True)
    fetched = DeclaredImage("https://example.com/a.png", None)
    assert media_size([declared, fetched]) == MediaWork(1, 0.12 + UNDECLARED_IMAGE_MEGAPIXELS, known=False)
    video = DeclaredImage("https://example.com/a.mp4", None, is_video=True)
    assert media_size([video], video_megapixels=7.5) == MediaWork(1, 7.5, known=False)
