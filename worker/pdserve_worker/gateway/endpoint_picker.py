"""Which router pod a gateway sends a request to: a pure choice over the service's routers.

pdserve's routers are the model servers a gateway sees (an InferencePool selects them,
docs/gateway.md): each pairs a prefill with a decode itself, from the whole membership, the
prefixes its prefills cached and its own in-flight counts (router/placement.py,
router/prefix_routing.py). What the gateway's choice adds is *affinity*: requests that share a
prompt prefix reach the same router, whose prefix history then sends them to the prefill that
holds that prefix, instead of being spread over routers that each learn it anew.

So the picker hashes the request's prefix (its first `AFFINITY_CHARS` characters) with
rendezvous hashing (the highest hash of (key, router) wins; only a leaving router's keys move),
among the routers whose in-flight requests are within `load_factor` of the mean (consistent
hashing with bounded loads), so one hot prefix cannot pile onto one router. Pure: no I/O, no
clock; deterministic for one membership.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

AFFINITY_CHARS = 1024  # the prompt prefix that decides affinity (a few hundred tokens)
DEFAULT_LOAD_FACTOR = 1.25


@dataclass(frozen=True)
class Candidate:
    """A router pod: its HTTP endpoint ("ip:port") and the requests it has in flight."""

    address: str
    in_flight: int = 0


def affinity_key(body: dict[str, Any]) -> str:
    """The request's prefix as text: a completion's prompt, or a chat's messages in order."""
    prompt = body.get("prompt")
    if prompt is None:
        prompt = [(m.get("role"), m.get("content")) for m in body.get("messages") or [] if isinstance(m, dict)]
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, separators=(",", ":"), default=str)
    return text[:AFFINITY_CHARS]


def _score(key: str, address: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}\0{address}".encode(), digest_size=8).digest(), "big")


def pick(candidates: Sequence[Candidate], key: str, load_factor: float = DEFAULT_LOAD_FACTOR) -> Candidate | None:
    """The router for a request with affinity `key` (None: no router to send it to)."""
    if not candidates:
        return None
    if load_factor < 1:
        raise ValueError(f"load_factor must be >= 1, got {load_factor}")
    mean = sum(c.in_flight for c in candidates) / len(candidates)
    bound = max(1, math.ceil(mean * load_factor))  # (an idle service: every router is allowed)
    allowed = [c for c in candidates if c.in_flight < bound] or list(candidates)
    return max(allowed, key=lambda c: (_score(key, c.address), c.address))
