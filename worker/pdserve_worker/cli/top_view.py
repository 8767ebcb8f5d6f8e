"""`pdserve top`'s view: two scrapes of the routers' `/metrics` → roles, queue, KV, rates (pure).

What a person at a terminal wants from a running deployment without Prometheus or Grafana: how
many prefill and decode workers the routers reach, requests in flight, KV slot usage per decode,
and over the last interval the request and token rates, TTFT/TPOT percentiles (from the
histograms' bucket deltas, the way `histogram_quantile` interpolates), failures and resumes.
Several routers are summed (gauges of members: the smallest view).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]
Samples = dict[str, dict[Labels, float]]  # sample name -> labels -> value, summed over routers

PREFIX = "pdserve_router_"


def parse(texts: list[str]) -> Samples:
    """The routers' expositions, each sample summed over the routers."""
    out: Samples = defaultdict(lambda: defaultdict(float))
    for text in texts:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[s.name][tuple(sorted(s.labels.items()))] += s.value
    return out


def _total(samples: Samples, name: str, **match: str) -> float:
    return sum(v for labels, v in samples.get(name, {}).items() if match.items() <= dict(labels).items())


def _by(samples: Samples, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for labels, v in samples.get(name, {}).items():
        key = dict(labels).get(label)
        if key is not None:
            out[key] += v
    return dict(out)


def quantile(q: float, buckets: dict[float, float]) -> float | None:
    """PromQL's `histogram_quantile` over cumulative bucket counts {upper bound: count}, as
    prometheus/prometheus promql/quantile.go `BucketQuantile` computes it: None where it gives
    NaN (no +Inf bucket, fewer than 2 buckets, no observations); counts made monotonic; the
    rank's bucket found; the second-highest bound if that is +Inf; linear interpolation from
    the previous bound (0 for the first bucket) otherwise."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be within [0, 1], got {q}")
    bounds = sorted(buckets)
    if len(bounds) < 2 or not math.isinf(bounds[-1]):
        return None
    counts, envelope = [], 0.0
    for bound in bounds:  # a count below an earlier one is raised to it (ensureMonotonic...)
        envelope = max(envelope, buckets[bound])
        counts.append(envelope)
    observations = counts[-1]
    if observations == 0:
        return None
    rank = q * observations
    b = next((i for i in range(len(bounds) - 1) if counts[i] >= rank), len(bounds) - 1)
    if b == len(bounds) - 1:
        return bounds[-2]
    if b == 0 and bounds[0] <= 0:
        return bounds[0]
    start, count = 0.0, counts[b]
    if b > 0:
        start, count, rank = bounds[b - 1], count - counts[b - 1], rank - counts[b - 1]
    return start + (bounds[b] - start) * (rank / count)


def _bucket_delta(prev: Samples, cur: Samples, name: str) -> dict[float, float]:
    before = {float(dict(k)["le"]): v for k, v in prev.get(name + "_bucket", {}).items()}
    return {
        float(dict(k)["le"]): v - before.get(float(dict(k)["le"]), 0.0)
        for k, v in cur.get(name + "_bucket", {}).items()
    }


@dataclass
class TopView:
    routers: int
    interval_s: float
    members: dict[str, float] = field(default_factory=dict)
    in_flight: dict[str, float] = field(default_factory=dict)
    slots: dict[str, tuple[float, float]] = field(default_factory=dict)  # decode -> (used, total)
    requests_per_s: float = 0.0
    tokens_per_s: float = 0.0
    prompt_tokens_per_s: float = 0.0
    cached_tokens_per_s: float = 0.0  # of the prompt tokens, those whose KV came from a prefix cache
    failed_per_s: dict[str, float] = field(default_factory=dict)
    resumes_per_s: float = 0.0
    prefill_failures_per_s: float = 0.0
    ttft: dict[str, float | None] = field(default_factory=dict)
    tpot: dict[str, float | None] = field(default_factory=dict)


def view(prev: Samples, cur: Samples, interval_s: float, routers: int) -> TopView:
    """What changed between two scrapes `interval_s` apart."""

    def rate(name: str, **match: str) -> float:
        return max(_total(cur, name, **match) - _total(prev, name, **match), 0.0) / interval_s

    used = _by(cur, PREFIX + "decode_slots_used", "decode")
    free = _by(cur, PREFIX + "decode_slots_free", "decode")
    # Every router reports every decode: per router the same numbers, so divide the sums back.
    slots = {d: (used[d] / routers, (used[d] + free.get(d, 0.0)) / routers) for d in sorted(used)}
    failed_now, failed_before = (
        _by(cur, PREFIX + "requests_failed_total", "reason"),
        _by(prev, PREFIX + "requests_failed_total", "reason"),
    )
    ttft = _bucket_delta(prev, cur, PREFIX + "time_to_first_token_seconds")
    tpot = _bucket_delta(prev, cur, PREFIX + "time_per_output_token_seconds")
    return TopView(
        routers=routers,
        interval_s=interval_s,
        members={role: v / routers for role, v in _by(cur, PREFIX + "members", "role").items()},
        in_flight=_by(cur, PREFIX + "requests_in_flight", "role"),
        slots=slots,
        requests_per_s=rate(PREFIX + "requests_completed_total"),
        tokens_per_s=rate(PREFIX + "generation_tokens_total"),
        prompt_tokens_per_s=rate(PREFIX + "prompt_tokens_total"),
        cached_tokens_per_s=rate(PREFIX + "prompt_cached_tokens_total"),
        failed_per_s={
            r: (v - failed_before.get(r, 0.0)) / interval_s
            for r, v in failed_now.items()
            if v - failed_before.get(r, 0.0) > 0
        },
        resumes_per_s=rate(PREFIX + "request_retries_total"),
        prefill_failures_per_s=rate(PREFIX + "prefill_failures_total"),
        ttft={f"p{int(q * 100)}": quantile(q, ttft) for q in (0.5, 0.9, 0.99)},
        tpot={f"p{int(q * 100)}": quantile(q, tpot) for q in (0.5, 0.9, 0.99)},
    )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}ms"


def render(v: TopView, title: str) -> str:
    lines = [f"pdserve top  {title}  ({v.routers} router{'s' if v.routers != 1 else ''}, last {v.interval_s:.1f}s)", ""]
    roles = "  ".join(f"{role} {v.members.get(role, 0):g}" for role in ("prefill", "decode")) or "-"
    flight = "  ".join(f"{role} {v.in_flight.get(role, 0):g}" for role in ("prefill", "decode"))
    lines += [f"workers reachable   {roles}", f"requests in flight  {flight}", ""]
    lines.append(
        f"requests/s {v.requests_per_s:.2f}   tokens/s out {v.tokens_per_s:.1f}   in {v.prompt_tokens_per_s:.1f}"
    )
    hit = f"{v.cached_tokens_per_s / v.prompt_tokens_per_s:.0%}" if v.prompt_tokens_per_s else "-"
    lines.append(f"prefix cache hits {hit} of prompt tokens ({v.cached_tokens_per_s:.1f} tokens/s)")
    lines.append("TTFT  " + "  ".join(f"{k} {_ms(x)}" for k, x in v.ttft.items()))
    lines.append("TPOT  " + "  ".join(f"{k} {_ms(x)}" for k, x in v.tpot.items()))
    failures = "  ".join(f"{r} {x:.2f}/s" for r, x in sorted(v.failed_per_s.items())) or "none"
    lines.append(
        f"failed {failures}   resumed {v.resumes_per_s:.2f}/s   prefill failures {v.prefill_failures_per_s:.2f}/s"
    )
    lines += ["", f"{'decode':<32} {'KV slots':>10}  usage"]
    for decode, (used, total) in v.slots.items():
        share = used / total if total else 0.0
        bar = "#" * round(share * 20)
        lines.append(f"{decode:<32} {used:>4g}/{total:<5g} [{bar:<20}] {share:4.0%}")
    if not v.slots:
        lines.append("(no decode reported)")
    return "\n".join(lines)
