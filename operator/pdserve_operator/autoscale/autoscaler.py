"""The built-in autoscaler: each reconcile of a service with planner-driven roles may take a step.

Inputs are the broker's members (workers' loads, routers' counters and latency histograms:
`inputs.py`) and the workloads as they are live. A step (at most one per
`autoscaling.intervalSeconds`) runs the pure `planner.controller_step` with the state kept per
service and carries out what it decides: up, or prefill down, writes the workload's
`spec.replicas` through its scale subresource (the operator's apply leaves that field alone:
`workloads.autoscaled_workloads`); decode down drains the groups that go first (`drain.py`),
and a new decision to go up cancels the drain. Every change is an Event and every step leaves
`status.autoscaling`; roles an HPA or an external autoscaler drives are only reported. State
lives in memory: a new leader starts afresh, which only delays a scale-down by one down window.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pdserve_common.logs import kv
from pdserve_operator import events as ev
from pdserve_operator import spec as s
from pdserve_operator.autoscale.drain import DecodeDrains, Drain, EventFn, ScaleDown, utc
from pdserve_operator.autoscale.inputs import in_band, member_loads, planner_config
from pdserve_operator.broker.view import BrokerView
from pdserve_operator.kube import KINDS, KubeClient
from pdserve_operator.planner import ControllerConfig, Observation, PlannerState, StepResult, controller_step
from pdserve_operator.planner.signals import RouterReport, window
from pdserve_operator.reconcile import decode_groups as dg
from pdserve_operator.reconcile.children.meta import Owner, hpa_name, workload_name

log = logging.getLogger(__name__)

Live = dict[str, Any]
DRAIN_RECHECK_S = 1.0  # while a decode drains, look again this often


@dataclass
class _State:
    planner: PlannerState = field(default_factory=PlannerState)
    routers: dict[str, RouterReport] = field(default_factory=dict)
    router_rates: dict[str, float] = field(default_factory=dict)  # each router's last rate (signals.window)
    sampled_at: float | None = None
    next_due: float = 0.0
    drain: Drain | None = None
    reasons: dict[str, str] = field(default_factory=dict)
    changed_at: dict[str, str] = field(default_factory=dict)
    desired: dict[str, int] = field(default_factory=dict)
    generation: int = -1
    config: ControllerConfig | None = None


@dataclass(frozen=True)
class PlanInput:
    """One step's view of one service: what planning and scaling to the plan read."""

    owner: Owner
    spec: s.PDInferenceServiceSpec
    generation: int
    current: dict[str, int]  # replicas per role, in groups for decode
    ready: dict[str, int]
    workloads: dict[str, Live | None]  # per role, as live (a scale writes its new replicas here)
    planner_roles: list[str]
    now: float
    post_event: EventFn


def _replicas(workload: Live | None, field_: str, section: str = "spec") -> int:
    return int(((workload or {}).get(section) or {}).get(field_) or 0)


class Autoscaler:
    def __init__(
        self,
        kube: KubeClient,
        broker: BrokerView,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.kube = kube
        self.broker = broker
        self.clock = clock
        self.wall = wall
        self._states: dict[str, _State] = {}
        self.drains = DecodeDrains(broker, clock, wall)

    def due(self, key: str) -> bool:
        """A step is due (or a manual scale-down drains: look again at each timer tick)."""
        state = self._states.get(key)
        return key in self.drains.manual or (state is not None and self.clock() >= state.next_due)

    def forget(self, key: str) -> None:
        self._states.pop(key, None)
        self.drains.forget(key)

    def last_drain(self, key: str) -> s.DrainStatus | None:
        return self.drains.last_drain(key)

    async def manual_decode(
        self, owner: Owner, spec: s.PDInferenceServiceSpec, live: Live | None, post_event: EventFn
    ) -> bool:
        """Whether the decode workload may take the spec's replicas now (`DecodeDrains.manual_decode`)."""
        return await self.drains.manual_decode(owner, spec, live, post_event)

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
        current = {r: _replicas(w, "replicas") // per[r] for r, w in workloads.items()}
        ready = {r: _replicas(w, "readyReplicas", "status") // per[r] for r, w in workloads.items()}
        now = self.clock()
        planner_roles = [
            r for r in ("prefill", "decode") if getattr(a, r).enabled and getattr(a, r).driver == "planner"
        ]
        if planner_roles and now >= state.next_due and all(workloads.values()):
            step = PlanInput(owner, spec, generation, current, ready, workloads, planner_roles, now, post_event)
            await self._plan(step, state)
            current = {r: _replicas(workloads[r], "replicas") // per[r] for r in workloads}
        if state.drain is not None:
            state.next_due = min(state.next_due, now + DRAIN_RECHECK_S)
        return _report(owner, spec, state, current, live)

    # ---- planning --------------------------------------------------------------------------

    async def _plan(self, step: PlanInput, state: _State) -> None:
        a = step.spec.autoscaling
        assert a is not None
        state.next_due = step.now + a.interval_seconds
        if not self._configured(step, state):
            return
        members = self.broker.members(step.owner.key)
        if members is None:
            for role in step.planner_roles:
                state.reasons[role] = "hold: the broker reports no load (it is not running in this operator)"
            return
        workers, reports = member_loads(members)
        win = window(
            state.routers,
            reports,
            step.now - state.sampled_at if state.sampled_at is not None else 0.0,
            a.slo.percentile / 100,
            state.router_rates,
        )
        state.routers, state.router_rates, state.sampled_at = reports, dict(win.rates), step.now
        current, ready = step.current, step.ready
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
        result = controller_step(state.planner, obs, step.now, state.config)
        state.planner = result.state
        log.info(
            kv(
                event="autoscale_step",
                service=step.owner.key,
                rate=win.request_rate,
                ttft_s=win.ttft_s,
                tpot_s=win.tpot_s,
                prefill=f"{current['prefill']}->{result.prefill.desired}",
                decode=f"{current['decode']}->{result.decode.desired}",
            )
        )
        await self._apply(step, state, result)

    def _configured(self, step: PlanInput, state: _State) -> bool:
        """The planner's configuration for this generation of the spec (False: it has none)."""
        if state.config is not None and state.generation == step.generation:
            return True
        try:
            state.config = planner_config(step.spec, step.current)
        except ValueError as exc:
            for role in step.planner_roles:
                state.reasons[role] = f"planner not configured: {exc}"
            log.warning(kv(event="autoscale_config_failed", service=step.owner.key, error=str(exc)))
            return False
        state.generation = step.generation
        return True

    async def _apply(self, step: PlanInput, state: _State, result: StepResult) -> None:
        """Scale to the plan: decode first (a drain may hold it up), then prefill within the P:D
        band of where decode really is."""
        owner, spec, current = step.owner, step.spec, step.current
        a = spec.autoscaling
        assert a is not None
        decode_now = current["decode"]
        if "decode" in step.planner_roles:
            state.reasons["decode"] = result.decode.reason
            state.desired["decode"] = result.decode.desired
            await self._decode(step, state, result.decode.desired)
            decode_now = dg.of(owner.name, spec).groups(
                int((step.workloads["decode"] or {}).get("spec", {}).get("replicas") or 0)
            )
        if "prefill" in step.planner_roles:
            desired, reason = result.prefill.desired, result.prefill.reason
            banded = in_band(desired, decode_now, a, spec)
            if banded != desired:  # decode is not (yet) where the plan put it: keep P:D in the band meanwhile
                reason = f"{banded} to keep P:D in the band while decode is at {decode_now}; plan: {reason}"
                desired = banded
            state.reasons["prefill"], state.desired["prefill"] = reason, desired
            if desired != current["prefill"]:
                prefill = ("Deployment", workload_name(owner.name, "prefill"))
                await self._scale(owner, prefill, desired, step.workloads, "prefill")
                await self._changed(state, "prefill", current["prefill"], desired, reason, step.post_event)

    async def _decode(self, step: PlanInput, state: _State, desired: int) -> None:
        owner, spec, now, post_event = step.owner, step.spec, step.now, step.post_event
        current = step.current["decode"]
        decode = dg.of(owner.name, spec)
        drain = state.drain
        if desired >= current:
            if drain is not None:  # back up (or steady) before the drain ended: keep every group
                await self.drains.undrain(owner, drain.victims)
                state.drain = None
                await post_event(
                    ev.NORMAL,
                    "ScaleDownCancelled",
                    f"decode stays at {current}: the planner no longer wants {drain.target}",
                )
            if desired > current:
                # Groups that come back may still be registered from before, drained by us: a
                # pod that restarts registers afresh, but one that never stopped keeps the mark.
                await self.drains.undrain(owner, decode.leader_ids(range(current, desired)))
                await self._scale(owner, decode.key, decode.replicas(desired), step.workloads, "decode")
                await self._changed(state, "decode", current, desired, state.reasons["decode"], post_event)
            return
        down = ScaleDown(owner, spec, current, desired, now, post_event)
        drain = state.drain = await self.drains.mark(down, drain)
        busy = self.drains.busy(owner.key, drain.victims)
        timed_out = now - drain.started >= spec.decode.drain_timeout_seconds
        if busy and not timed_out:
            state.reasons["decode"] = (
                f"draining {', '.join(drain.victims)} before {current} -> {desired}: "
                f"{sum(busy.values())} requests still running"
            )
            return
        await self._scale(owner, decode.key, decode.replicas(desired), step.workloads, "decode")
        why = state.reasons["decode"] + (
            f"; drain timed out with {sum(busy.values())} requests running" if busy else "; drained"
        )
        state.drain = None
        await self.drains.drained(owner, drain, busy, now, post_event)
        await self._changed(state, "decode", current, desired, why, post_event)

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
        state.changed_at[role] = utc(self.wall())
        up = new > old
        await post_event(ev.NORMAL, "ScaledUp" if up else "ScaledDown", f"{role} {old} -> {new}: {reason}")
        log.info(kv(event="autoscaled", role=role, old=old, new=new, reason=reason))


def _report(
    owner: Owner,
    spec: s.PDInferenceServiceSpec,
    state: _State,
    current: dict[str, int],
    live: Mapping[tuple[str, str], Live | None],
) -> s.AutoscalingStatus:
    """status.autoscaling: per role its driver, current and desired count, and why."""
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
