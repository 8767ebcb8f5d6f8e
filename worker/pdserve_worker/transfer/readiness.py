"""Decode side: wait until a slot's KV has arrived (its `kv_ready` notify), in one of three modes.

- `interrupt` (default): the waiter sleeps until the notify arrives (the host engine's
  `wait_notifies`; on real HIXL one thread polls `get_notifies` every `poll_interval_us`).
- `poll`: drain `get_notifies` every `poll_interval_us` microseconds.
- `spin`: drain continuously (yielding the GIL): lowest latency, one busy core.
The engine has one notify queue: the first waiter without a drainer becomes it (leader/
follower), drains for everybody and files each message under its slot; the others sleep on a
condition. A message is filed only if `authorize(slot, generation, nonce)` says it carries the
reservation's capability (a forged notify is dropped however it arrived) and `accepts(slot,
generation)` says the slot waits for exactly that generation (a late notify of an abandoned
transfer is never taken for the new request's KV). Nothing else is kept: dropped notifies are
counted by reason (`drops`), with a rate-limited summary log line. A taken message passes
`check` (the KV digests, transfer/digest.py) before it is returned: what it raises, the waiter raises.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from enum import Enum
from typing import Any

from pdserve_worker.transfer.base import TransferBackend
from pdserve_worker.transfer.push import READY_NOTIFY
from pdserve_worker.util.drops import DropCounter

log = logging.getLogger(__name__)

# How long one sleep lasts before a waiter re-checks its lease and deadline.
RECHECK_S = 0.25


class ReadinessMode(str, Enum):
    INTERRUPT = "interrupt"
    POLL = "poll"
    SPIN = "spin"


class ReadinessTimeout(TimeoutError):
    """No ready notify for (slot, generation) within the timeout."""


class SlotNotReserved(RuntimeError):
    """The slot stopped waiting for this generation (lease expired or released) while we waited."""


class Readiness:
    def __init__(
        self,
        backend: TransferBackend,
        mode: ReadinessMode | str = ReadinessMode.INTERRUPT,
        *,
        accepts: Callable[[int, int], bool] = lambda slot, generation: True,
        authorize: Callable[[int, int, str], bool] | None = None,
        poll_interval_us: int = 100,
        warmup: Callable[[int, int], None] | None = None,
        on_other: Callable[[Any], None] | None = None,
    ) -> None:
        self.mode = ReadinessMode(mode)
        if poll_interval_us <= 0:
            raise ValueError(f"poll_interval_us must be > 0, got {poll_interval_us}")
        self._engine = backend.engine
        self._api = backend.api
        # Interrupt mode sleeps in the engine where it can (host engine), else polls (real HIXL).
        self._blocking = backend.blocking if self.mode is ReadinessMode.INTERRUPT else None
        self._interval_s = poll_interval_us / 1e6
        self._accepts = accepts
        self._authorize = authorize  # None: no capability check (tests of the engine alone)
        self.drops = DropCounter(log, "ready_notifies_dropped")
        self._warmup = warmup
        self._on_other = on_other
        self._cond = threading.Condition()
        self._draining = False
        self._mailbox: dict[int, dict[str, Any]] = {}  # slot -> its ready message
        # (slot, generation, message): raises if the message's KV cannot be used (digest.ReadyDigests.check)
        self.check: Callable[[int, int, dict[str, Any]], object] | None = None

    # ---- waiting -------------------------------------------------------------------------------------
    def wait(self, slot: int, generation: int, timeout_s: float) -> dict[str, Any]:
        """Block until (slot, generation)'s ready message arrives; returns it (then warms the slot).

        Raises ReadinessTimeout, or SlotNotReserved when the lease ended meanwhile."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                message = self._take(slot, generation)
                if message is not None:
                    break
                if not self._accepts(slot, generation):
                    raise SlotNotReserved(f"slot {slot} generation {generation} is no longer reserved")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ReadinessTimeout(
                        f"no {READY_NOTIFY} for slot {slot} generation {generation} within {timeout_s}s "
                        f"(mode={self.mode.value})"
                    )
                if self._draining:
                    self._cond.wait(min(remaining, RECHECK_S))
                    continue
                self._drain_for_everyone(min(remaining, RECHECK_S))
        if self.check is not None:
            self.check(slot, generation, message)
        if self._warmup is not None:
            self._warmup(slot, int(message.get("num_tokens", 0)))
        return message

    def try_take(self, slot: int, generation: int) -> dict[str, Any] | None:
        """Non-blocking: the ready message if it has arrived, else None (for a scheduler that
        checks its pending slots between decode steps)."""
        with self._cond:
            if not self._draining:
                status, items = self._engine.get_notifies()
                if status == self._api.SUCCESS and items:
                    self._file(items)
            message = self._take(slot, generation)
        if message is not None and self.check is not None:
            self.check(slot, generation, message)
        return message

    def forget(self, slot: int) -> None:
        """Drop what is filed for a slot (it was released)."""
        with self._cond:
            self._mailbox.pop(slot, None)

    # ---- draining (lock held on entry and exit) ------------------------------------------------------
    def _drain_for_everyone(self, timeout_s: float) -> None:
        self._draining = True
        self._cond.release()
        try:
            items = self._fetch(timeout_s)
        finally:
            self._cond.acquire()
            self._draining = False
            self._cond.notify_all()  # filed messages, or a new drainer is needed
        self._file(items)

    def _fetch(self, timeout_s: float) -> list[Any]:
        """Wait up to timeout_s for notifies, the way the mode says. Returns what was drained."""
        if self._blocking is not None:
            status, items = self._blocking.wait_notifies(timeout_s)
            return list(items) if status in (self._api.SUCCESS, self._api.TIMEOUT) else []
        deadline = time.monotonic() + timeout_s
        spin = self.mode is ReadinessMode.SPIN
        while True:
            status, items = self._engine.get_notifies()
            if status == self._api.SUCCESS and items:
                return list(items)
            if time.monotonic() >= deadline:
                return []
            time.sleep(0 if spin else self._interval_s)  # sleep(0) still yields the GIL

    def _file(self, items: list[Any]) -> None:
        for item in items:
            if item.name != READY_NOTIFY:
                if self._on_other is not None:
                    self._on_other(item)
                else:
                    self.drops.count("other_name")
                continue
            try:
                message = json.loads(item.notify_msg)
                slot, generation = int(message["slot"]), int(message["generation"])
                nonce = message.get("nonce")
            except (ValueError, KeyError, TypeError, RecursionError):
                self.drops.count("malformed")
                continue
            if self._authorize is not None and not (
                isinstance(nonce, str) and self._authorize(slot, generation, nonce)
            ):
                self.drops.count("bad_capability", slot=slot, generation=generation)
                continue
            if not self._accepts(slot, generation):
                self.drops.count("stale", slot=slot, generation=generation)
                continue
            self._mailbox[slot] = message

    def _take(self, slot: int, generation: int) -> dict[str, Any] | None:
        message = self._mailbox.get(slot)
        if message is None:
            return None
        filed = int(message["generation"])
        if filed != generation:
            if not self._accepts(slot, filed):
                # Filed while its generation was current; the slot was released since.
                del self._mailbox[slot]
                self.drops.count("stale", slot=slot, generation=filed)
            return None  # (a newer generation's message stays for its own waiter)
        del self._mailbox[slot]
        return message
