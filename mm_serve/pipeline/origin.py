"""Where a call comes from, as the pipeline sees it: when it arrived, and the hooks of its carrier.

An HTTP request marks the phases of its handling for the metrics, hands its body's hold on the
image budget back once parsed, and can be disconnected; a Batch API row or a caption job's
input has none of that (:meth:`CallOrigin.internal`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field


async def _never_gone() -> bool:
    return False


def _nothing(*_: object) -> None:
    return None


@dataclass(frozen=True)
class CallOrigin:
    """A call's arrival and its carrier's hooks.

    Attributes:
        arrival: when the call arrived, ``time.monotonic()`` seconds (its TTFT counts from here).
        mark: ``mark(phase)`` records that a phase of the call's handling ended (``"parse"``,
            ``"precheck"``, ``"media"``, ``"hold"``, ``"admit"``).
        release_body: gives the body's hold on the image budget back (its images' own take over).
        gone: whether the client went away (a disconnected HTTP client).
        tenant: whose caches the call may share (with ``api.cache_salt_by_api_key``, its API key);
            "" for the shared ones.
    """

    arrival: float
    mark: Callable[[str], None] = _nothing
    release_body: Callable[[], None] = field(default=lambda: None)
    gone: Callable[[], Awaitable[bool]] = _never_gone
    tenant: str = ""

    @classmethod
    def internal(cls, tenant: str = "") -> CallOrigin:
        """A call made inside the service (a batch row, a caption input) for ``tenant``: arrived now,
        never gone."""
        return cls(time.monotonic(), tenant=tenant)
