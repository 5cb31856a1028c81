"""mm-serve: multimodal LLM serving with prefill/decode disaggregation.

``from mm_serve import LLM, SamplingParams`` is the offline API. Heavy modules
(torch, transformers) load on first use, so ``import mm_serve`` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mm_serve.ground.version import VERSION as __version__

__all__ = ["LLM", "SamplingParams", "RequestOutput", "__version__"]

if TYPE_CHECKING:
    from mm_serve.offline.llm import LLM
    from mm_serve.offline.outputs import RequestOutput
    from mm_serve.runtime.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from mm_serve.offline.llm import LLM

        return LLM
    if name == "SamplingParams":
        from mm_serve.runtime.sampling_params import SamplingParams

        return SamplingParams
    if name == "RequestOutput":
        from mm_serve.offline.outputs import RequestOutput

        return RequestOutput
    raise AttributeError(f"module 'mm_serve' has no attribute {name!r}")
