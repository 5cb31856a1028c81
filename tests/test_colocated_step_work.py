"""What one colocated engine step computed (``LLMEngine.last_step``), which the colocated worker reports
to the front end's latency predictor: prefill requests, prompt tokens computed (a cached prefix not
counted), tower passes, and the decode batch run in the same pass."""

from __future__ import annotations

from pathlib import Path

from mm_serve.colocated.llm_engine import LLMEngine, StepWork
from mm_serve.runtime.engine_config import EngineConfig
from mm_serve.runtime.sampling_params import SamplingParams
from tests.factories import gradient_image

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
TEXT = " ".join(["The quick brown fox jumps over the lazy dog."] * 3)


def test_each_step_reports_its_prefill_and_decode_work(tiny_llava: Path) -> None:
    engine = LLMEngine(tiny_llava, EngineConfig(page_size=4, num_pages=512))
    assert engine.last_step == StepWork()
    image = engine.add_request("img", engine.inputs.process(
        {"prompt": "USER: <image>\nWhat is in this picture? ASSISTANT:", "images": [gradient_image(60, 40, 1)]}),
        GREEDY)
    prompt = image.num_prompt_tokens
    engine.step()  # the image request's prefill: its prompt (image tokens included) and one tower pass
    assert engine.last_step == StepWork(prefill_requests=1, prefill_tokens=prompt, images=1)
    engine.step()  # a decode step over its prompt and first output
    assert engine.last_step == StepWork(decode_requests=1, decode_context=prompt + 1)
    text = engine.add_request("text", engine.inputs.process({"prompt": TEXT}), GREEDY)
    engine.step()  # a mixed step: the text prompt prefilled beside the image request's decode
    assert engine.last_step == StepWork(1, text.num_prompt_tokens, 0, 1, prompt + 2)
    again = engine.add_request("again", engine.inputs.process({"prompt": TEXT}), GREEDY)
    engine.step()  # the same prompt again: its full cached pages are not computed
    cached = again.num_prompt_cached_tokens
    assert cached > 0 and cached % 4 == 0
    assert engine.last_step == StepWork(1, again.num_prompt_tokens - cached, 0, 2, prompt + 3 + text.num_prompt_tokens + 1)
    while engine.has_unfinished():
        engine.step()
    engine.step()  # nothing left: an empty step computes nothing
    assert engine.last_step == StepWork()
