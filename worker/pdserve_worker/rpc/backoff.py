"""Exponential backoff with jitter for reconnect loops, and the two rules those loops share.

Hand-written (a few lines) because the loops that use it are long-lived asyncio tasks that
reset the attempt count on success and pick the delay per failure kind; retry decorators
(tenacity, backoff) wrap one call and would hide that control flow.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import grpc

# Codes that another attempt with the same request cannot fix.
PERMANENT = frozenset(
    {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT}
)


@dataclass(frozen=True)
class Backoff:
    """Delay before retry `attempt` (0-based): half of min(cap, base * 2**attempt), plus a
    uniform random part of the other half ("equal jitter": never zero, never in lockstep
    with the other workers that lost the same broker)."""

    base_s: float = 0.1
    cap_s: float = 5.0

    def __post_init__(self) -> None:
        if not 0 < self.base_s <= self.cap_s:
            raise ValueError(f"need 0 < base_s <= cap_s, got base_s={self.base_s} cap_s={self.cap_s}")

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        ceiling = min(self.cap_s, self.base_s * 2 ** min(attempt, 62))
        return float(ceiling / 2 + (rng or random).uniform(0, ceiling / 2))


def raise_if_cancelling() -> None:
    """grpc.aio turns a cancellation that lands inside a call into AioRpcError(CANCELLED);
    a loop that catches that and retries would never end. Re-raise it as the cancellation."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError()
