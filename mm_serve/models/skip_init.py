"""Build modules without their random initialisation, for weights a checkpoint fills right after.

transformers' own ``no_init_weights`` (what ``from_pretrained`` uses off the meta device): torch's
``nn.init`` functions and ``PreTrainedModel.init_weights`` do nothing inside it. Buffers computed in
``__init__`` (position ids, rotary frequencies) are still computed. Randomly initialising a
CLIP ViT-L/14-336 tower took 3.5 to 5 s of a prefill worker's start on a 2-core CPU, for weights then
overwritten.
"""

from __future__ import annotations

try:  # transformers 5
    from transformers.initialization import no_init_weights
except ImportError:  # transformers 4
    from transformers.modeling_utils import no_init_weights  # type: ignore[attr-defined,no-redef]

__all__ = ["no_init_weights"]
