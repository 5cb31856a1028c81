"""A waiting interactive request displaces a running batch one on the real engine; greedy outputs of
both equal their outputs when each runs alone (the displaced one is recomputed from prompt + outputs)."""

from __future__ import annotations

from pathlib import Path

from mm_serve.colocated.llm_engine import LLMEngine
from mm_serve.runtime.engine_config import EngineConfig
from mm_serve.runtime.sampling_params import SamplingParams
from tests.factories import gradient_image

Q = "USER: <image>\nWhat is in this picture? ASSISTANT:"
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _alone(engine: LLMEngine, request: dict, rid: str) -> list[int]:
    r = engine.add_request(rid, engine.inputs.process(request), GREEDY)
    while engine.has_unfinished():
        engine.step()
    return list(r.output_token_ids)


def test_displaced_batch_request_keeps_its_greedy_output(tiny_llava: Path) -> None:
    batch_req = {"prompt": Q, "images": [gradient_image(60, 40, 1)]}
    inter_req = {"prompt": " ".join(["The quick brown fox jumps over the lazy dog."] * 4)}
    roomy = LLMEngine(tiny_llava, EngineConfig(page_size=4, num_pages=512))
    expected_batch, expected_inter = _alone(roomy, batch_req, "b"), _alone(roomy, inter_req, "i")

    batch_inputs = roomy.inputs.process(batch_req)
    inter_inputs = roomy.inputs.process(inter_req)
    # room for either request's whole output, not for both at once
    pages = [-(-(len(x.prompt_token_ids) + 24) // 4) for x in (batch_inputs, inter_inputs)]
    engine = LLMEngine(tiny_llava, EngineConfig(page_size=4, num_pages=max(pages)))
    batch = engine.add_request("b", batch_inputs, GREEDY, priority=2)
    for _ in range(4):  # prefill + 3 decode steps
        engine.step()
    assert len(batch.output_token_ids) == 4
    assert engine.num_free_pages() < engine.pages_needed(len(inter_inputs.prompt_token_ids))
    inter = engine.add_request("i", inter_inputs, GREEDY, priority=0)
    engine.step()
    assert engine.scheduler.num_displaced == 1 and batch.num_preemptions == 1
    assert len(inter.output_token_ids) == 1  # prefilled ahead of the running batch request
    while engine.has_unfinished():
        engine.step()
    assert inter.output_token_ids == expected_inter
    assert batch.output_token_ids == expected_batch
    engine.kv_cache.pool.check_integrity()
