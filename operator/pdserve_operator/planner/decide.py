"""The replica decision: the smallest (P, D) that meets the SLOs, within bounds and a P:D band.

"Smallest" is the least cost P·prefill_cost + D·decode_cost (ties: fewer replicas, then fewer
prefills). Feasibility is monotone — more prefills never lengthen the queue, more decodes
never grow a batch — but the two roles are coupled through TTFT (the first token waits for a
decode step) and through the band, so the search walks the whole box once with each role's
side of the prediction computed once per count (`predict.prefill_side`/`decode_side`).
When nothing in the box meets the SLOs, the plan is the best it can do (the most replicas
the bounds and band allow) with `meets_slo` False and a reason naming what fell short.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache

from pdserve_operator.planner.perf import ServingModel
from pdserve_operator.planner.predict import Prediction, compose, decode_side, meets, prefill_side
from pdserve_operator.planner.workload import SLO, Workload


@dataclass(frozen=True)
class Bounds:
    min_prefill: int = 1
    max_prefill: int = 16
    min_decode: int = 1
    max_decode: int = 16
    min_ratio: float | None = None  # lowest P/D allowed
    max_ratio: float | None = None  # highest P/D allowed
    prefill_cost: float = 1.0
    decode_cost: float = 1.0

    def __post_init__(self) -> None:
        for role in ("prefill", "decode"):
            lo, hi = getattr(self, f"min_{role}"), getattr(self, f"max_{role}")
            if not 1 <= lo <= hi:
                raise ValueError(f"{role} bounds must satisfy 1 <= min <= max, got min={lo} max={hi}")
        for name in ("min_ratio", "max_ratio"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number, got {value}")
        if self.min_ratio is not None and self.max_ratio is not None and self.min_ratio > self.max_ratio:
            raise ValueError(f"min_ratio {self.min_ratio} exceeds max_ratio {self.max_ratio}")
        if self.prefill_cost <= 0 or self.decode_cost <= 0:
            raise ValueError(f"replica costs must be positive, got {self.prefill_cost}/{self.decode_cost}")
        if not any(True for _ in self.pairs()):
            raise ValueError(
                f"no (prefill, decode) within {self.min_prefill}..{self.max_prefill} x {self.min_decode}..{self.max_decode} "
                f"has a P:D ratio within [{self.min_ratio}, {self.max_ratio}]"
            )

    def in_band(self, prefill: int, decode: int) -> bool:
        ratio = prefill / decode
        # A hair of tolerance: 2/3 must count as within a band whose bound is written 0.6667.
        return (self.min_ratio is None or ratio >= self.min_ratio - 1e-9) and (
            self.max_ratio is None or ratio <= self.max_ratio + 1e-9
        )

    def contains(self, prefill: int, decode: int) -> bool:
        return (
            self.min_prefill <= prefill <= self.max_prefill
            and self.min_decode <= decode <= self.max_decode
            and self.in_band(prefill, decode)
        )

    def pairs(self) -> Iterator[tuple[int, int]]:
        """Every allowed (P, D), cheapest first (cost, then P + D, then P)."""
        allowed = [
            (p, d)
            for p in range(self.min_prefill, self.max_prefill + 1)
            for d in range(self.min_decode, self.max_decode + 1)
            if self.in_band(p, d)
        ]
        return iter(sorted(allowed, key=lambda pd: (self.cost(*pd), pd[0] + pd[1], pd[0])))

    def cost(self, prefill: int, decode: int) -> float:
        return prefill * self.prefill_cost + decode * self.decode_cost

    def clamp(self, prefill: int, decode: int) -> tuple[int, int]:
        """The allowed pair nearest to (P, D): clamp to the box, then move into the band by
        raising the role that is short (raising never hurts the SLOs), lowering only where the
        box forbids raising."""
        p = min(max(prefill, self.min_prefill), self.max_prefill)
        d = min(max(decode, self.min_decode), self.max_decode)
        if self.max_ratio is not None and p / d > self.max_ratio + 1e-9:
            d = min(self.max_decode, math.ceil(p / self.max_ratio - 1e-9))
            if p / d > self.max_ratio + 1e-9:
                p = max(self.min_prefill, math.floor(d * self.max_ratio + 1e-9))
        if self.min_ratio is not None and p / d < self.min_ratio - 1e-9:
            p = min(self.max_prefill, math.ceil(d * self.min_ratio - 1e-9))
            if p / d < self.min_ratio - 1e-9:
                d = max(self.min_decode, math.floor(p / self.min_ratio + 1e-9))
        if not self.contains(p, d):  # an odd box corner: take the nearest allowed pair
            p, d = min(
                ((a, b) for a, b in self.pairs()), key=lambda ab: (abs(ab[0] - prefill) + abs(ab[1] - decode), -ab[0])
            )
        return p, d


def smallest_pair(feasible: Callable[[int, int], bool], bounds: Bounds) -> tuple[int, int] | None:
    """The cheapest allowed (P, D) with `feasible(P, D)`, or None."""
    for p, d in bounds.pairs():
        if feasible(p, d):
            return p, d
    return None


@dataclass(frozen=True)
class Plan:
    prefill: int
    decode: int
    prediction: Prediction
    meets_slo: bool
    reason: str


def _ms(seconds: float) -> str:
    if math.isinf(seconds):
        return "unbounded"
    return f"{seconds * 1e3:.0f}ms" if seconds < 1 else f"{seconds:.2f}s"


def plan_replicas(model: ServingModel, workload: Workload, bounds: Bounds, slo: SLO | None = None) -> Plan:
    """The smallest (P, D) meeting `slo` (default: the workload's) for the workload's rate."""
    slo = slo or workload.slo
    q = slo.quantile
    pf = lru_cache(maxsize=None)(lambda p: prefill_side(model, workload, p, q))
    dc = lru_cache(maxsize=None)(lambda d: decode_side(model, workload, d, q))

    def prediction(p: int, d: int) -> Prediction:
        return compose(model, workload, pf(p), dc(d), p, d, q)

    def feasible(p: int, d: int) -> bool:
        ttft_ok, tpot_ok = meets(model, pf(p), dc(d), slo)
        return ttft_ok and tpot_ok

    found = smallest_pair(feasible, bounds)
    if found is not None:
        p, d = found
        pred = prediction(p, d)
        return Plan(p, d, pred, True, _reason(bounds, slo, pred, prediction, met=True))
    p, d = bounds.clamp(bounds.max_prefill, bounds.max_decode)
    pred = prediction(p, d)
    return Plan(p, d, pred, False, _reason(bounds, slo, pred, prediction, met=False))


def _reason(bounds: Bounds, slo: SLO, pred: Prediction, prediction: Callable[[int, int], Prediction], met: bool) -> str:
    q = f"p{round(slo.quantile * 100, 2):g}"
    parts = [f"{pred.arrival_rate:.3g} req/s"]
    if slo.ttft_ms is not None:
        sign = "<=" if pred.meets_ttft(slo) else ">"
        parts.append(f"ttft {q} {_ms(pred.ttft_q_s)} {sign} {slo.ttft_ms:g}ms")
    if slo.tpot_ms is not None:
        sign = "<=" if pred.meets_tpot(slo) else ">"
        parts.append(f"tpot {q} {_ms(pred.tpot_q_s)} {sign} {slo.tpot_ms:g}ms")
    if not pred.kv_fits:
        parts.append(f"{pred.decode_slots_q} slots in use per decode exceed its {pred.decode_capacity}")
    if pred.prefill_utilization >= 1:
        parts.append(f"prefill overloaded (utilisation {pred.prefill_utilization:.2f})")
    if not met:
        parts.append(f"SLO not reachable within bounds (max {bounds.max_prefill} prefill, {bounds.max_decode} decode)")
        return "; ".join(parts)
    # Say when the band or a minimum, not the SLO, set a count.
    p, d = pred.prefill, pred.decode
    if p > bounds.min_prefill and prediction(p - 1, d).meets_ttft(slo):
        parts.append(f"prefill {p} set by the P:D band (the SLO needs fewer)")
    if d > bounds.min_decode and prediction(p, d - 1).meets_tpot(slo) and prediction(p, d - 1).meets_ttft(slo):
        parts.append(f"decode {d} set by the P:D band (the SLO needs fewer)")
    return "; ".join(parts)
