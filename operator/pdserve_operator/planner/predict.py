"""Predicted TTFT and TPOT of a (P prefill, D decode) deployment under a workload.

TTFT = request overhead + prefill queue wait + prefill service (compute + exposed KV push)
       + the wait for the decode's current step to end (the first token is dispatched between
       two decode steps: `decode/generation_loop.py`).
TPOT = the decode step time a request sees (one token per step per sequence).

Wait + service is a convolution (the wait of `queueing.py` with the service times of the prompt
lengths), its quantiles found by bisection. The TPOT's q-quantile is the step time at the
q-quantile of the batch a request joins (an upper bound). KV capacity: a slot is held from
before the prefill to the answer's end, so the q-quantile of the slots in use (requests before
their first token, M/G/∞, plus the batch) must fit the decode's capacity.
The model in detail: docs/planner.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve_operator.planner.perf import ServingModel
from pdserve_operator.planner.queueing import (
    batch_distribution,
    convolve,
    distribution_quantile,
    mgc_wait,
    poisson_pmf,
    wait_quantile,
)
from pdserve_operator.planner.workload import SLO, Workload


@dataclass(frozen=True)
class Prediction:
    prefill: int
    decode: int
    arrival_rate: float
    quantile: float
    prefill_utilization: float  # λ·E[S] / P; ≥ 1: the queue grows without bound
    prefill_wait_mean_s: float
    prefill_service_mean_s: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_q_s: float  # at `quantile`
    decode_batch_mean: float  # time-average sequences in one decode's batch
    decode_batch_q: int  # a request's batch (itself included) at `quantile`
    tpot_mean_s: float
    tpot_q_s: float
    decode_slots_mean: float  # slots held at one decode (reserved through prefill, then decoding)
    decode_slots_q: int
    decode_capacity: int | None  # requests one decode holds (slots / memory); None: no limit
    kv_fits: bool  # decode_slots_q within decode_capacity

    @property
    def stable(self) -> bool:
        return self.prefill_utilization < 1 and math.isfinite(self.decode_batch_mean)

    def meets_ttft(self, slo: SLO) -> bool:
        return slo.ttft_ms is None or (self.prefill_utilization < 1 and self.ttft_q_s * 1e3 <= slo.ttft_ms)

    def meets_tpot(self, slo: SLO) -> bool:
        ok = math.isfinite(self.decode_batch_mean) and self.kv_fits
        return ok and (slo.tpot_ms is None or self.tpot_q_s * 1e3 <= slo.tpot_ms)


CDF_SLACK = 1e-12  # a quantile is met where the CDF reaches q but for float rounding


@dataclass(frozen=True)
class PrefillSide:
    utilization: float
    p_wait: float
    wait_mean_s: float
    service_mean_s: float
    service_points: tuple[tuple[float, float], ...]  # (seconds, probability), sorted

    def response_cdf(self, x: float) -> float:
        """P(wait + service <= x)."""
        if math.isinf(self.wait_mean_s):
            return 0.0
        theta = self.wait_mean_s / self.p_wait if self.p_wait > 0 else 0.0
        total = 0.0
        for s, p in self.service_points:
            if s <= x:
                tail = self.p_wait * math.exp(-(x - s) / theta) if theta > 0 else 0.0
                total += p * (1.0 - tail)
        return total

    def response_quantile(self, q: float) -> float:
        """The q-quantile of wait + service, by bisection on `response_cdf`."""
        if math.isinf(self.wait_mean_s):
            return math.inf
        lo = self.service_points[0][0]
        hi = self.service_points[-1][0] + max(1e-9, self.wait_quantile_bound(q))
        # (`meets` asks the same CDF the same question with the same 1e-12 slack: at a step of
        # the CDF, where the quantile sits exactly, both must land on the same side)
        while self.response_cdf(hi) < q - CDF_SLACK:
            hi *= 2
        for _ in range(40):  # to 1e-12 of the span: far below a millisecond
            mid = (lo + hi) / 2
            if self.response_cdf(mid) >= q - CDF_SLACK:
                hi = mid
            else:
                lo = mid
        return hi

    def wait_quantile_bound(self, q: float) -> float:
        return wait_quantile(q, self.p_wait, self.wait_mean_s)


@dataclass(frozen=True)
class DecodeSide:
    rate: float  # arrivals per second at one decode
    steps: float  # decode steps per request (output tokens - 1)
    batch_pmf: tuple[float, ...] | None  # π(n) of the batch; None: the decode cannot keep up
    batch_mean: float
    batch_q: int  # a request's batch (itself included) at the quantile
    step_mean_s: float  # mean TPOT (Little: E[N] / (λ_d · K))
    step_q_s: float
    busy: float  # share of time the decode is stepping


def prefill_side(model: ServingModel, workload: Workload, prefill: int, quantile: float) -> PrefillSide:
    """M/G/c over the prompt length distribution (service time per point, exact moments)."""
    if prefill < 1:
        raise ValueError(f"prefill replicas must be >= 1, got {prefill}")
    points = sorted((model.prefill_service_seconds(n), p) for n, p in workload.prompt_tokens.points())
    mean = sum(s * p for s, p in points)
    second = sum(s * s * p for s, p in points)
    rate = workload.arrival_rate
    p_wait, wait_mean = mgc_wait(rate, mean, second, prefill)
    return PrefillSide(
        utilization=rate * mean / prefill,
        p_wait=p_wait,
        wait_mean_s=wait_mean,
        service_mean_s=mean,
        service_points=tuple(points),
    )


def mean_decode_context(workload: Workload) -> float:
    """Time-average context of a sequence in a batch: Σ steps·(prompt + output/2) / Σ steps."""
    prompt_mean = workload.prompt_tokens.mean()
    out = workload.output_tokens.points()
    steps = sum((m - 1) * p for m, p in out)
    if steps <= 0:
        return prompt_mean
    return prompt_mean + sum((m - 1) * m / 2 * p for m, p in out) / steps


def decode_side(model: ServingModel, workload: Workload, decode: int, quantile: float) -> DecodeSide:
    if decode < 1:
        raise ValueError(f"decode replicas must be >= 1, got {decode}")
    steps = sum((m - 1) * p for m, p in workload.output_tokens.points())
    context = mean_decode_context(workload)

    def step(n: int) -> float:
        return model.decode_step_seconds(n, n * context)

    rate = workload.arrival_rate / decode
    pmf = batch_distribution(rate, steps, step)
    if pmf is None:
        return DecodeSide(rate, steps, None, math.inf, 10**9, math.inf, math.inf, 1.0)
    batch_mean = sum(n * p for n, p in enumerate(pmf))
    batch_q = 1 + distribution_quantile(pmf, quantile)
    step_mean = batch_mean / (rate * steps) if rate > 0 and steps > 0 else step(1)
    return DecodeSide(
        rate=rate,
        steps=steps,
        batch_pmf=tuple(pmf),
        batch_mean=batch_mean,
        batch_q=batch_q,
        step_mean_s=step_mean,
        step_q_s=step(batch_q),
        busy=1 - pmf[0],
    )


def predict(
    model: ServingModel, workload: Workload, prefill: int, decode: int, quantile: float | None = None
) -> Prediction:
    """The prediction for P = `prefill`, D = `decode`; `quantile` defaults to the SLO's."""
    q = workload.slo.quantile if quantile is None else quantile
    return compose(
        model,
        workload,
        prefill_side(model, workload, prefill, q),
        decode_side(model, workload, decode, q),
        prefill,
        decode,
        q,
    )


def _dispatch(dc: DecodeSide, quantile: float) -> tuple[float, float]:
    """(mean, q-quantile) of the wait for the decode's current step before the first token."""
    return dc.busy * dc.step_mean_s / 2, (dc.step_q_s if dc.busy > 1 - quantile else 0.0)


def _slots(pf: PrefillSide, dc: DecodeSide, quantile: float) -> tuple[float, int]:
    """(mean, q-quantile) of the slots held at one decode.

    A slot is held from the reservation (before the prefill queue) to the last token: the
    requests still before their first token at one decode (M/G/∞: Poisson) plus its batch (π).
    """
    before_decode = dc.rate * (pf.wait_mean_s + pf.service_mean_s + _dispatch(dc, quantile)[0])
    if dc.batch_pmf is None or not math.isfinite(before_decode):
        return math.inf, 10**9
    slots = convolve(poisson_pmf(before_decode), list(dc.batch_pmf))
    return before_decode + dc.batch_mean, distribution_quantile(slots, quantile)


def meets(model: ServingModel, pf: PrefillSide, dc: DecodeSide, slo: SLO) -> tuple[bool, bool]:
    """(TTFT target met, TPOT target and KV capacity met) — what `Prediction.meets_*` say, with
    one CDF evaluation instead of a quantile search (the planner asks this for many pairs)."""
    q = slo.quantile
    ttft_ok = True
    if slo.ttft_ms is not None:
        budget = slo.ttft_ms / 1e3 - model.profile.request_overhead_s - _dispatch(dc, q)[1]
        ttft_ok = pf.utilization < 1 and budget > 0 and pf.response_cdf(budget) >= q - CDF_SLACK
    if dc.batch_pmf is None or (slo.tpot_ms is not None and dc.step_q_s * 1e3 > slo.tpot_ms):
        return ttft_ok, False
    capacity = model.decode_capacity
    return ttft_ok, capacity is None or _slots(pf, dc, q)[1] <= capacity


def compose(
    model: ServingModel, workload: Workload, pf: PrefillSide, dc: DecodeSide, prefill: int, decode: int, quantile: float
) -> Prediction:
    """A prediction from the two sides, computed once per count (the planner's grid reuses them)."""
    overhead = model.profile.request_overhead_s
    dispatch_mean, dispatch_q = _dispatch(dc, quantile)
    capacity = model.decode_capacity
    slots_mean, slots_q = _slots(pf, dc, quantile)
    return Prediction(
        prefill=prefill,
        decode=decode,
        arrival_rate=workload.arrival_rate,
        quantile=quantile,
        prefill_utilization=pf.utilization,
        prefill_wait_mean_s=pf.wait_mean_s,
        prefill_service_mean_s=pf.service_mean_s,
        ttft_mean_s=overhead + pf.wait_mean_s + pf.service_mean_s + dispatch_mean,
        ttft_p50_s=overhead + pf.response_quantile(0.5) + dispatch_mean,
        ttft_q_s=overhead + pf.response_quantile(quantile) + dispatch_q,
        decode_batch_mean=dc.batch_mean,
        decode_batch_q=dc.batch_q,
        tpot_mean_s=dc.step_mean_s,
        tpot_q_s=dc.step_q_s,
        decode_slots_mean=slots_mean,
        decode_slots_q=slots_q,
        decode_capacity=capacity,
        kv_fits=capacity is None or slots_q <= capacity,
    )
