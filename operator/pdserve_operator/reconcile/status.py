"""Children + broker view → the resource's status and conditions. Pure: the clock is an argument.

Phases, in the order they are decided:
- Invalid: the spec failed validation (SpecValid=False); children are left as they were.
- Ready: every role has its desired pods ready (and, when the broker runs, registered).
- Degraded: a workload reports a failure (ReplicaFailure, ProgressDeadlineExceeded), or a
  service that was Ready lost pods without its spec changing.
- Progressing: some pods are ready, or a rollout/scale is under way.
- Pending: nothing is ready yet.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pdserve_operator import events as ev
from pdserve_operator import spec as s
from pdserve_operator.reconcile import decode_groups as dg
from pdserve_operator.reconcile import workload_kinds as wk
from pdserve_operator.reconcile.children.env import kv_tokens_per_group
from pdserve_operator.reconcile.children.meta import Owner, endpoint, selector_string


@dataclass(frozen=True)
class Observed:
    """What the reconciler saw of the children (None: the child does not exist)."""

    prefill: dict[str, Any] | None = None
    decode: dict[str, Any] | None = None
    router: dict[str, Any] | None = None
    # (ordinal, ready) of decode pods; only needed to count complete groups when layerShards > 1.
    decode_pods: tuple[tuple[int, bool], ...] | None = None
    registered: Mapping[str, int] | None = None  # from the broker; None when no broker runs
    slots_used: int | None = None
    kv_tokens_used: int | None = None  # from the broker: the decodes' reported KV tokens in use
    conflicts: tuple[str, ...] = field(default=())  # children another controller owns
    unavailable: tuple[str, ...] = field(default=())  # children the cluster cannot take (no such API, forbidden)
    autoscaling: s.AutoscalingStatus | None = None  # the autoscaler's view (autoscale/autoscaler.py)
    last_drain: s.DrainStatus | None = None  # the last decode scale-down's drain (autoscale/drain.py)


@dataclass(frozen=True)
class Workload:
    """Counts of one Deployment or StatefulSet, from its status."""

    exists: bool
    ready: int = 0
    replicas: int = 0
    updated: int = 0
    current_generation: bool = True
    failure: str | None = None

    @classmethod
    def of(cls, obj: dict[str, Any] | None) -> Workload:
        if obj is None:
            return cls(exists=False)
        st = obj.get("status") or {}
        gen = (obj.get("metadata") or {}).get("generation")
        failure = None
        for cond in st.get("conditions") or []:
            if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
                failure = f"ReplicaFailure: {cond.get('message') or cond.get('reason')}"
            if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
                failure = f"ProgressDeadlineExceeded: {cond.get('message') or ''}".rstrip(": ")
        return cls(
            exists=True,
            ready=int(st.get("readyReplicas") or 0),
            replicas=int(st.get("replicas") or 0),
            updated=int(st.get("updatedReplicas") or 0),
            # A LeaderWorkerSet's status has no observedGeneration: its updatedReplicas tell a rollout.
            current_generation=gen is None
            or obj.get("kind") == "LeaderWorkerSet"
            or int(st.get("observedGeneration") or 0) >= int(gen),
            failure=failure,
        )


def ready_groups(pods: Iterable[tuple[int, bool]], shards: int) -> int:
    """Decode groups whose every member pod is ready (a partial group serves nothing)."""
    ready_by_group: dict[int, int] = {}
    for ordinal, ready in pods:
        if ready:
            group = ordinal // shards
            ready_by_group[group] = ready_by_group.get(group, 0) + 1
    return sum(1 for n in ready_by_group.values() if n >= shards)


def _summary(a: int | None, b: int) -> str:
    return f"{'-' if a is None else a}/{b}"


def _condition(
    prev: s.PDInferenceServiceStatus | None,
    type_: str,
    status: bool | None,
    reason: str,
    message: str,
    generation: int,
    now: str,
) -> s.Condition:
    text = "Unknown" if status is None else ("True" if status else "False")
    old = prev.condition(type_) if prev is not None else None
    since = old.last_transition_time if old is not None and old.status == text else now
    return s.Condition(
        type=type_,
        status=text,
        reason=reason,
        message=message,
        last_transition_time=since,
        observed_generation=generation,
    )


def previous(raw: Mapping[str, Any] | None) -> s.PDInferenceServiceStatus | None:
    """The stored status, if it parses (a hand-edited or foreign status is simply ignored)."""
    if not raw:
        return None
    try:
        return s.PDInferenceServiceStatus.model_validate(dict(raw))
    except ValueError:
        return None


def invalid(
    owner: Owner, generation: int, reason: str, prev: s.PDInferenceServiceStatus | None, now: str
) -> s.PDInferenceServiceStatus:
    """Status of a resource whose spec failed validation: say why, keep the last counts."""
    base = prev or s.PDInferenceServiceStatus()
    conds = [
        _condition(prev, "SpecValid", False, "InvalidSpec", reason, generation, now),
        _condition(
            prev, "Ready", False, "InvalidSpec", "the spec is invalid; children were left unchanged", generation, now
        ),
        _condition(prev, "Progressing", False, "InvalidSpec", "waiting for a valid spec", generation, now),
        _condition(prev, "Degraded", False, "InvalidSpec", "", generation, now),
    ]
    return base.model_copy(update={"phase": "Invalid", "observed_generation": generation, "conditions": conds})


def compute(
    owner: Owner,
    spec: s.PDInferenceServiceSpec,
    generation: int,
    observed: Observed,
    prev: s.PDInferenceServiceStatus | None,
    now: str,
) -> s.PDInferenceServiceStatus:
    """The status a reconcile writes: per-role counts, the phase, the conditions, the capacity."""
    decode = dg.of(owner.name, spec)
    workloads = {role: Workload.of(getattr(observed, role)) for role in ("prefill", "decode", "router")}
    decode_ready = (
        ready_groups(observed.decode_pods, decode.shards)
        if observed.decode_pods is not None and decode.shards > 1
        else decode.groups(workloads["decode"].ready)
    )
    role_status, short = _roles(spec, observed, workloads, decode_ready, decode)
    missing = [role for role, w in workloads.items() if not w.exists]
    failures = [f"{role}: {w.failure}" for role, w in workloads.items() if w.failure]
    rolling = [
        role for role, w in workloads.items() if w.exists and (not w.current_generation or w.updated < w.replicas)
    ]
    spec_changed = prev is None or prev.observed_generation != generation
    any_ready = any(st["ready"] > 0 for st in role_status.values())
    blocked = observed.conflicts + observed.unavailable
    phase = _phase(bool(short or missing), failures, blocked, prev, spec_changed, any_ready)
    problems = failures + [f"{c} is owned by another controller" for c in observed.conflicts]
    problems += list(observed.unavailable)
    problems += [f"{role} workload missing" for role in missing] + short
    detail = "; ".join(problems)
    progressing = phase in ("Pending", "Progressing") or bool(rolling) or bool(missing)
    moving = ", ".join(f"{role} rolling out" for role in rolling) or detail
    total = spec.decode.slots * decode_ready
    used = observed.slots_used
    kv_total = kv_tokens_per_group(spec) * decode_ready
    kv_used = observed.kv_tokens_used
    return s.PDInferenceServiceStatus(
        phase=phase,
        observed_generation=generation,
        conditions=_conditions(prev, phase, detail, progressing, moving, generation, now),
        prefill=s.RoleStatus(**role_status["prefill"]),
        decode=s.DecodeStatus(
            **role_status["decode"],
            replicas=decode.groups(workloads["decode"].replicas),
            selector=selector_string(owner.name, "decode"),
            workload_kind=wk.running_kind(spec) if observed.decode is not None else _prev_kind(prev),
        ),
        router=s.RoleStatus(**role_status["router"]),
        slots=s.SlotStatus(used=used, total=total, summary=_summary(used, total)),
        kv_tokens=s.KVStatus(used=kv_used, total=kv_total, summary=_summary(kv_used, kv_total)),
        endpoint=endpoint(owner, spec),
        autoscaling=observed.autoscaling,
        last_drain=observed.last_drain,
    )


def _prev_kind(prev: s.PDInferenceServiceStatus | None) -> str | None:
    return prev.decode.workload_kind if prev is not None else None


def _roles(
    spec: s.PDInferenceServiceSpec,
    observed: Observed,
    workloads: dict[str, Workload],
    decode_ready: int,
    decode: dg.DecodeWorkload,
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Each role's desired/ready/registered counts, and what keeps a role short of ready."""
    shards, reg = spec.decode.layer_shards, observed.registered
    # An autoscaled role wants what its workload is asked for now (an autoscaler wrote it).
    p_want = _asked(observed.prefill, 1) if s.autoscaled(spec, "prefill") else None
    d_want = _asked(observed.decode, decode.per_replica) if s.autoscaled(spec, "decode") else None
    p_want = spec.prefill.replicas if p_want is None else p_want
    d_want = spec.decode.replicas if d_want is None else d_want
    roles = {
        "prefill": (p_want, workloads["prefill"].ready, p_want),
        "decode": (d_want, decode_ready, d_want * shards),
        "router": (spec.router.replicas, workloads["router"].ready, spec.router.replicas),
    }
    role_status: dict[str, dict[str, Any]] = {}
    short: list[str] = []
    for role, (desired, ready, pods_wanted) in roles.items():
        registered = None if reg is None else int(reg.get(role, 0))
        role_status[role] = {
            "desired": desired,
            "ready": ready,
            "registered": registered,
            "summary": _summary(ready, desired),
        }
        if ready < desired:
            short.append(f"{role} {ready}/{desired} ready")
        elif registered is not None and registered < pods_wanted:
            short.append(f"{role} {registered}/{pods_wanted} registered with the broker")
    return role_status, short


def _phase(
    lacking: bool,
    failures: list[str],
    conflicts: tuple[str, ...],
    prev: s.PDInferenceServiceStatus | None,
    spec_changed: bool,
    any_ready: bool,
) -> s.Phase:
    """Ready when nothing lacks; Degraded on a failure, a conflict, or a fall from Ready without
    a spec change; else Progressing once anything is ready, Pending before."""
    if not lacking and not conflicts:
        return "Ready"
    if failures or conflicts:
        return "Degraded"
    if prev is not None and prev.phase in ("Ready", "Degraded") and not spec_changed:
        return "Degraded"
    return "Progressing" if any_ready else "Pending"


def _conditions(
    prev: s.PDInferenceServiceStatus | None,
    phase: s.Phase,
    detail: str,
    progressing: bool,
    moving: str,
    generation: int,
    now: str,
) -> list[s.Condition]:
    ready, degraded = phase == "Ready", phase == "Degraded"
    return [
        _condition(prev, "SpecValid", True, "Valid", "", generation, now),
        _condition(prev, "Ready", ready, "AllReplicasReady" if ready else "NotReady", detail, generation, now),
        _condition(
            prev,
            "Progressing",
            progressing,
            "RollingOut" if progressing else "Stable",
            moving if progressing else "",
            generation,
            now,
        ),
        _condition(
            prev,
            "Degraded",
            degraded,
            "Degraded" if degraded else "Healthy",
            detail if degraded else "",
            generation,
            now,
        ),
    ]


def _asked(workload: dict[str, Any] | None, per: int) -> int | None:
    """The replicas a live workload's spec asks for (decode: in groups); None when it does not exist."""
    if workload is None:
        return None
    return int((workload.get("spec") or {}).get("replicas") or 0) // per


def transition_event(
    prev: s.PDInferenceServiceStatus | None, new: s.PDInferenceServiceStatus
) -> tuple[ev.EventType, str, str] | None:
    """(type, reason, message) when the phase changed, for a Kubernetes Event."""
    old_phase = prev.phase if prev is not None else None
    if old_phase == new.phase:
        return None
    type_, reason = ev.PHASE_REASONS[new.phase]
    if new.phase == "Invalid":
        valid = new.condition("SpecValid")
        return (type_, reason, valid.message if valid else "invalid spec")
    ready = new.condition("Ready")
    detail = f": {ready.message}" if ready is not None and ready.message else ""
    return (type_, reason, f"phase {old_phase or 'none'} -> {new.phase}{detail}")
