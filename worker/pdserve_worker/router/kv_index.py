"""Which prefill holds which prefix, from the prefills' own reports (kv/block_events.py).

A router follows every prefill's `Prefill.BlockEvents` stream (members.py polls it) and
keeps here, per prefill, the block hashes it holds in RAM and on disk. A prompt's expected
cached tokens on a prefill are its leading blocks that prefill holds, hashed the prefill's way
(its reported salt and block size, within the request's cache scope). Unlike the router's own
prediction (router/prefix_routing.py's PrefixHistory), it sees what the other routers sent,
what was evicted, and a restart (a new epoch resets the prefill's entry).

Bounded: at most `max_hashes` per prefill are kept (a prefill that reports more is capped, and
said once in the log), so a misbehaving member cannot grow a router without limit. Pure logic
besides the lock; the polling is the backend's.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

from pdserve_common.logs import kv
from pdserve_worker.kv.prefix_cache import block_hashes, scoped_salt

log = logging.getLogger(__name__)

MAX_HASHES_PER_PREFILL = 1 << 20  # 32 MiB of hashes per prefill at most
PREDICT_S = 2.0  # how long a prediction stands without the member's events confirming it (8 polls)
MAX_PREDICTED = 1 << 16  # predicted hashes per member at most


class Run(Protocol):
    stored: bool
    disk: bool
    block_hashes: list[bytes]


class Reply(Protocol):
    """worker_pb2.BlockEventsReply's fields (the protocol keeps this module free of protos)."""

    epoch: str
    last_seq: int
    reset: bool
    runs: list[Run]
    salt: bytes
    block_tokens: int
    enabled: bool


@dataclass
class _Held:
    epoch: str = ""
    last_seq: int = 0
    salt: bytes = b""
    block_tokens: int = 0
    tiers: tuple[set[bytes], set[bytes]] = field(default_factory=lambda: (set(), set()))  # (RAM, disk)
    predicted: dict[bytes, float] = field(default_factory=dict)  # hash -> until (time.monotonic)
    capped: bool = False

    def size(self) -> int:
        return len(self.tiers[0]) + len(self.tiers[1])


class ReportedIndex:
    def __init__(self, max_hashes: int = MAX_HASHES_PER_PREFILL) -> None:
        self.max_hashes = max_hashes
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()

    def cursor(self, prefill_id: str) -> tuple[str, int]:
        """(epoch, last applied seq) to ask the prefill for what came after."""
        with self._lock:
            held = self._held.get(prefill_id)
            return (held.epoch, held.last_seq) if held is not None else ("", 0)

    def apply(self, prefill_id: str, reply: Reply) -> None:
        with self._lock:
            if not reply.enabled:
                self._held.pop(prefill_id, None)
                return
            held = self._held.get(prefill_id)
            if held is None or reply.reset or reply.epoch != held.epoch:
                held = self._held[prefill_id] = _Held(reply.epoch)
            held.last_seq, held.salt, held.block_tokens = reply.last_seq, reply.salt, reply.block_tokens
            for run in reply.runs:
                for h in run.block_hashes if held.predicted else ():  # (its own word wins over a guess)
                    held.predicted.pop(h, None)
                tier = held.tiers[1 if run.disk else 0]
                if not run.stored:
                    tier.difference_update(run.block_hashes)
                    continue
                room = self.max_hashes - held.size()
                if room < len(run.block_hashes) and not held.capped:
                    held.capped = True
                    log.warning(kv(event="kv_index_capped", prefill=prefill_id, max_hashes=self.max_hashes))
                tier.update(run.block_hashes[: max(0, room)])

    def predict(self, member_id: str, tokens: list[int], scope: str) -> None:
        """Take `tokens`' whole blocks as held by a reporting member for PREDICT_S, until its
        events say so (the next turn may come first); a wrong guess costs a miss (the member
        looks the prompt up itself) and lapses."""
        with self._lock:
            held = self._held.get(member_id)
            salt, block_tokens = (b"", 0) if held is None else (held.salt, held.block_tokens)
        if block_tokens <= 0:
            return
        hashes = block_hashes(tokens, block_tokens, scoped_salt(salt, scope))  # (outside the lock)
        now = time.monotonic()
        with self._lock:
            held = self._held.get(member_id)
            if held is None or held.salt != salt:
                return  # (it restarted meanwhile)
            if len(held.predicted) + len(hashes) > MAX_PREDICTED:  # lapsed ones make room, when room is short
                held.predicted = {h: until for h, until in held.predicted.items() if until > now}
            room = max(0, MAX_PREDICTED - len(held.predicted))
            held.predicted.update((h, now + PREDICT_S) for h in hashes[:room])

    def any_enabled(self) -> bool:
        """Some prefill reports a prefix cache (one without is not held here)."""
        with self._lock:
            return bool(self._held)

    def forget(self, prefill_id: str) -> None:
        with self._lock:
            self._held.pop(prefill_id, None)

    def knows(self, prefill_id: str) -> bool:
        with self._lock:
            return prefill_id in self._held

    def size(self, prefill_id: str) -> int:
        with self._lock:
            held = self._held.get(prefill_id)
            return held.size() if held is not None else 0

    def matched_tokens(self, prefill_ids: list[str], tokens: list[int], scope: str) -> dict[str, int]:
        """Per reporting prefill of `prefill_ids`: the prompt's leading tokens it holds (whole
        blocks, any tier). Prefills that have not reported are left out."""
        now = time.monotonic()
        with self._lock:
            known = {p: self._held[p] for p in prefill_ids if p in self._held}
            out: dict[str, int] = {}
            chains: dict[tuple[bytes, int], list[bytes]] = {}
            for p, held in known.items():
                if held.block_tokens <= 0:
                    out[p] = 0
                    continue
                key = (held.salt, held.block_tokens)
                if key not in chains:
                    chains[key] = block_hashes(tokens, held.block_tokens, scoped_salt(held.salt, scope))
                ram, disk = held.tiers
                n = 0
                for h in chains[key]:
                    if h not in ram and h not in disk and held.predicted.get(h, 0.0) <= now:
                        break
                    n += 1
                out[p] = n * held.block_tokens
            return out
