"""What the admission controller reads of the load: the engine client, as an interface.

The controller never imports the engine client; anything with these methods will do (the
engine client in the server, a ledger over fake workers in the tests).
"""

from __future__ import annotations

from typing import Protocol

from mm_serve.engine.load_view import LoadView
from mm_serve.ground.tiers import Tier
from mm_serve.inputs.input_processor import ProcessedInputs


class LoadSource(Protocol):
    """Views of the workers a request would be sent to."""

    def load_view(self, tier: Tier, num_tokens: int, max_tokens: int,
                  inputs: ProcessedInputs | None = None) -> LoadView | None:
        """What a request of ``tier`` with ``num_tokens`` prompt tokens and ``max_tokens`` output
        tokens would find on the workers the router would pick now (with ``inputs``: its cached
        prefix and images counted); None while a role has no ready worker."""
        ...

    def load_views(self, tier: Tier, num_tokens: int, max_tokens: int) -> list[LoadView]:
        """:meth:`load_view` as if each ready prefill worker were the one picked (no cache
        believed); empty while a role has no ready worker."""
        ...
