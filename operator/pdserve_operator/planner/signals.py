"""What the routers reported, turned into the controller's demand and latency signals. Pure.

Routers report cumulative counters and cumulative latency histograms (the buckets of their
Prometheus histograms) with each broker keepalive. Cumulative, not pre-digested quantiles,
because histograms merge: the operator subtracts two reports of each router to get the
interval's histogram, adds the routers' up, and takes the quantile of the sum — the very
computation PromQL's `histogram_quantile(q, sum(rate(..._bucket[w])))` makes, so the planner
sees the TTFT/TPOT a dashboard shows. A quantile of per-router quantiles would not be one.

`bucket_quantile` follows Prometheus' `bucketQuantile` (promql/quantile.go): find the first
bucket whose cumulative count reaches q·total and interpolate linearly inside it; a quantile
that falls into the +Inf bucket is the highest finite bound; the first bucket's lower edge is
0 (latencies are positive). A router whose counters went backwards restarted: like PromQL's
`increase`, its current counts are the interval's (counted from zero).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

MAX_BUCKETS = 64  # what a report may carry; the broker refuses longer ones


@dataclass(frozen=True)
class LatencyHistogram:
    """A cumulative histogram: `cumulative[i]` observations were <= `bounds[i]`; `count` in all."""

    bounds: tuple[float, ...]
    cumulative: tuple[int, ...]
    count: int

    def __post_init__(self) -> None:
        if len(self.bounds) != len(self.cumulative) or len(self.bounds) > MAX_BUCKETS:
            raise ValueError(
                f"a histogram needs one count per bound (at most {MAX_BUCKETS}), "
                f"got {len(self.bounds)} bounds and {len(self.cumulative)} counts"
            )
        if any(b >= c for b, c in zip(self.bounds, self.bounds[1:])):
            raise ValueError(f"histogram bounds must increase, got {list(self.bounds)}")
        counts = (*self.cumulative, self.count)
        if any(n < 0 for n in counts) or any(a > b for a, b in zip(counts, counts[1:])):
            raise ValueError(f"cumulative counts must be >= 0 and non-decreasing, got {list(counts)}")

    def since(self, older: LatencyHistogram | None) -> LatencyHistogram:
        """The observations made after `older` (all of them when it is None, of other buckets,
        or larger: the router restarted)."""
        if (
            older is None
            or older.bounds != self.bounds
            or older.count > self.count
            or any(o > n for o, n in zip(older.cumulative, self.cumulative))
        ):
            return self
        return LatencyHistogram(
            self.bounds, tuple(n - o for n, o in zip(self.cumulative, older.cumulative)), self.count - older.count
        )

    def plus(self, other: LatencyHistogram) -> LatencyHistogram:
        if other.bounds != self.bounds:
            raise ValueError(f"cannot add histograms of different buckets: {list(self.bounds)} vs {list(other.bounds)}")
        return LatencyHistogram(
            self.bounds, tuple(a + b for a, b in zip(self.cumulative, other.cumulative)), self.count + other.count
        )

    def quantile(self, q: float) -> float | None:
        """Prometheus' bucketQuantile; None without observations."""
        if not 0 <= q <= 1:
            raise ValueError(f"quantile must be in [0, 1], got {q}")
        if self.count == 0 or not self.bounds:
            return None
        rank = q * self.count
        for i, (bound, cum) in enumerate(zip(self.bounds, self.cumulative)):
            if cum >= rank:
                lower = 0.0 if i == 0 else self.bounds[i - 1]
                below = 0 if i == 0 else self.cumulative[i - 1]
                in_bucket = cum - below
                if in_bucket == 0:
                    return bound
                return lower + (bound - lower) * (rank - below) / in_bucket
        return self.bounds[-1]  # in the +Inf bucket: the highest finite bound, as Prometheus does


@dataclass(frozen=True)
class RouterReport:
    """One router's cumulative counters as of one keepalive."""

    requests: int
    prompt_tokens: int
    output_tokens: int
    ttft: LatencyHistogram | None = None
    tpot: LatencyHistogram | None = None
    at: float | None = None  # when the broker received it (seconds, the broker's monotonic clock)


@dataclass(frozen=True)
class RouterWindow:
    """The routers' traffic over one interval."""

    request_rate: float | None  # requests/s; None: no router reported twice yet
    prompt_tokens_mean: float | None
    output_tokens_mean: float | None
    ttft_s: float | None  # the interval's quantile over all routers
    tpot_s: float | None
    samples: int  # requests behind ttft_s
    rates: Mapping[str, float] = field(default_factory=dict)  # each router's requests/s (the next window's carry)


def _increase(new: int, old: int) -> int:
    return new if new < old else new - old


def _rate(old: RouterReport, new: RouterReport, seconds: float, carried: float | None) -> float | None:
    """A router's requests/s between two of its reports: over the reports' own times where both
    have one (a step sees the counters as of the router's last keepalive, so the step's own
    interval would alias: keepalives every 0.5 s, a step every 1 s, and a steady 3/s read as
    1.5-4.5), else over the step's `seconds`. No newer report: the rate it had (`carried`)."""
    if new.at is not None and old.at is not None:
        elapsed = new.at - old.at
        if elapsed <= 0:
            return carried
        return _increase(new.requests, old.requests) / elapsed
    return _increase(new.requests, old.requests) / seconds if seconds > 0 else None


def window(
    previous: Mapping[str, RouterReport],
    current: Mapping[str, RouterReport],
    seconds: float,
    quantile: float,
    carried: Mapping[str, float] | None = None,
) -> RouterWindow:
    """Traffic between two sets of reports, the second `seconds` after the first (routers present
    in both only: a new router's counts since its start may span more than the interval).
    `carried`: each router's rate in the window before, for a router that sent nothing newer."""
    both = sorted(set(previous) & set(current))
    rates: dict[str, float] = {}
    for rid in both:
        rate = _rate(previous[rid], current[rid], seconds, (carried or {}).get(rid))
        if rate is not None:
            rates[rid] = rate
    if not rates:
        return RouterWindow(None, None, None, None, None, 0)
    requests = prompt = output = 0
    ttft: LatencyHistogram | None = None
    tpot: LatencyHistogram | None = None
    for rid in both:
        old, new = previous[rid], current[rid]
        requests += _increase(new.requests, old.requests)
        prompt += _increase(new.prompt_tokens, old.prompt_tokens)
        output += _increase(new.output_tokens, old.output_tokens)
        for name in ("ttft", "tpot"):
            hist = getattr(new, name)
            if hist is None:
                continue
            part = hist.since(getattr(old, name))
            acc = ttft if name == "ttft" else tpot
            try:
                acc = part if acc is None else acc.plus(part)
            except ValueError:
                continue  # a router with other buckets (another version): leave it out of the quantile
            if name == "ttft":
                ttft = acc
            else:
                tpot = acc
    return RouterWindow(
        request_rate=sum(rates.values()),
        prompt_tokens_mean=prompt / requests if requests else None,
        output_tokens_mean=output / requests if requests else None,
        ttft_s=ttft.quantile(quantile) if ttft is not None else None,
        tpot_s=tpot.quantile(quantile) if tpot is not None else None,
        samples=ttft.count if ttft is not None else 0,
        rates=rates,
    )
