"""Bytes each memory pass of a transfer moved, counted by the engine that did the pass.

Seed 002's argument for one-sided transfer is about memory-bus passes: a one-sided put is one
copy from the sender's memory into the receiver's, where a two-sided send/receive also copies
the bytes into the transport and out of a staging buffer. Each engine counts the passes its
own CPU makes, by name, so a benchmark (benchmarks/seed_transfer.py) and a unit test
(tests/unit/test_copy_counts.py) read the same figure for every transport:

- `memmove`: a direct copy from local memory into a peer's mapped memory (the host engine's
  shared-memory put; the one pass of a one-sided transfer).
- `socket_send`: bytes written from registered memory into a socket (the kernel copies them).
- `socket_recv`: bytes read from a socket into user memory (straight into the registered
  target on the host engine's TCP path; into a staging buffer on the two-sided path).
- `staging_copy`: bytes copied from a staging buffer into their final place (two-sided only).
"""

from __future__ import annotations

import threading

PASSES = ("memmove", "socket_send", "socket_recv", "staging_copy")


class CopyCounts:
    """Thread-safe byte counters, one per pass name."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes = dict.fromkeys(PASSES, 0)

    def add(self, name: str, nbytes: int) -> None:
        if name not in self._bytes:
            raise KeyError(f"unknown copy pass {name!r}; known: {', '.join(PASSES)}")
        with self._lock:
            self._bytes[name] += nbytes

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._bytes)

    def total(self) -> int:
        with self._lock:
            return sum(self._bytes.values())
