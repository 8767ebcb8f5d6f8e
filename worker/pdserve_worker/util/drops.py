"""Counting what a hostile or confused peer sends us, without a log line per event.

A forged notify, a refused write or a failed handshake is cheap to send and must stay cheap
to receive: one log line each would let a peer flood the logs (and the disk behind them).
`DropCounter` counts by reason (the numbers are what `status`/metrics report) and logs a
summary at most once per `interval_s`: the first event at once, later ones folded into the
next summary.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

from pdserve_common.logs import kv

SUMMARY_INTERVAL_S = 10.0


class DropCounter:
    def __init__(
        self,
        logger: logging.Logger,
        event: str,
        interval_s: float = SUMMARY_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        **context: object,
    ) -> None:
        self._log = logger
        self._event = event
        self._interval = interval_s
        self._clock = clock
        self._context = context
        self._lock = threading.Lock()
        self._totals: Counter[str] = Counter()
        self._unlogged: Counter[str] = Counter()
        self._next_log = 0.0
        self.summaries = 0  # log lines written: what a test bounds

    def count(self, reason: str, **detail: object) -> None:
        """One event of `reason`. `detail` goes into the log line only if this event is logged."""
        now = self._clock()
        with self._lock:
            self._totals[reason] += 1
            self._unlogged[reason] += 1
            if now < self._next_log:
                return
            self._next_log = now + self._interval
            batch = dict(self._unlogged)
            self._unlogged.clear()
            self.summaries += 1
        fields: dict[str, object] = {"event": self._event, **self._context}
        fields.update({f"n_{k}": v for k, v in sorted(batch.items())})
        fields.update(detail)
        self._log.warning(kv(**fields))

    def totals(self) -> dict[str, int]:
        with self._lock:
            return dict(self._totals)

    def total(self) -> int:
        with self._lock:
            return sum(self._totals.values())
