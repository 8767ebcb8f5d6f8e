"""The endpoint picker's body parsing, off the router's event loop: bounded, budgeted (#58 A3).

Request bodies are the tenants' (the gateway forwards them), and parsing one is not cheap: a
large JSON body of small numbers holds the GIL for seconds of CPU, which stalled router-0's
loop (#58 A3; benchmarks/README.md, "Endpoint picker"). What the pick needs of a body is its
`model` and its prompt's first characters, so, as the router's grammar compiles do
(api/grammar_compiler.py):
- a body is parsed only up to `max_parse_bytes` (the CPU one parse may take is bounded by it);
- parses run in `threads` worker threads, at most `queue` running or waiting;
- the seconds they take come from one bucket of `cpu_seconds_per_minute`.
A body past any of these is not parsed: it is routed by its raw first bytes (`Unparsed`), which
keeps the affinity of identical requests, and the router it reaches checks the model itself.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio

from pdserve_worker.api.admission import TokenBucket

_NOT_JSON = object()


@dataclass(frozen=True)
class ParseLimits:
    """What parsing bodies may cost the router (README "Limits")."""

    max_parse_bytes: int = 256 << 10  # larger bodies are routed unparsed
    threads: int = 1
    queue: int = 16  # parses running or waiting
    cpu_seconds_per_minute: float = 15.0  # a quarter of one core, the whole picker

    def __post_init__(self) -> None:
        if self.threads < 1 or self.queue < self.threads or self.cpu_seconds_per_minute <= 0:
            raise ValueError(f"parse limits need threads >= 1, queue >= threads and a positive budget, got {self}")


@dataclass(frozen=True)
class Unparsed:
    """A body the picker did not parse, and why ('size', 'busy' or 'budget')."""

    reason: str


class InvalidBody(Exception):
    """The body is not a JSON object (the 400 it is answered with names it)."""


class BodyParser:
    """Parses bodies within `ParseLimits` (see the module doc); one per picker."""

    def __init__(self, limits: ParseLimits = ParseLimits(), clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self._clock = clock
        self._threads = anyio.CapacityLimiter(limits.threads)
        self._bucket = TokenBucket(limits.cpu_seconds_per_minute, clock())
        self.in_progress = 0
        self.unparsed: dict[str, int] = {"size": 0, "busy": 0, "budget": 0}

    async def parse(self, raw: bytes) -> dict[str, Any] | Unparsed:
        """The body as a JSON object, or Unparsed; InvalidBody when it is not a JSON object."""
        reason = self._refusal(len(raw))
        if reason is not None:
            self.unparsed[reason] += 1
            return Unparsed(reason)
        self.in_progress += 1
        try:
            parsed, took = await anyio.to_thread.run_sync(self._run, raw, limiter=self._threads)
        finally:
            self.in_progress -= 1
        self._bucket.take(took, self._clock())
        if parsed is _NOT_JSON:
            raise InvalidBody("the request body is not JSON")
        if not isinstance(parsed, dict):
            raise InvalidBody("the request body is not a JSON object")
        return parsed

    def _refusal(self, size: int) -> str | None:
        if size > self.limits.max_parse_bytes:
            return "size"
        if self.in_progress >= self.limits.queue:
            return "busy"
        if self._bucket.wait_s(0.0, self._clock()) > 0:
            return "budget"
        return None

    def _run(self, raw: bytes) -> tuple[Any, float]:
        """The parsed value (_NOT_JSON: none) and the seconds the parse took, timed in its thread."""
        started = self._clock()
        try:
            value: Any = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            value = _NOT_JSON
        return value, max(0.0, self._clock() - started)
