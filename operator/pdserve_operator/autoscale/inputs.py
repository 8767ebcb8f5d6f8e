"""What the autoscaler hands the planner: the controller's configuration for a spec, the P:D band,
and the workers' loads and routers' reports read from the broker's members. Pure."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from pdserve_common.membership import Load, Member
from pdserve_operator import spec as s
from pdserve_operator.planner import (
    SLO,
    Bounds,
    ControllerConfig,
    LengthDistribution,
    ModelShape,
    ServingModel,
    WorkerLoad,
    Workload,
    load_profile,
)
from pdserve_operator.planner.signals import LatencyHistogram, RouterReport


def planner_config(spec: s.PDInferenceServiceSpec, current: Mapping[str, int]) -> ControllerConfig:
    """The controller's configuration for a spec: the serving model (shape × profile), the
    expected lengths, the SLO and the bounds. Roles the planner does not drive are pinned at
    their current count, so the plan works around them."""
    a = spec.autoscaling
    assert a is not None
    model_name = s.planner_model_name(spec)
    assert model_name is not None  # the spec's validation requires one where the planner drives a role
    shape = ModelShape.load(model_name)
    profile = load_profile(s.planner_profile_name(spec))
    model = ServingModel(
        shape=shape,
        profile=profile,
        max_len=spec.model.max_length,
        slots=spec.decode.slots,
        layers_per_chunk=spec.prefill.layers_per_chunk,
        prefill_tp=spec.prefill.tensor_parallel_size,
        decode_tp=spec.decode.tensor_parallel_size,
    )
    workload = Workload(
        arrival_rate=0.0,
        prompt_tokens=LengthDistribution(fixed=a.expected_prompt_tokens),
        output_tokens=LengthDistribution(fixed=a.expected_output_tokens),
        slo=SLO(ttft_ms=a.slo.ttft_ms, tpot_ms=a.slo.tpot_ms, quantile=a.slo.percentile / 100),
    )
    limits: dict[str, tuple[int, int]] = {}
    for role in ("prefill", "decode"):
        r: s.RoleAutoscaling = getattr(a, role)
        if r.enabled and r.driver == "planner":
            limits[role] = (s.effective_min(spec, role), r.max_replicas)
        else:
            pinned = max(1, current[role])
            limits[role] = (pinned, pinned)
    bounds_args = dict(
        min_prefill=limits["prefill"][0],
        max_prefill=limits["prefill"][1],
        min_decode=limits["decode"][0],
        max_decode=limits["decode"][1],
    )
    try:
        bounds = Bounds(
            **bounds_args, min_ratio=a.ratio.min_prefill_per_decode, max_ratio=a.ratio.max_prefill_per_decode
        )
    except ValueError:
        bounds = Bounds(**bounds_args)  # a pinned role leaves no pair in the band: bounds only
    return ControllerConfig(
        model=model,
        workload=workload,
        bounds=bounds,
        up_window_s=a.scale_up_window_seconds,
        down_window_s=a.scale_down_window_seconds,
    )


def in_band(prefill: int, decode: int, a: s.AutoscalingSpec, spec: s.PDInferenceServiceSpec) -> int:
    """`prefill` moved into the P:D band for `decode` groups (as little as it takes), within its bounds."""
    lo, hi = s.effective_min(spec, "prefill"), a.prefill.max_replicas
    if decode > 0 and a.ratio.min_prefill_per_decode is not None:
        prefill = max(prefill, math.ceil(a.ratio.min_prefill_per_decode * decode - 1e-9))
    if decode > 0 and a.ratio.max_prefill_per_decode is not None:
        prefill = min(prefill, math.floor(a.ratio.max_prefill_per_decode * decode + 1e-9))
    return min(max(prefill, lo), hi)


def router_report(load: Load, at: float | None = None) -> RouterReport | None:
    """A router member's load as the planner's RouterReport (None: it reports no traffic), as of
    `at` (when the broker received it; None: unknown)."""
    router = load.router
    if router is None:
        return None

    def hist(h: Any) -> LatencyHistogram | None:
        try:
            return None if h is None else LatencyHistogram(tuple(h.bounds), tuple(h.counts), h.count)
        except ValueError:
            return None  # malformed: its traffic still counts, its latencies do not

    return RouterReport(
        router.requests_total,
        router.prompt_tokens_total,
        router.output_tokens_total,
        hist(router.ttft),
        hist(router.tpot),
        at,
    )


def member_loads(members: Iterable[Member]) -> tuple[list[WorkerLoad], dict[str, RouterReport]]:
    """The prefills' and decodes' loads, and each router's report, from the broker's members."""
    workers: list[WorkerLoad] = []
    reports: dict[str, RouterReport] = {}
    for m in members or ():
        role = str(getattr(m.role, "value", m.role))
        if role in ("prefill", "decode"):
            load = m.load
            total = load.slots_used + load.slots_free
            workers.append(
                WorkerLoad(m.worker_id, role, load.active_requests, load.slots_used, total, m.draining)  # type: ignore[arg-type]
            )
        elif role == "router" and (rep := router_report(m.load, m.load_at or None)) is not None:
            reports[m.worker_id] = rep
    return workers, reports
