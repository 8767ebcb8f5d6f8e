"""Which members left the membership lately: whether a request that finds no member to use
should wait for one (one that left a moment ago is most likely restarting, or the view is
refilling after a broker restart) or fail now (nobody left: the members there are all the
deployment has, and they failed this request already).

A pod that restarts under a Deployment comes back under a new name, so what is remembered is
that *someone* of the role left within `window_s`, not who; entries older than that are
dropped as they are met, so the memory is bounded by the departures of one window.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pdserve_common.membership import Role

WINDOW_S = 60.0  # longer than a worker's restart and registration (pdserve local: about 10-30 s)


class Departures:
    def __init__(self, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s, self.clock = window_s, clock
        self._left: dict[Role, dict[str, float]] = {}

    def left(self, role: Role, worker_id: str) -> None:
        self._left.setdefault(role, {})[worker_id] = self.clock()

    def joined(self, role: Role, worker_id: str) -> None:
        self._left.get(role, {}).pop(worker_id, None)

    def recent(self, role: Role) -> bool:
        """Whether a member of `role` left within the window (and has not come back as itself)."""
        left = self._left.get(role, {})
        since = self.clock() - self.window_s
        for worker_id in [w for w, at in left.items() if at < since]:
            del left[worker_id]
        return bool(left)
