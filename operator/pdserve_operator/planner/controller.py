"""One step of the autoscaler: observed load and time in, desired replicas and reasons out.

Pure: the caller (the operator, or the benchmark's simulation) keeps the `PlannerState` that a
step returns and passes it to the next step. Nothing here reads a clock or the cluster.
Each step estimates the demand (the routers' request rate, else Little's law on the decodes'
slots), corrects the model by what the routers measured (observed ÷ predicted TTFT and TPOT,
smoothed and clamped, tightens the SLO the model must meet), recommends the smallest (P, D)
for that demand (`decide.plan_replicas`), stabilises each role as the HPA's `behavior` does
(up to the lowest recommendation of `up_window_s`, down only to the highest of
`down_window_s`), and keeps the pair within the bounds and the P:D band.
Scale-down is the operator's to carry out through the drain; this step only says how many.
The steps in detail: docs/planner.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from pdserve_operator.planner.decide import Bounds, Plan, plan_replicas
from pdserve_operator.planner.perf import ServingModel
from pdserve_operator.planner.predict import predict
from pdserve_operator.planner.workload import SLO, Workload

Role = Literal["prefill", "decode"]


@dataclass(frozen=True)
class WorkerLoad:
    """One worker's load as the broker has it from its keepalive (`pdserve_common.membership.Load`)."""

    worker_id: str
    role: Role
    active_requests: int = 0  # prefill: prompts queued or computing; decode: sequences running
    slots_used: int = 0  # decode: KV slots held
    slots_total: int = 0
    draining: bool = False


@dataclass(frozen=True)
class Observation:
    """What the operator observed over the last interval."""

    prefill_replicas: int  # the counts currently asked for (the workloads' spec.replicas)
    decode_replicas: int
    workers: tuple[WorkerLoad, ...] = ()
    request_rate: float | None = None  # requests/s admitted by the routers over the interval
    prompt_tokens_mean: float | None = None
    output_tokens_mean: float | None = None
    ttft_s: float | None = None  # routers' TTFT at the SLO quantile over the interval
    tpot_s: float | None = None  # routers' TPOT at the SLO quantile over the interval
    samples: int = 0  # requests behind ttft_s / tpot_s
    prefill_ready: int | None = None  # None: assume ready == asked for
    decode_ready: int | None = None


@dataclass(frozen=True)
class ControllerConfig:
    model: ServingModel
    workload: Workload  # length distributions and SLO; the rate comes from observations
    bounds: Bounds
    up_window_s: float = 30.0
    down_window_s: float = 300.0
    headroom: float = 1.0  # plan for rate × headroom
    correction_min_samples: int = 20
    correction_limits: tuple[float, float] = (0.5, 4.0)
    correction_weight: float = 0.3  # EWMA weight of the newest observed/predicted ratio

    def __post_init__(self) -> None:
        if self.up_window_s < 0 or self.down_window_s < 0:
            raise ValueError(f"windows must be >= 0, got up={self.up_window_s} down={self.down_window_s}")
        if self.headroom < 1:
            raise ValueError(f"headroom must be >= 1, got {self.headroom}")
        lo, hi = self.correction_limits
        if not 0 < lo <= 1 <= hi:
            raise ValueError(f"correction_limits must satisfy 0 < lo <= 1 <= hi, got {self.correction_limits}")
        if not 0 < self.correction_weight <= 1:
            raise ValueError(f"correction_weight must be in (0, 1], got {self.correction_weight}")


@dataclass(frozen=True)
class PlannerState:
    started_s: float | None = None
    history: tuple[tuple[float, int, int], ...] = ()  # (time, P recommended, D recommended)
    last_change_s: tuple[float | None, float | None] = (None, None)  # prefill, decode
    ttft_correction: float = 1.0
    tpot_correction: float = 1.0
    rate: float | None = None  # the last demand estimate (req/s)


@dataclass(frozen=True)
class RoleDecision:
    role: Role
    current: int
    recommended: int  # this step's model recommendation, before stabilisation
    desired: int
    reason: str
    last_change_s: float | None

    @property
    def changed(self) -> bool:
        return self.desired != self.current


@dataclass(frozen=True)
class StepResult:
    state: PlannerState
    prefill: RoleDecision
    decode: RoleDecision
    plan: Plan | None  # None when there was no load signal to plan from
    rate: float | None  # the demand planned for (req/s, headroom included)
    notes: tuple[str, ...] = field(default_factory=tuple)


def estimate_rate(obs: Observation, config: ControllerConfig, workload: Workload) -> float | None:
    """Requests/s: the routers' count, else Little's law on the decodes' occupied slots."""
    if obs.request_rate is not None:
        return max(0.0, obs.request_rate)
    decodes = [w for w in obs.workers if w.role == "decode"]
    if not decodes:
        return None
    running = sum(max(w.slots_used, w.active_requests) for w in decodes)
    steps = sum((m - 1) * p for m, p in workload.output_tokens.points())
    if steps <= 0:
        return None
    step_s = obs.tpot_s
    if step_s is None:
        model, context = config.model, workload.prompt_tokens.mean() + workload.output_tokens.mean() / 2
        batch = max(1.0, running / len(decodes))
        step_s = model.decode_step_seconds(batch, batch * context)
    return running / (steps * step_s) if step_s > 0 else None


def _corrected(previous: float, observed: float | None, predicted: float, config: ControllerConfig) -> float:
    if observed is None or not (predicted > 0 and math.isfinite(predicted)) or observed <= 0:
        return previous
    lo, hi = config.correction_limits
    ratio = min(hi, max(lo, observed / predicted))
    w = config.correction_weight
    return min(hi, max(lo, (1 - w) * previous + w * ratio))


def _stabilise(
    current: int,
    recommended: int,
    history: list[tuple[float, int]],
    now: float,
    started: float,
    config: ControllerConfig,
) -> tuple[int, str]:
    up = [r for t, r in history if t >= now - config.up_window_s]
    down = [r for t, r in history if t >= now - config.down_window_s]
    up_target, down_target = min(up), max(down)
    watched = now - started >= config.down_window_s
    if up_target > current:
        return (
            up_target,
            f"up {current}->{up_target}: every recommendation of the last {config.up_window_s:g}s is >= {up_target}",
        )
    if down_target < current and watched:
        return down_target, (
            f"down {current}->{down_target}: every recommendation of the last "
            f"{config.down_window_s:g}s is <= {down_target}"
        )
    if recommended > current:
        return (
            current,
            f"hold at {current}: {recommended} recommended, waiting for the {config.up_window_s:g}s up window",
        )
    if recommended < current:
        why = (
            f"recommendations of the last {config.down_window_s:g}s reach {down_target}"
            if down_target >= current
            else f"watched for {now - started:.0f}s of the {config.down_window_s:g}s down window"
        )
        return current, f"hold at {current}: {recommended} recommended, but {why}"
    return current, f"steady at {current}"


def _observed_workload(workload: Workload, obs: Observation) -> Workload:
    """The configured workload with its lengths scaled to the observed means (where observed)."""
    if obs.prompt_tokens_mean:
        workload = workload.model_copy(
            update={"prompt_tokens": workload.prompt_tokens.scaled_to_mean(obs.prompt_tokens_mean)}
        )
    if obs.output_tokens_mean:
        workload = workload.model_copy(
            update={"output_tokens": workload.output_tokens.scaled_to_mean(obs.output_tokens_mean)}
        )
    return workload


def _hold(state: PlannerState, current: tuple[int, int], started: float, config: ControllerConfig) -> StepResult:
    """No signal (no routers' counts, no decodes): hold everything, within bounds."""
    p, d = config.bounds.clamp(*current)
    reason = "hold: no load signal (no router request rate and no decode load)"
    if (p, d) != current:
        reason += f"; moved to {p}:{d} by the bounds / P:D band"
    return StepResult(
        replace(state, started_s=started),
        RoleDecision("prefill", current[0], current[0], p, reason, state.last_change_s[0]),
        RoleDecision("decode", current[1], current[1], d, reason, state.last_change_s[1]),
        None,
        None,
    )


def _corrections(
    state: PlannerState,
    obs: Observation,
    current: tuple[int, int],
    rate: float,
    workload: Workload,
    config: ControllerConfig,
) -> tuple[float, float]:
    """The TTFT and TPOT correction factors, updated only from a settled deployment with enough samples."""
    ttft_c, tpot_c = state.ttft_correction, state.tpot_correction
    settled = (obs.prefill_ready in (None, current[0])) and (obs.decode_ready in (None, current[1]))
    if settled and obs.samples >= config.correction_min_samples and rate > 0:
        now_pred = predict(config.model, workload.with_rate(rate), *current)
        ttft_c = _corrected(ttft_c, obs.ttft_s, now_pred.ttft_q_s, config)
        tpot_c = _corrected(tpot_c, obs.tpot_s, now_pred.tpot_q_s, config)
    return ttft_c, tpot_c


def controller_step(state: PlannerState, obs: Observation, now: float, config: ControllerConfig) -> StepResult:
    """One decision. `now` is seconds on any monotonic clock; pass the returned state next time."""
    started = now if state.started_s is None else state.started_s
    current = (obs.prefill_replicas, obs.decode_replicas)
    workload = _observed_workload(config.workload, obs)
    rate = estimate_rate(obs, config, workload)
    notes: list[str] = []
    if rate is None:
        return _hold(state, current, started, config)

    # 2. correction factors, from a settled deployment with enough samples.
    ttft_c, tpot_c = _corrections(state, obs, current, rate, workload, config)
    slo = workload.slo
    target = SLO(
        ttft_ms=None if slo.ttft_ms is None else slo.ttft_ms / ttft_c,
        tpot_ms=None if slo.tpot_ms is None else slo.tpot_ms / tpot_c,
        quantile=slo.quantile,
    )
    if (ttft_c, tpot_c) != (1.0, 1.0):
        notes.append(f"model corrected by observations: ttft x{ttft_c:.2f}, tpot x{tpot_c:.2f}")

    # 3. the model's recommendation.
    planned_rate = rate * config.headroom
    plan = plan_replicas(config.model, workload.with_rate(planned_rate), config.bounds, target)
    if not plan.meets_slo:
        notes.append(plan.reason)

    # 4. stabilisation, per role.
    history = [(t, p, d) for t, p, d in state.history if t >= now - max(config.up_window_s, config.down_window_s)] + [
        (now, plan.prefill, plan.decode)
    ]
    p_des, p_why = _stabilise(current[0], plan.prefill, [(t, p) for t, p, _ in history], now, started, config)
    d_des, d_why = _stabilise(current[1], plan.decode, [(t, d) for t, _, d in history], now, started, config)

    # 5. bounds and band.
    p_fin, d_fin = config.bounds.clamp(p_des, d_des)
    if (p_fin, d_fin) != (p_des, d_des):
        band = f"; moved to {p_fin}:{d_fin} by the bounds / P:D band"
        p_why += band if p_fin != p_des else ""
        d_why += band if d_fin != d_des else ""
    plan_note = f" (model: {plan.reason})"
    was = state.last_change_s
    last = (now if p_fin != current[0] else was[0], now if d_fin != current[1] else was[1])
    new_state = PlannerState(
        started_s=started,
        history=tuple(history),
        last_change_s=last,
        ttft_correction=ttft_c,
        tpot_correction=tpot_c,
        rate=rate,
    )
    return StepResult(
        new_state,
        RoleDecision("prefill", current[0], plan.prefill, p_fin, p_why + plan_note, last[0]),
        RoleDecision("decode", current[1], plan.decode, d_fin, d_why + plan_note, last[1]),
        plan,
        planned_rate,
        tuple(notes),
    )
