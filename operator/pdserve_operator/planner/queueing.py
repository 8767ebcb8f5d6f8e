"""Queueing formulas the planner predicts with, each with the reason it applies.

Prefill: M/G/c (Poisson arrivals, one prompt at a time per worker, join-the-shortest-queue
routing close to one central queue). The mean wait is Allen–Cunneen (Erlang C scaled by
(1 + Cs²)/2; exact for M/M/c and, at c = 1, Pollaczek–Khinchine); its tail is exponential
behind the atom at zero: P(W > t) = P(wait) · exp(-t · P(wait) / E[W]).

Decode: continuous batching is processor sharing with a state-dependent rate, a symmetric
queue, so the number of sequences is π(n) ∝ Π_{k≤n} λ_d · K · t(k) / k (K: decode steps per
request, t(k): the step time at batch k). A request's batch is 1 + N, N ~ π (PASTA); the step
time at its q-quantile bounds the TPOT's q-quantile from above.
Derivations: docs/planner.md; measurements: benchmarks/README.md ("Planner model").
"""

from __future__ import annotations

import math
from collections.abc import Callable


def erlang_b(servers: int, offered: float) -> float:
    """Blocking probability of M/M/c/c with offered load a = λ/μ (stable recursion)."""
    if servers < 0:
        raise ValueError(f"servers must be >= 0, got {servers}")
    b = 1.0
    for k in range(1, servers + 1):
        b = offered * b / (k + offered * b)
    return b


def erlang_c(servers: int, offered: float) -> float:
    """Probability that an arrival waits in M/M/c with offered load a = λ/μ (a < c)."""
    if servers < 1:
        raise ValueError(f"servers must be >= 1, got {servers}")
    if offered <= 0:
        return 0.0
    rho = offered / servers
    if rho >= 1:
        return 1.0
    b = erlang_b(servers, offered)
    return b / (1 - rho * (1 - b))


def mgc_wait(rate: float, mean_service: float, second_moment: float, servers: int) -> tuple[float, float]:
    """(P(wait), E[wait]) in M/G/c by Allen–Cunneen; (1, inf) when overloaded."""
    if rate <= 0 or mean_service <= 0:
        return 0.0, 0.0
    offered = rate * mean_service
    if offered >= servers:
        return 1.0, math.inf
    scv = max(0.0, second_moment / (mean_service * mean_service) - 1.0)
    p_wait = erlang_c(servers, offered)
    mmc_wait = p_wait * mean_service / (servers - offered)
    return p_wait, mmc_wait * (1.0 + scv) / 2.0


def wait_quantile(q: float, p_wait: float, mean_wait: float) -> float:
    """The q-quantile of the wait: 0 below the atom, else an exponential tail with the right mean."""
    if not 0 < q < 1:
        raise ValueError(f"quantile must be in (0, 1), got {q}")
    if math.isinf(mean_wait):
        return math.inf
    if p_wait <= 1 - q or mean_wait <= 0:
        return 0.0
    return mean_wait / p_wait * math.log(p_wait / (1 - q))


def batch_distribution(
    rate: float,
    steps_per_request: float,
    step_seconds: Callable[[int], float],
    tail: float = 1e-12,
    limit: int = 100_000,
) -> list[float] | None:
    """π(0..n_max) of the decode batch (see the module docstring); None if the decode cannot keep up.

    `step_seconds(n)` is the step time with n sequences, non-decreasing. The product is kept in
    log space; the series stops once the terms are below `tail` and falling.
    """
    if rate <= 0 or steps_per_request <= 0:
        return [1.0]
    demand = rate * steps_per_request
    # The ratio tends to demand · (slope of t) for a large batch (t is linear there): at or
    # above 1 the batch grows without bound.
    big = 1 << 20
    if demand * (step_seconds(big) - step_seconds(big // 2)) / (big // 2) >= 1:
        return None
    logs = [0.0]
    log_term, peak = 0.0, 0.0
    n = 0
    while True:
        n += 1
        ratio = demand * step_seconds(n) / n
        log_term += math.log(ratio) if ratio > 0 else -math.inf
        logs.append(log_term)
        peak = max(peak, log_term)
        if ratio < 1 and log_term - peak < math.log(tail):
            break
        if n >= limit:
            return None
    weights = [math.exp(v - peak) for v in logs]
    total = sum(weights)
    return [w / total for w in weights]


def distribution_quantile(pmf: list[float], q: float) -> int:
    acc = 0.0
    for k, p in enumerate(pmf):
        acc += p
        if acc >= q - 1e-12:
            return k
    return len(pmf) - 1


def poisson_pmf(mean: float, tail: float = 1e-12) -> list[float]:
    """Poisson probabilities 0..k_max (k_max beyond the mean where the terms fall below `tail`)."""
    if mean <= 0:
        return [1.0]
    # In log space: exp(-mean) underflows for large means.
    logs, k, log_term = [], 0, -mean
    while True:
        logs.append(log_term)
        k += 1
        log_term += math.log(mean / k)
        if k > mean and log_term < math.log(tail):
            break
    return [math.exp(v) for v in logs]


def convolve(a: list[float], b: list[float]) -> list[float]:
    out = [0.0] * (len(a) + len(b) - 1)
    for i, x in enumerate(a):
        if x < 1e-15:
            continue
        for j, y in enumerate(b):
            out[i + j] += x * y
    return out
