"""A worker's recent costs, reported with each keepalive for the router's conditional
disaggregation (router/disaggregation.py): prompt tokens per second of its prefill compute (an
EWMA over passes or chunks), and a decode's seconds per step since the last report.
"""

from __future__ import annotations

EWMA_WEIGHT = 0.3  # of the newest pass's rate: a few passes follow a change of load


class CostMeter:
    def __init__(self) -> None:
        self.prefill_tokens_per_s = 0.0
        self.step_seconds = 0.0
        self._steps = 0
        self._busy_s = 0.0

    def prefilled(self, tokens: int, seconds: float) -> None:
        """`tokens` prompt positions were computed in `seconds`."""
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        old = self.prefill_tokens_per_s
        self.prefill_tokens_per_s = rate if old == 0 else (1 - EWMA_WEIGHT) * old + EWMA_WEIGHT * rate

    def steps(self, total_steps: int, total_busy_s: float) -> float:
        """Seconds per decode step since the last call, from the loop's running totals (the
        last figure while no step ran)."""
        steps, busy = total_steps - self._steps, total_busy_s - self._busy_s
        self._steps, self._busy_s = total_steps, total_busy_s
        if steps > 0:
            self.step_seconds = busy / steps
        return self.step_seconds
