"""Trailing metadata that carries facts of the request road beside a gRPC status.

`pdserve-push-settled` on a failed Prefill (worker.proto): "1" when nothing of that request's
push can still be written into its targets, so the router may give the decode slot back as
free at once instead of quarantined. Absent or anything else means unknown, and unknown is
treated as "a write may still arrive".
"""

from __future__ import annotations

from typing import Any

PUSH_SETTLED = "pdserve-push-settled"


def settled_trailer(settled: bool) -> tuple[tuple[str, str], ...]:
    return ((PUSH_SETTLED, "1" if settled else "0"),)


def push_settled(error: Any) -> bool:
    """Whether a failed call's trailing metadata says the push is over (an `AioRpcError`)."""
    try:
        metadata = error.trailing_metadata() or ()
    except Exception:  # noqa: BLE001 - an error without trailers says nothing
        return False
    return any(key == PUSH_SETTLED and value in ("1", b"1") for key, value in metadata)


# What gRPC core says when a call found no address it could connect to (pick_first and
# round_robin's "failed to connect to all addresses"): the request never left this process.
NEVER_CONNECTED = "failed to connect to all addresses"


def never_sent(error: Any) -> bool:
    """Whether a failed call never reached its server (so it cannot have started a push): its
    status is UNAVAILABLE and gRPC found no address to connect to. A prefill that died and came
    back on its port answers connection-refused until the channel reconnects; without this, each
    such call would quarantine a decode slot for its whole lease."""
    try:
        code, details = error.code(), error.details() or ""
    except Exception:  # noqa: BLE001 - not a gRPC error: nothing is known
        return False
    return getattr(code, "name", "") == "UNAVAILABLE" and NEVER_CONNECTED in details
