"""Cut generated text at the first stop string, even when it spans several tokens.

Tokens arrive as text deltas; a stop string such as "\\n\\nUser:" can be split across any of
them. The cutter releases text as soon as it cannot be part of a stop string and holds back
only the longest suffix that is still a prefix of one, so a stream never shows text that a
later token reveals to be a stop string, and never waits longer than it must.

Hand-written because it is a few lines of pure logic tied to our streaming contract; the
serving libraries that do the same (vLLM, TGI) do not expose it as a reusable piece.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringCutter:
    """Feed text deltas in order; get back the text that is safe to emit.

    After `stopped` turns true, everything before the stop string has been returned and
    further input is ignored. `flush()` releases the held-back tail at the end of generation.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError(f"stop strings must be non-empty, got {list(stops)!r}")
        self._stops = tuple(stops)
        self._pending = ""  # text received but not yet released (a possible stop prefix)
        self.stopped = False
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Add a delta; return the text that can be released now (possibly empty)."""
        if self.stopped:
            return ""
        if not self._stops:
            return text
        self._pending += text
        cut = self._first_match()
        if cut is not None:
            index, stop = cut
            released = self._pending[:index]
            self._pending = ""
            self.stopped = True
            self.matched = stop
            return released
        hold = self._held_suffix_start()
        released, self._pending = self._pending[:hold], self._pending[hold:]
        return released

    def flush(self) -> str:
        """Release whatever is held back: generation ended without completing a stop string."""
        released, self._pending = self._pending, ""
        return released

    def _first_match(self) -> tuple[int, str] | None:
        """Earliest occurrence of any stop string in the pending text, with the string found."""
        found = [(i, stop) for stop in self._stops if (i := self._pending.find(stop)) >= 0]
        return min(found, key=lambda hit: hit[0]) if found else None

    def _held_suffix_start(self) -> int:
        """Start of the longest pending suffix that is a proper prefix of some stop string."""
        longest = max(len(s) for s in self._stops) - 1
        for start in range(max(0, len(self._pending) - longest), len(self._pending)):
            tail = self._pending[start:]
            if any(stop.startswith(tail) for stop in self._stops):
                return start
        return len(self._pending)
