"""Prefix-aware choice of a prefill: the longest cached prefix, unless that unbalances load (pure).

Which prefill holds which prefix is predicted from this router's own routing history: every
request sent to a prefill leaves it with the prompt's whole blocks cached (kv/prefix_cache.py),
so the router remembers, per prefill, the block hashes it sent there, LRU-bounded to what a
prefill can hold (`PrefixHistory`). It misses other routers' requests and the prefill's own
evictions: a wrong guess costs a cache miss, never a wrong answer (the prefill looks its cache
up by hash itself). Reports of what prefills hold, where on, win (router/kv_index.py).

The choice (`choose_prefill`): among the prefills whose queue *and* share of this router's
recent requests are within the balance bound of the smallest
(`x <= max(smallest * ratio, smallest + slack)`), take the one with the longest predicted
match; ties and the no-match case go to the least loaded (queue, then recent share), so a long
match never costs more than `ratio`x the shortest queue.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BalanceBound:
    """How much longer than the shortest queue a prefill's may be and still win on its prefix."""

    ratio: float = 2.0
    slack: int = 2

    def __post_init__(self) -> None:
        if self.ratio < 1 or self.slack < 0:
            raise ValueError(f"BalanceBound needs ratio >= 1 and slack >= 0, got {self.ratio}, {self.slack}")

    def allows(self, queue: int, shortest: int) -> bool:
        return queue <= max(shortest * self.ratio, shortest + self.slack)


@dataclass(frozen=True)
class PrefillChoice:
    worker_id: str
    matched_blocks: int
    reason: str  # "prefix" | "shortest_queue"


def choose_prefill(
    ranked: Sequence[str],
    queues: Mapping[str, int],
    matches: Mapping[str, int],
    recent: Mapping[str, int] | None = None,
    bound: BalanceBound = BalanceBound(),
) -> PrefillChoice:
    """`ranked`: candidate prefills, best first by the plain load ranking; `queues`: each one's
    estimated queue now; `matches`: each one's predicted matched blocks; `recent`: requests this
    router sent each one within its recent window (`RecentShare`). Raises ValueError when empty.

    A candidate is eligible when both its queue and its recent share are within the bound of the
    smallest: the queue bounds the wait a match may cost now, the recent share bounds how unequal
    the served counts become when prefixes are sticky (with idle prefills every queue is 0, and
    without it every new prefix would land on the first one)."""
    if not ranked:
        raise ValueError("no prefill to choose from")
    share = recent or {}
    order = {w: i for i, w in enumerate(ranked)}

    def load(w: str) -> tuple[int, int, int]:
        return (queues.get(w, 0), share.get(w, 0), order[w])

    shortest = min(queues.get(w, 0) for w in ranked)
    least = min(share.get(w, 0) for w in ranked)
    eligible = [w for w in ranked if bound.allows(queues.get(w, 0), shortest) and bound.allows(share.get(w, 0), least)]
    best = min(eligible, key=lambda w: (-matches.get(w, 0), load(w))) if eligible else None
    if best is None or not matches.get(best, 0):
        # No match worth its load (or no prefill is within both bounds of the two minima):
        # the least loaded, which holds whatever it holds.
        best = min(ranked, key=load)
        return PrefillChoice(best, matches.get(best, 0), "least_loaded")
    return PrefillChoice(best, matches[best], "prefix")


class RecentShare:
    """How many of this router's last `window` prefill choices went to each prefill."""

    def __init__(self, window: int = 64) -> None:
        if window <= 0:
            raise ValueError(f"window must be positive, got {window}")
        self._window: deque[str] = deque(maxlen=window)
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def record(self, worker_id: str) -> None:
        with self._lock:
            if len(self._window) == self._window.maxlen:
                gone = self._window[0]
                self._counts[gone] -= 1
                if not self._counts[gone]:
                    del self._counts[gone]
            self._window.append(worker_id)
            self._counts[worker_id] = self._counts.get(worker_id, 0) + 1

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class PrefixHistory:
    """Per prefill, the block hashes this router sent there: LRU-bounded, thread-safe."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be positive, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._held: dict[str, OrderedDict[bytes, None]] = {}
        self._lock = threading.Lock()

    def match(self, worker_id: str, hashes: Sequence[bytes]) -> int:
        """Leading hashes predicted cached at `worker_id`."""
        with self._lock:
            held = self._held.get(worker_id)
            if not held:
                return 0
            n = 0
            for h in hashes:
                if h not in held:
                    break
                n += 1
            return n

    def matches(self, workers: Sequence[str], hashes: Sequence[bytes]) -> dict[str, int]:
        return {w: self.match(w, hashes) for w in workers}

    def record(self, worker_id: str, hashes: Sequence[bytes]) -> None:
        """`worker_id` prefilled a prompt of these block hashes: it holds them now (most recent).
        Touched tail first, so the LRU end is a chain's tail as at the prefill."""
        with self._lock:
            held = self._held.setdefault(worker_id, OrderedDict())
            for h in reversed(hashes):
                held[h] = None
                held.move_to_end(h)
            while len(held) > self.capacity_blocks:
                held.popitem(last=False)

    def forget(self, worker_id: str) -> None:
        """A prefill left (or restarted): what it held is gone."""
        with self._lock:
            self._held.pop(worker_id, None)

    def size(self, worker_id: str) -> int:
        with self._lock:
            return len(self._held.get(worker_id, ()))
