"""The queueing formulas against independent references: exact birth-death solutions, the
Pollaczek–Khinchine formula, and small simulations written here (not the planner's own)."""

from __future__ import annotations

import heapq
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve_operator.planner.queueing import (
    batch_distribution,
    convolve,
    distribution_quantile,
    erlang_c,
    mgc_wait,
    poisson_pmf,
    wait_quantile,
)


def mmc_by_birth_death(lam: float, mu: float, c: int, n_max: int = 4000) -> tuple[float, float]:
    """(P(wait), E[Wq]) of M/M/c from its stationary distribution, summed numerically."""
    weights = [1.0]
    for n in range(1, n_max):
        weights.append(weights[-1] * lam / (min(n, c) * mu))
    total = sum(weights)
    pi = [w / total for w in weights]
    p_wait = sum(pi[c:])
    lq = sum((n - c) * p for n, p in enumerate(pi) if n > c)
    return p_wait, lq / lam


@given(c=st.integers(1, 12), rho=st.floats(0.05, 0.95))
@settings(max_examples=60, deadline=None)
def test_erlang_c_and_mmc_wait_are_exact(c, rho):
    mu = 2.0
    lam = rho * c * mu
    p_ref, w_ref = mmc_by_birth_death(lam, mu, c)
    assert erlang_c(c, lam / mu) == pytest.approx(p_ref, rel=1e-6, abs=1e-12)
    # Exponential service: E[S²] = 2/μ², Cs² = 1, Allen–Cunneen is exact.
    p, w = mgc_wait(lam, 1 / mu, 2 / mu**2, c)
    assert p == pytest.approx(p_ref, rel=1e-6, abs=1e-12)
    assert w == pytest.approx(w_ref, rel=1e-6, abs=1e-12)


@given(c=st.integers(1, 8), rho=st.floats(0.1, 0.95), q=st.floats(0.5, 0.999))
@settings(max_examples=60, deadline=None)
def test_wait_quantile_is_exact_for_mmc(c, rho, q):
    """M/M/c: P(W > t) = C(c, a) · exp(-(cμ − λ) t)."""
    mu, lam = 1.0, rho * c
    p_wait, mean = mgc_wait(lam, 1 / mu, 2 / mu**2, c)
    t = wait_quantile(q, p_wait, mean)
    if p_wait <= 1 - q:
        assert t == 0
    else:
        assert p_wait * math.exp(-(c * mu - lam) * t) == pytest.approx(1 - q, rel=1e-9)


@given(rho=st.floats(0.05, 0.95), spread=st.floats(0, 3))
def test_single_server_is_pollaczek_khinchine(rho, spread):
    mean = 0.5
    second = mean**2 * (1 + spread)  # any Cs² = spread
    lam = rho / mean
    _, w = mgc_wait(lam, mean, second, 1)
    assert w == pytest.approx(lam * second / (2 * (1 - rho)), rel=1e-9)


def test_overload_and_idle_edges():
    assert mgc_wait(2.0, 1.0, 1.0, 2) == (1.0, math.inf)
    assert mgc_wait(0.0, 1.0, 1.0, 2) == (0.0, 0.0)
    assert wait_quantile(0.99, 1.0, math.inf) == math.inf
    with pytest.raises(ValueError):
        wait_quantile(1.0, 0.5, 1.0)
    with pytest.raises(ValueError):
        erlang_c(0, 1.0)


def fcfs_servers(lam: float, services: list[float], weights: list[float], c: int, n: int, seed: int) -> float:
    """Mean wait of a FCFS queue in front of c servers (each prompt to the first free one)."""
    rng = random.Random(seed)
    free = [0.0] * c
    t, waits = 0.0, []
    for _ in range(n):
        t += rng.expovariate(lam)
        s = rng.choices(services, weights)[0]
        start = max(t, heapq.heappop(free))
        waits.append(start - t)
        heapq.heappush(free, start + s)
    return sum(waits[n // 10 :]) / (n - n // 10)


@pytest.mark.parametrize("c", [1, 2, 4])
@pytest.mark.parametrize("kind", ["deterministic", "two-point"])
def test_allen_cunneen_close_to_simulation_for_mgc(c, kind):
    """The planner's M/G/c approximation for prompt mixes: within 12% of a simulated queue."""
    services, weights = ([1.0], [1.0]) if kind == "deterministic" else ([0.3, 2.3], [0.65, 0.35])
    mean = sum(s * w for s, w in zip(services, weights))
    second = sum(s * s * w for s, w in zip(services, weights))
    lam = 0.75 * c / mean
    _, predicted = mgc_wait(lam, mean, second, c)
    simulated = sum(fcfs_servers(lam, services, weights, c, 60_000, seed) for seed in range(3)) / 3
    assert predicted == pytest.approx(simulated, rel=0.12)


def simulate_batching(lam: float, steps: int, step: callable, n_requests: int, seed: int, geometric: bool) -> float:
    """Time-average batch of a continuous-batching decode, one event per step (independent of the planner)."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in range(n_requests):
        t += rng.expovariate(lam)
        arrivals.append(t)
    now, i, active, area = 0.0, 0, [], 0.0
    end = arrivals[-1]
    while now < end:
        while i < len(arrivals) and arrivals[i] <= now:
            k = max(1, round(rng.expovariate(1 / steps))) if geometric else steps
            active.append(k)
            i += 1
        if not active:
            now = arrivals[i]
            continue
        dt = step(len(active))
        area += len(active) * dt
        now += dt
        active = [k - 1 for k in active if k > 1]
    return area / now


@pytest.mark.parametrize("geometric", [False, True])
def test_batch_distribution_matches_a_step_by_step_decode(geometric):
    """Processor sharing is insensitive: fixed or geometric work, the same mean batch."""
    step = lambda n: 0.02 + 0.004 * n  # noqa: E731
    lam, steps = 2.0, 50
    pmf = batch_distribution(lam, steps, step)
    predicted = sum(n * p for n, p in enumerate(pmf))
    simulated = simulate_batching(lam, steps, step, 30_000, 7, geometric)
    assert predicted == pytest.approx(simulated, rel=0.08)


def test_batch_distribution_is_poisson_with_a_constant_step_and_none_when_overloaded():
    pmf = batch_distribution(3.0, 10, lambda n: 0.1)
    ref = poisson_pmf(3.0)
    for a, b in zip(pmf, ref):
        assert a == pytest.approx(b, abs=1e-9)
    assert batch_distribution(10.0, 10, lambda n: 0.02 + 0.011 * n) is None  # 10·10·0.011 > 1
    assert batch_distribution(0.0, 10, lambda n: 1.0) == [1.0]


def test_pmf_helpers():
    assert sum(poisson_pmf(700.0)) == pytest.approx(1.0, abs=1e-9)  # no underflow at large means
    both = convolve([0.5, 0.5], [0.25, 0.75])
    assert both == pytest.approx([0.125, 0.5, 0.375])
    assert distribution_quantile([0.2, 0.3, 0.5], 0.5) == 1
    assert distribution_quantile([0.2, 0.3, 0.5], 0.51) == 2
