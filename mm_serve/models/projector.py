"""The LLaVA multimodal projector: vision features → language-model embeddings.

A two-layer MLP ``linear_2(act(linear_1(x)))`` (Liu et al. 2023, "Improved
Baselines with Visual Instruction Tuning", LLaVA-1.5 §3.2). Weight names match
llava-hf checkpoints (``linear_1.weight``, ...).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_new": _gelu_new,
    "quick_gelu": _quick_gelu,
    "relu": F.relu,
    "silu": F.silu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation function named in a config.

    Raises:
        ValueError: unknown name (the message lists the supported ones).
    """
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"activation '{name}' is not supported ({', '.join(ACTIVATIONS)})") from None


class MultiModalProjector(nn.Module):
    """Maps ``[N, in_features]`` vision features to ``[N, text_hidden]`` embeddings."""

    def __init__(self, in_features: int, text_hidden: int, act: str, bias: bool = True) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_features, text_hidden, bias=bias)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)
        self.act = activation(act)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))
