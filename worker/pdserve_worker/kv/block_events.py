"""What a prefill's prefix cache holds, as a stream of events routers follow.

Each prefill records every block its tiers store or drop here; routers pull the events
(`Prefill.BlockEvents`, worker.proto) over the prefill's own authenticated gRPC port and keep
an index of what each prefill holds (router/kv_index.py).
- Events carry a sequence number; a router asks for those after the last one it applied. The
  log keeps the last `capacity` events; a router further behind, or one that saw another
  epoch (the prefill restarted: a new random epoch), gets `reset` and a snapshot of what is
  held now instead (bounded by MAX_SNAPSHOT hashes).
- A stale index costs a cache miss, never a wrong answer: the prefill looks every prompt up
  in its own cache; the index only steers the choice of prefill.
"""

from __future__ import annotations

import secrets
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

EVENT_LOG_CAPACITY = 65_536  # events a router may fall behind by before it needs a snapshot
MAX_EVENTS_PER_REPLY = 8_192
MAX_SNAPSHOT = 65_536  # hashes of a snapshot (2 MiB on the wire): past it, the rest is not reported


@dataclass(frozen=True)
class BlockEvent:
    seq: int
    stored: bool  # False: removed
    disk: bool  # which tier: the RAM tier, or the disk tier (kv/disk_tier.py)
    block_hash: bytes


@dataclass(frozen=True)
class EventBatch:
    epoch: str
    last_seq: int
    reset: bool  # the events are a snapshot of what is held now: replace, do not apply
    events: list[BlockEvent]


class BlockEventLog:
    """Thread-safe; `snapshot` lists (disk, hash) of every block held now (for a reset)."""

    def __init__(self, snapshot: Callable[[], Iterable[tuple[bool, bytes]]], capacity: int = EVENT_LOG_CAPACITY):
        self.epoch = secrets.token_hex(8)
        self._snapshot = snapshot
        self._events: deque[BlockEvent] = deque(maxlen=capacity)
        self._seq = 0
        self._lock = threading.Lock()

    def record(self, stored: bool, disk: bool, hashes: Iterable[bytes]) -> None:
        with self._lock:
            for h in hashes:
                self._seq += 1
                self._events.append(BlockEvent(self._seq, stored, disk, h))

    def since(self, epoch: str, after_seq: int, limit: int = MAX_EVENTS_PER_REPLY) -> EventBatch:
        """The events after `after_seq` of `epoch` (at most `limit`), or a snapshot (`reset`)
        when the caller knows another epoch or fell behind what is kept."""
        with self._lock:
            oldest = self._events[0].seq if self._events else self._seq + 1
            if epoch == self.epoch and oldest - 1 <= after_seq <= self._seq:
                start = after_seq - oldest + 1
                events = [self._events[i] for i in range(max(0, start), min(len(self._events), start + limit))]
                return EventBatch(self.epoch, events[-1].seq if events else after_seq, False, events)
            seq = self._seq
        held: list[BlockEvent] = []
        for disk, h in self._snapshot():
            if len(held) >= MAX_SNAPSHOT:
                break
            held.append(BlockEvent(seq, True, disk, h))
        # Events recorded while the snapshot was read are replayed after it (seq is from before).
        return EventBatch(self.epoch, seq, True, held)


def runs(events: list[BlockEvent]) -> list[tuple[bool, bool, list[bytes]]]:
    """Consecutive events of one kind and tier as (stored, disk, hashes): the wire's runs."""
    out: list[tuple[bool, bool, list[bytes]]] = []
    for e in events:
        if out and out[-1][0] == e.stored and out[-1][1] == e.disk:
            out[-1][2].append(e.block_hash)
        else:
            out.append((e.stored, e.disk, [e.block_hash]))
    return out
