"""The built-in autoscaler: each reconcile of a service with planner-driven roles may take a step.

Inputs are the broker's members (each worker's load from its keepalive: a prefill's queued
prompts, a decode's slots and running requests; each router's cumulative request counters
and latency histograms) and the workloads as they are live. A step (at most one per
`autoscaling.intervalSeconds`) turns them into a `planner.Observation`, runs the pure
`planner.controller_step` with the state this object keeps per service, and carries out what
it decides for the roles the planner drives:

- up, or prefill down: write the workload's `spec.replicas` through its scale subresource
  (what an HPA writes; the operator's own apply path leaves that field alone for an
  autoscaled role, see `children.autoscaled_workloads`);
- decode down: first mark the decode groups that will go (the highest ordinals, which a
  StatefulSet removes first) draining in the broker, so routers place nothing new there; only
  when their running requests and held slots are 0 — or `decode.drainTimeoutSeconds` passed —
  lower the StatefulSet (whose pods' preStop drain then finds nothing left). A new decision to
  go up cancels the drain. Each decode, seeing the mark in its keepalive reply, hands its
  requests over to the others (docs/migration.md) and reports how many moved in its load; when
  the StatefulSet goes down, one `DecodeDrained` Event per decode says so, and
  `status.lastDrain` holds the sums. A decode scale-down without the autoscaler (`kubectl
  scale`, an edited spec.decode.replicas) takes the same path (`manual_decode`).

Every change is an Event (`ScaledUp`/`ScaledDown`/`DrainingForScaleDown`) and every step
leaves `status.autoscaling` (per role: driver, current, desired, reason, last change). Roles
an HPA or an external autoscaler drives are only reported. State lives in memory: a new leader
starts afresh, which only delays a scale-down by one down window.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pdserve_common.logs import kv
from pdserve_operator import events as ev
from pdserve_operator import spec as s
from pdserve_operator.kube import KINDS, KubeClient
from pdserve_operator.planner import (
    SLO,
    Bounds,
    ControllerConfig,
    LengthDistribution,
    ModelShape,
    Observation,
    PlannerState,
    ServingModel,
    StepResult,
    WorkerLoad,
    Workload,
    controller_step,
    load_profile,
)
from pdserve_operator.planner.signals import LatencyHistogram, RouterReport, window
from pdserve_operator.reconcile import decode_groups as dg
from pdserve_operator.reconcile.children.meta import Owner, hpa_name, workload_name

log = logging.getLogger("pdserve.operator.autoscale")

Live = dict[str, Any]
EventFn = Callable[[ev.EventType, str, str], Awaitable[None]]
DRAIN_RECHECK_S = 1.0  # while a decode drains, look again this often


def _utc(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class _Drain:
    target: int  # decode groups to keep
    victims: tuple[str, ...]  # worker ids of the groups that go
    started: float
    baseline: dict[str, tuple[int, int]] = field(default_factory=dict)  # (migrated, fallbacks) at the mark


@dataclass
class _State:
    planner: PlannerState = field(default_factory=PlannerState)
    routers: dict[str, RouterReport] = field(default_factory=dict)
    router_rates: dict[str, float] = field(default_factory=dict)  # each router's last rate (signals.window)
    sampled_at: float | None = None
    next_due: float = 0.0
    drain: _Drain | None = None
    reasons: dict[str, str] = field(default_factory=dict)
    changed_at: dict[str, str] = field(default_factory=dict)
    desired: dict[str, int] = field(default_factory=dict)
    generation: int = -1
    config: ControllerConfig | None = None


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


def router_report(load: Any, at: float | None = None) -> RouterReport | None:
    """A router member's load as the planner's RouterReport (None: it reports no traffic), as of
    `at` (when the broker received it; None: unknown)."""
    router = getattr(load, "router", None)
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


class Autoscaler:
    def __init__(
        self,
        kube: KubeClient,
        broker: Any,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.kube = kube
        self.broker = broker
        self.clock = clock
        self.wall = wall
        self._states: dict[str, _State] = {}
        self._manual: dict[str, _Drain] = {}  # decode scale-downs without the autoscaler, draining
        self._last_drain: dict[str, s.DrainStatus] = {}

    def due(self, key: str) -> bool:
        """A step is due (or a manual scale-down drains: look again at each timer tick)."""
        state = self._states.get(key)
        return key in self._manual or (state is not None and self.clock() >= state.next_due)

    def forget(self, key: str) -> None:
        self._states.pop(key, None)
        self._manual.pop(key, None)
        self._last_drain.pop(key, None)

    async def step(
        self,
        owner: Owner,
        spec: s.PDInferenceServiceSpec,
        generation: int,
        live: Mapping[tuple[str, str], Live | None],
        post_event: EventFn,
    ) -> s.AutoscalingStatus | None:
        """One look at the service; the status to report (None: autoscaling is off)."""
        a = spec.autoscaling
        if a is None or not (a.prefill.enabled or a.decode.enabled):
            self._states.pop(owner.key, None)  # a manual scale-down's drain (manual_decode) stays
            return None
        state = self._states.setdefault(owner.key, _State())
        decode = dg.of(owner.name, spec)
        workloads = {
            "prefill": live.get(("Deployment", workload_name(owner.name, "prefill"))),
            "decode": live.get(decode.key),
        }
        per = {"prefill": 1, "decode": decode.per_replica}
        current = {r: int(((w or {}).get("spec") or {}).get("replicas") or 0) // per[r] for r, w in workloads.items()}
        ready = {
            r: int(((w or {}).get("status") or {}).get("readyReplicas") or 0) // per[r] for r, w in workloads.items()
        }
        now = self.clock()
        planner_roles = [
            r for r in ("prefill", "decode") if getattr(a, r).enabled and getattr(a, r).driver == "planner"
        ]
        if planner_roles and now >= state.next_due and all(workloads.values()):
            await self._plan(owner, spec, generation, state, current, ready, workloads, planner_roles, now, post_event)
            current = {
                r: int(((workloads[r] or {}).get("spec") or {}).get("replicas") or 0) // per[r] for r in workloads
            }
        if state.drain is not None:
            state.next_due = min(state.next_due, now + DRAIN_RECHECK_S)
        return self._status(owner, spec, state, current, live)

    # ---- planning --------------------------------------------------------------------------

    async def _plan(
        self,
        owner: Owner,
        spec: s.PDInferenceServiceSpec,
        generation: int,
        state: _State,
        current: dict[str, int],
        ready: dict[str, int],
        workloads: dict[str, Live | None],
        planner_roles: list[str],
        now: float,
        post_event: EventFn,
    ) -> None:
        a = spec.autoscaling
        assert a is not None
        state.next_due = now + a.interval_seconds
        if not self._configured(owner, spec, generation, state, current, planner_roles):
            return
        members = self.broker.members(owner.key) if hasattr(self.broker, "members") else None
        if members is None:
            for role in planner_roles:
                state.reasons[role] = "hold: the broker reports no load (it is not running in this operator)"
            return
        workers, reports = _loads(members)
        win = window(
            state.routers,
            reports,
            now - state.sampled_at if state.sampled_at is not None else 0.0,
            a.slo.percentile / 100,
            state.router_rates,
        )
        state.routers, state.router_rates, state.sampled_at = reports, dict(win.rates), now
        obs = Observation(
            prefill_replicas=current["prefill"],
            decode_replicas=current["decode"],
            workers=tuple(workers),
            request_rate=win.request_rate,
            prompt_tokens_mean=win.prompt_tokens_mean,
            output_tokens_mean=win.output_tokens_mean,
            ttft_s=win.ttft_s,
            tpot_s=win.tpot_s,
            samples=win.samples,
            prefill_ready=ready["prefill"],
            decode_ready=ready["decode"],
        )
        assert state.config is not None
        result = controller_step(state.planner, obs, now, state.config)
        state.planner = result.state
        log.info(
            kv(
                event="autoscale_step",
                service=owner.key,
                rate=win.request_rate,
                ttft_s=win.ttft_s,
                tpot_s=win.tpot_s,
                prefill=f"{current['prefill']}->{result.prefill.desired}",
                decode=f"{current['decode']}->{result.decode.desired}",
            )
        )
        await self._apply(owner, spec, state, current, result, workloads, planner_roles, now, post_event)

    def _configured(
        self,
        owner: Owner,
        spec: s.PDInferenceServiceSpec,
        generation: int,
        state: _State,
        current: dict[str, int],
        planner_roles: list[str],
    ) -> bool:
        """The planner's configuration for this generation of the spec (False: it has none)."""
        if state.config is not None and state.generation == generation:
            return True
        try:
            state.config = planner_config(spec, current)
        except ValueError as exc:
            for role in planner_roles:
                state.reasons[role] = f"planner not configured: {exc}"
            log.warning(kv(event="autoscale_config_failed", service=owner.key, error=str(exc)))
            return False
        state.generation = generation
        return True

    async def _apply(
        self,
        owner: Owner,
        spec: s.PDInferenceServiceSpec,
        state: _State,
        current: dict[str, int],
        result: StepResult,
        workloads: dict[str, Live | None],
        planner_roles: list[str],
        now: float,
        post_event: EventFn,
    ) -> None:
        """Scale to the plan: decode first (a drain may hold it up), then prefill within the P:D
        band of where decode really is."""
        a = spec.autoscaling
        assert a is not None
        decode_now = current["decode"]
        if "decode" in planner_roles:
            state.reasons["decode"] = result.decode.reason
            state.desired["decode"] = result.decode.desired
            await self._decode(owner, spec, state, current["decode"], result.decode.desired, workloads, now, post_event)
            decode_now = dg.of(owner.name, spec).groups(
                int((workloads["decode"] or {}).get("spec", {}).get("replicas") or 0)
            )
        if "prefill" in planner_roles:
            desired, reason = result.prefill.desired, result.prefill.reason
            banded = in_band(desired, decode_now, a, spec)
            if banded != desired:  # decode is not (yet) where the plan put it: keep P:D in the band meanwhile
                reason = f"{banded} to keep P:D in the band while decode is at {decode_now}; plan: {reason}"
                desired = banded
            state.reasons["prefill"], state.desired["prefill"] = reason, desired
            if desired != current["prefill"]:
                prefill = ("Deployment", workload_name(owner.name, "prefill"))
                await self._scale(owner, prefill, desired, workloads, "prefill")
                await self._changed(state, "prefill", current["prefill"], desired, reason, post_event)

    async def _decode(
        self,
        owner: Owner,
        spec: s.PDInferenceServiceSpec,
        state: _State,
        current: int,
        desired: int,
        workloads: dict[str, Live | None],
        now: float,
        post_event: EventFn,
    ) -> None:
        decode = dg.of(owner.name, spec)
        drain = state.drain
        if desired >= current:
            if drain is not None:  # back up (or steady) before the drain ended: keep every group
                await self._undrain(owner, drain.victims)
                state.drain = None
                await post_event(
                    ev.NORMAL,
                    "ScaleDownCancelled",
                    f"decode stays at {current}: the planner no longer wants {drain.target}",
                )
            if desired > current:
                # Groups that come back may still be registered from before, drained by us: a
                # pod that restarts registers afresh, but one that never stopped keeps the mark.
                await self._undrain(owner, decode.leader_ids(range(current, desired)))
                await self._scale(owner, decode.key, decode.replicas(desired), workloads, "decode")
                await self._changed(state, "decode", current, desired, state.reasons["decode"], post_event)
            return
        drain = state.drain = await self._mark(owner, spec, drain, current, desired, now, post_event)
        busy = self._busy(owner.key, drain.victims)
        timed_out = now - drain.started >= spec.decode.drain_timeout_seconds
        if busy and not timed_out:
            state.reasons["decode"] = (
                f"draining {', '.join(drain.victims)} before {current} -> {desired}: "
                f"{sum(busy.values())} requests still running"
            )
            return
        await self._scale(owner, decode.key, decode.replicas(desired), workloads, "decode")
        why = state.reasons["decode"] + (
            f"; drain timed out with {sum(busy.values())} requests running" if busy else "; drained"
        )
        state.drain = None
        await self._drained(owner, drain, busy, now, post_event)
        await self._changed(state, "decode", current, desired, why, post_event)

    # ---- decode scale-down: drain, then lower (the autoscaler's and a manual one alike) ------

    async def _mark(
        self,
        owner: Owner,
        spec: s.PDInferenceServiceSpec,
        drain: _Drain | None,
        current: int,
        desired: int,
        now: float,
        post_event: EventFn,
    ) -> _Drain:
        """Mark the decode groups that go (the highest ordinals, which a StatefulSet removes
        first) draining: routers place nothing new there and each decode, seeing the mark in its
        keepalive reply, hands its requests over (docs/migration.md). Returns the drain."""
        victims = dg.of(owner.name, spec).leader_ids(range(desired, current))
        if drain is None or drain.target != desired:
            if drain is not None:
                await self._undrain(owner, tuple(v for v in drain.victims if v not in victims))
            drain = _Drain(desired, victims, now, self._handovers(owner.key, victims))
            await post_event(
                ev.NORMAL, "DrainingForScaleDown", f"decode {current} -> {desired}: draining {', '.join(victims)} first"
            )
        for victim in victims:  # every step: a broker restart forgets who was draining
            self.broker.set_draining(owner.key, victim, True)
        return drain

    async def _drained(
        self, owner: Owner, drain: _Drain, busy: Mapping[str, int], now: float, post_event: EventFn
    ) -> None:
        """The StatefulSet goes down now: one `DecodeDrained` Event per decode with what its
        drain did (from its last reported load, less what it had counted before the mark),
        and the sums in status.lastDrain."""
        seconds = max(0.0, now - drain.started)
        counts = self._handovers(owner.key, drain.victims)
        migrated = failed = 0
        for victim in drain.victims:
            base_m, base_f = drain.baseline.get(victim, (0, 0))
            m, f = counts.get(victim, (base_m, base_f))
            m, f = max(0, m - base_m), max(0, f - base_f)
            migrated, failed = migrated + m, failed + f
            left = f", {busy[victim]} still running (drain timed out)" if victim in busy else ""
            await post_event(
                ev.NORMAL if victim not in busy else ev.WARNING,
                "DecodeDrained",
                f"{victim}: {m} requests migrated, {f} resumed by re-prefill{left}; drained in {seconds:.1f}s",
            )
            log.info(
                kv(
                    event="decode_drained",
                    service=owner.key,
                    decode=victim,
                    migrated=m,
                    failed=f,
                    running=busy.get(victim, 0),
                    seconds=f"{seconds:.2f}",
                )
            )
        self._last_drain[owner.key] = s.DrainStatus(
            decodes=list(drain.victims),
            migrated=migrated,
            failed=failed,
            running=sum(busy.values()),
            seconds=round(seconds, 3),
            time=_utc(self.wall()),
        )

    def _handovers(self, key: str, victims: tuple[str, ...]) -> dict[str, tuple[int, int]]:
        """(migrated, fallbacks) each registered decode among `victims` reported (cumulative)."""
        members = {m.worker_id: m for m in (self.broker.members(key) or ())} if hasattr(self.broker, "members") else {}
        return {v: (members[v].load.migrated, members[v].load.migration_fallbacks) for v in victims if v in members}

    def last_drain(self, key: str) -> s.DrainStatus | None:
        return self._last_drain.get(key)

    async def manual_decode(
        self, owner: Owner, spec: s.PDInferenceServiceSpec, live: Live | None, post_event: EventFn
    ) -> bool:
        """Decode scale-down when no autoscaler drives decode (`kubectl scale pdis`, an edited
        spec.decode.replicas): the same drain-then-lower as the autoscaler's. True when the
        StatefulSet may take the spec's replicas now; False holds them while the groups that go
        drain (until their running requests are 0 or decode.drainTimeoutSeconds passed)."""
        current = dg.of(owner.name, spec).groups(int(((live or {}).get("spec") or {}).get("replicas") or 0))
        desired = spec.decode.replicas
        drain = self._manual.get(owner.key)
        if live is None or desired >= current:
            if drain is not None:  # scaled back up before the drain ended: keep every group
                del self._manual[owner.key]
                await self._undrain(owner, drain.victims)
                await post_event(ev.NORMAL, "ScaleDownCancelled", f"decode stays at {current}: spec asks {desired}")
            return True
        victims = dg.of(owner.name, spec).leader_ids(range(desired, current))
        if drain is None and not self._handovers(owner.key, victims):
            return True  # none of the groups that go is registered: nothing runs there to drain
        now = self.clock()
        drain = self._manual[owner.key] = await self._mark(owner, spec, drain, current, desired, now, post_event)
        busy = self._busy(owner.key, drain.victims)
        if busy and now - drain.started < spec.decode.drain_timeout_seconds:
            return False
        del self._manual[owner.key]
        await self._drained(owner, drain, busy, now, post_event)
        return True

    def _busy(self, key: str, victims: tuple[str, ...]) -> dict[str, int]:
        """Requests still running (or slots held) on the draining decodes; gone ones hold none."""
        members = {m.worker_id: m for m in (self.broker.members(key) or ())} if hasattr(self.broker, "members") else {}
        busy = {}
        for v in victims:
            m = members.get(v)
            if m is not None and (m.load.active_requests or m.load.slots_used):
                busy[v] = max(m.load.active_requests, m.load.slots_used)
        return busy

    async def _undrain(self, owner: Owner, victims: tuple[str, ...]) -> None:
        for victim in victims:
            self.broker.set_draining(owner.key, victim, False)

    async def _scale(
        self,
        owner: Owner,
        workload: tuple[str, str],
        replicas: int,
        workloads: dict[str, Live | None],
        role: str,
    ) -> None:
        """Write replicas of `workload` (kind, name) through its scale subresource (the field an
        autoscaler owns)."""
        kind, name = workload
        await asyncio.to_thread(
            self.kube.merge_patch, KINDS[kind], owner.namespace, name, {"spec": {"replicas": replicas}}, "scale"
        )
        obj = workloads.get(role)
        if obj is not None:  # what the status computed after this step reads
            obj.setdefault("spec", {})["replicas"] = replicas

    async def _changed(self, state: _State, role: str, old: int, new: int, reason: str, post_event: EventFn) -> None:
        state.changed_at[role] = _utc(self.wall())
        up = new > old
        await post_event(ev.NORMAL, "ScaledUp" if up else "ScaledDown", f"{role} {old} -> {new}: {reason}")
        log.info(kv(event="autoscaled", role=role, old=old, new=new, reason=reason))

    # ---- status ----------------------------------------------------------------------------

    def _status(
        self,
        owner: Owner,
        spec: s.PDInferenceServiceSpec,
        state: _State,
        current: dict[str, int],
        live: Mapping[tuple[str, str], Live | None],
    ) -> s.AutoscalingStatus:
        a = spec.autoscaling
        assert a is not None
        roles: dict[str, s.RoleScalingStatus | None] = {}
        for role in ("prefill", "decode"):
            r: s.RoleAutoscaling = getattr(a, role)
            if not r.enabled:
                roles[role] = None
                continue
            desired = current[role]
            reason = state.reasons.get(role, "waiting for the first planner step")
            if r.driver == "planner":
                desired = state.desired.get(role, current[role])
            elif r.driver == "hpa":
                hpa = live.get(("HorizontalPodAutoscaler", hpa_name(owner.name, role))) or {}
                desired = int((hpa.get("status") or {}).get("desiredReplicas") or current[role])
                reason = f"driven by HorizontalPodAutoscaler {hpa_name(owner.name, role)}"
                if role == "decode":
                    desired = dg.of(owner.name, spec).groups(desired)
            else:
                reason = "driven by an external autoscaler (spec.replicas of the workload is its to write)"
            roles[role] = s.RoleScalingStatus(
                driver=r.driver,
                current=current[role],
                desired=desired,
                reason=reason[:1024],
                last_change_time=state.changed_at.get(role),
            )
        parts = [
            f"{role[0].upper()}:{st.current}" + (f"->{st.desired}" if st.desired != st.current else "")
            for role, st in roles.items()
            if st is not None
        ]
        return s.AutoscalingStatus(prefill=roles["prefill"], decode=roles["decode"], summary=" ".join(parts))


def _loads(members: Iterable[Any]) -> tuple[list[WorkerLoad], dict[str, RouterReport]]:
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
        elif role == "router" and (rep := router_report(m.load, getattr(m, "load_at", 0.0) or None)) is not None:
            reports[m.worker_id] = rep
    return workers, reports
