"""One reconcile of one PDInferenceService: read it, apply its children, write its status.

Everything the kopf handlers trigger funnels into `Reconciler.reconcile(namespace, name)`:
creation, spec updates, resumption after a restart, a child edited or deleted by hand, a child
whose readiness changed, and the periodic resync. It reads as one line: parse the spec → the
broker token → apply the children → observe them → write the status. Each step is idempotent
(get → create if missing → merge-patch only what drifted → status only if it changed). A child
another controller owns is never written (the status says Degraded and names it); drift in a
rendered field is patched back (a `DriftReverted` Warning when the spec did not change).
Requests for one service are coalesced: while a reconcile runs, further requests collapse into
one follow-up run. In detail: docs/operator.md.
"""

from __future__ import annotations

import asyncio
import collections
import datetime
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from pydantic import ValidationError

from pdserve_common.logs import kv
from pdserve_operator import events as ev
from pdserve_operator import spec as s
from pdserve_operator.autoscale.autoscaler import Autoscaler
from pdserve_operator.broker.view import BrokerView
from pdserve_operator.kube import KINDS, PDIS, KubeClient, KubeError, kind_of
from pdserve_operator.metrics import OperatorMetrics
from pdserve_operator.reconcile import decode_groups as dg
from pdserve_operator.reconcile import drift
from pdserve_operator.reconcile import status as st
from pdserve_operator.reconcile import workload_kinds as wk
from pdserve_operator.reconcile.children import render
from pdserve_operator.reconcile.children.autoscaling import hpa_roles
from pdserve_operator.reconcile.children.meta import (
    Defaults,
    Owner,
    hpa_name,
    secret_name,
    selector_string,
)
from pdserve_operator.reconcile.children.secret import token_of
from pdserve_operator.reconcile.children.workloads import autoscaled_workloads
from pdserve_operator.reconcile.scaling_adapters import ScalingAdapters

GONE_REMEMBERED = 4096  # deleted services' uids kept (a set that only grows would be a leak)

log = logging.getLogger(__name__)

Live = dict[str, Any]


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def new_token() -> str:
    return secrets.token_urlsafe(32)


@dataclass
class Outcome:
    """What one reconcile did (for logs and tests)."""

    created: list[str] = field(default_factory=list)
    patched: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    unavailable: list[str] = field(default_factory=list)  # optional children the cluster cannot take
    status_written: bool = False
    phase: str = ""


@dataclass(frozen=True)
class _Service:
    """The resource as read at the start of a reconcile."""

    body: Live
    owner: Owner
    generation: int
    prev: s.PDInferenceServiceStatus | None

    @classmethod
    def of(cls, body: Live) -> _Service:
        meta = body["metadata"]
        owner = Owner(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])
        return cls(body, owner, int(meta.get("generation") or 1), st.previous(body.get("status")))

    @property
    def spec_unchanged(self) -> bool:
        """The last status was written for this very spec generation."""
        return self.prev is not None and self.prev.observed_generation == self.generation


class InvalidSpec(ValueError):
    """The resource passed the API server's schema but not the operator's checks."""


@dataclass
class _Slot:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    waiting: bool = False


class Reconciler:
    def __init__(
        self,
        kube: KubeClient,
        broker: BrokerView,
        defaults: Defaults,
        clock: Callable[[], str] = utc_now,
        token_factory: Callable[[], str] = new_token,
        metrics: OperatorMetrics | None = None,
    ) -> None:
        self.kube = kube
        self.metrics = metrics
        self.broker = broker
        self.defaults = defaults
        self.clock = clock
        self.token_factory = token_factory
        self._slots: dict[tuple[str, str], _Slot] = {}
        # uids of deleted services: a reconcile that read one just before its deletion must not
        # give the broker its token again after the deletion handler took it away.
        self._gone: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.autoscaler = Autoscaler(kube, broker)
        self.adapters = ScalingAdapters(kube)

    async def request(self, namespace: str, name: str, why: str) -> Outcome | None:
        """Reconcile soon; returns None when an already queued run will cover this request."""
        slot = self._slots.setdefault((namespace, name), _Slot())
        if slot.waiting:
            return None
        slot.waiting = True
        async with slot.lock:
            slot.waiting = False
            try:
                return await self.reconcile(namespace, name, why)
            except Exception:
                if self.metrics is not None:
                    self.metrics.observe_reconcile("error")
                raise

    def forget(self, namespace: str, name: str, uid: str | None = None) -> None:
        """A deleted service: its state goes, and (by `uid`) no later reconcile re-registers it."""
        if uid:
            self._gone[uid] = None
            while len(self._gone) > GONE_REMEMBERED:
                self._gone.popitem(last=False)
        self._slots.pop((namespace, name), None)
        self.autoscaler.forget(f"{namespace}/{name}")
        if self.metrics is not None:
            self.metrics.forget(namespace, name)

    async def reconcile(self, namespace: str, name: str, why: str) -> Outcome | None:
        body = await asyncio.to_thread(self.kube.get, PDIS, namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return None  # gone or going: ownerReferences let the garbage collector take the children
        svc = _Service.of(body)
        outcome = Outcome()
        try:
            spec = parse(svc)
        except InvalidSpec as exc:
            log.warning(kv(event="spec_invalid", service=svc.owner.key, reason=str(exc)))
            invalid = st.invalid(svc.owner, svc.generation, str(exc), svc.prev, self.clock())
            await self._write_status(svc, invalid, outcome)
            if self.metrics is not None:
                self.metrics.observe_reconcile("invalid")
                self.metrics.observe_status(namespace, name, invalid)
            return outcome
        svc, spec, adapters = await self._sync_adapters(svc, spec)
        token, secret = await self._token(svc)
        children = render(svc.owner, spec, token, self.defaults)
        live = await self._apply_children(
            svc, children, secret, outcome, autoscaled_workloads(svc.owner.name, spec), spec
        )
        await self._remove_stale_hpas(svc, spec)
        await self._remove_replaced_decode(svc, spec, live)
        await self.adapters.report(svc.owner, spec, adapters, live)
        scaling = await self.autoscaler.step(
            svc.owner, spec, svc.generation, live, lambda type_, reason, msg: self._event(svc, type_, reason, msg)
        )
        observed = await self._observe(svc, spec, live, outcome.conflicts, scaling)
        observed = replace(
            observed,
            unavailable=tuple(outcome.unavailable),
            last_drain=self.autoscaler.last_drain(svc.owner.key)
            or (svc.prev.last_drain if svc.prev is not None else None),
        )
        status = st.compute(svc.owner, spec, svc.generation, observed, svc.prev, self.clock())
        await self._write_status(svc, status, outcome)
        if self.metrics is not None:
            self.metrics.observe_reconcile("ok")
            self.metrics.observe_status(namespace, name, status)
        log.debug(kv(event="reconciled", service=svc.owner.key, why=why, phase=outcome.phase))
        return outcome

    async def _sync_adapters(
        self, svc: _Service, spec: s.PDInferenceServiceSpec
    ) -> tuple[_Service, s.PDInferenceServiceSpec, dict[str, Live]]:
        """Each role's PDScalingAdapter in step with the spec; a scaled adapter changes the spec
        (scaling_adapters.py), and the rest of this reconcile then works from the new spec."""

        async def post(type_: ev.EventType, reason: str, message: str) -> None:
            await self._event(svc, type_, reason, message)

        body, adapters = await self.adapters.sync(svc.body, svc.owner, spec, post)
        if body is svc.body:
            return svc, spec, adapters
        moved = _Service(body, svc.owner, int(body["metadata"].get("generation") or 1), svc.prev)
        return moved, parse(moved), adapters

    async def _decode_may_lower(self, svc: _Service, spec: s.PDInferenceServiceSpec, sts: Live | None) -> bool:
        """Whether the decode StatefulSet (no autoscaler drives it) may take the spec's replicas
        now: a scale-down first drains the groups that go (autoscale/drain.py `manual_decode`)."""

        async def post(type_: ev.EventType, reason: str, message: str) -> None:
            await self._event(svc, type_, reason, message)

        return await self.autoscaler.manual_decode(svc.owner, spec, sts, post)

    async def _token(self, svc: _Service) -> tuple[str, Live | None]:
        """The service's broker token (from its Secret, or a new one) and the Secret as read.

        A Secret of that name that another controller owns is not ours to trust: whoever made
        it chose its token, and the broker would let them register workers of this service and
        receive its requests. The broker then gets a token nobody knows; the Secret is left
        alone like any foreign child, and the status says Degraded and names it.
        """
        name = secret_name(svc.owner.name)
        secret = await asyncio.to_thread(self.kube.get, KINDS["Secret"], svc.owner.namespace, name)
        trusted = drift.controller_other_than({svc.owner.uid}, secret) is None
        token = (token_of(secret) if trusted else None) or self.token_factory()
        if svc.owner.uid not in self._gone:
            self.broker.set_service_token(svc.owner.key, token)
        return token, secret

    async def _apply_children(
        self,
        svc: _Service,
        desired: list[Live],
        secret: Live | None,
        outcome: Outcome,
        autoscaled: set[tuple[str, str]] = frozenset(),  # type: ignore[assignment]
        spec: s.PDInferenceServiceSpec | None = None,
    ) -> dict[tuple[str, str], Live]:
        """Create, leave or patch each rendered child; the children as they are now.

        The workloads in `autoscaled` get their rendered replicas only when created: after that
        `spec.replicas` is the autoscaler's field, and we neither compare nor write it (as a
        server-side apply that leaves the field out of its configuration would not). The decode
        StatefulSet keeps its replicas too while a scale-down drains the groups that go."""
        live: dict[tuple[str, str], Live] = {}
        decode = dg.of(svc.owner.name, spec).key if spec is not None else ("StatefulSet", "")
        for want in desired:
            read = (secret,) if want["kind"] == "Secret" else None  # the Secret was read for the token
            key = (want["kind"], want["metadata"]["name"])
            held = key in autoscaled
            if key == decode and not held and spec is not None:
                read = (await asyncio.to_thread(self.kube.get, KINDS[key[0]], svc.owner.namespace, key[1]),)
                held = not await self._decode_may_lower(svc, spec, read[0])
            try:
                live[key] = await self._apply_child(svc, want, read, outcome, held)
            except KubeError as exc:
                if want["kind"] not in OPTIONAL_KINDS or exc.status not in (403, 404):
                    raise
                outcome.unavailable.append(_unavailable(want, exc))
                log.warning(kv(event="child_unavailable", service=svc.owner.key, child=key[1], status=exc.status))
        if outcome.created:
            log.info(kv(event="children_created", service=svc.owner.key, children=",".join(outcome.created)))
        return live

    async def _apply_child(
        self,
        svc: _Service,
        want: Live,
        read: tuple[Live | None] | None,
        outcome: Outcome,
        replicas_released: bool = False,
    ) -> Live:
        """One child; `read` holds it when it was read already (None inside: it did not exist)."""
        kind, namespace, name = kind_of(want), svc.owner.namespace, want["metadata"]["name"]
        label = f"{kind.kind}/{name}"
        current = read[0] if read is not None else await asyncio.to_thread(self.kube.get, kind, namespace, name)
        if current is None:
            try:
                created = await asyncio.to_thread(self.kube.create, want)
                outcome.created.append(label)
                return created
            except KubeError as exc:
                if exc.status != 409:
                    raise
                current = await asyncio.to_thread(self.kube.get, kind, namespace, name)
                if current is None:  # created and deleted again since: the next reconcile sees how it ends
                    raise
                log.info(kv(event="child_create_raced", service=svc.owner.key, child=label))
        if replicas_released:
            want = {**want, "spec": {k: v for k, v in want["spec"].items() if k != "replicas"}}
        if (foreign := drift.foreign_controller(want, current)) is not None:
            outcome.conflicts.append(label)
            log.warning(kv(event="child_conflict", service=svc.owner.key, child=label, controller=foreign))
            return current
        paths = drift.content_drift(want, current)
        if not paths:
            return current
        patched = await asyncio.to_thread(self.kube.merge_patch, kind, namespace, name, drift.merge_patch(want))
        outcome.patched.append(label)
        log.info(kv(event="child_patched", service=svc.owner.key, child=label, fields=",".join(paths[:8])))
        if svc.spec_unchanged:  # the spec did not move since the last reconcile: someone else changed the child
            await self._event(svc, ev.WARNING, ev.DRIFT_REVERTED, f"{label}: reverted {', '.join(paths[:5])}")
        return patched

    async def _remove_stale_hpas(self, svc: _Service, spec: s.PDInferenceServiceSpec) -> None:
        """An HPA we rendered for a role that no longer has driver hpa would fight whoever
        drives it now: delete it (only ours: one another controller owns is left alone)."""
        if spec.autoscaling is None and (svc.prev is None or svc.prev.autoscaling is None):
            return  # never autoscaled: nothing of ours to look for
        kind = KINDS["HorizontalPodAutoscaler"]
        for role in set(("prefill", "decode")) - set(hpa_roles(spec)):
            name = hpa_name(svc.owner.name, role)
            current = await asyncio.to_thread(self.kube.get, kind, svc.owner.namespace, name)
            if not _ours(svc, current):
                continue
            await asyncio.to_thread(self.kube.delete, kind, svc.owner.namespace, name)
            log.info(kv(event="hpa_removed", service=svc.owner.key, hpa=name, role=role))

    async def _remove_replaced_decode(
        self, svc: _Service, spec: s.PDInferenceServiceSpec, live: dict[tuple[str, str], Live]
    ) -> None:
        """After spec.workload or decode.groupScheduling changed, what ran the roles before goes
        once what the spec asks for exists (workload_kinds.py says what and why). Only ours."""
        was = svc.prev.decode.workload_kind if svc.prev is not None else None
        for kind_name, name in wk.replaced(svc.owner.name, spec, was, live):
            current = await asyncio.to_thread(self.kube.get, KINDS[kind_name], svc.owner.namespace, name)
            if not _ours(svc, current):
                continue
            await asyncio.to_thread(self.kube.delete, KINDS[kind_name], svc.owner.namespace, name)
            log.info(kv(event="workload_replaced", service=svc.owner.key, removed=f"{kind_name}/{name}"))
            what = "prefill pods" if kind_name == "Deployment" else "decode groups"
            message = f"{kind_name}/{name} removed: the {what} run as a {wk.running_kind(spec)} now"
            await self._event(svc, ev.NORMAL, "DecodeWorkloadReplaced", message)

    async def _observe(
        self,
        svc: _Service,
        spec: s.PDInferenceServiceSpec,
        live: dict[tuple[str, str], Live],
        conflicts: list[str],
        scaling: s.AutoscalingStatus | None = None,
    ) -> st.Observed:
        """What the status is computed from: the workloads, decode pods when grouped, the broker."""
        name, key = svc.owner.name, svc.owner.key
        decode_pods = None
        decode = dg.of(name, spec)
        if decode.shards > 1 and spec.workload != "DisaggregatedSet":  # complete groups need every member ready
            selector = selector_string(name, "decode")
            pods = await asyncio.to_thread(self.kube.list, KINDS["Pod"], svc.owner.namespace, selector)
            decode_pods = tuple(_pod_readiness(decode, p) for p in pods if decode.runs(p))
        return st.Observed(
            prefill=wk.role_live(name, spec, live, "prefill"),
            decode=wk.role_live(name, spec, live, "decode"),
            router=wk.role_live(name, spec, live, "router"),
            decode_pods=decode_pods,
            registered=self.broker.registered_counts(key),
            slots_used=self.broker.slots_in_use(key),
            kv_tokens_used=self.broker.kv_tokens_in_use(key),
            conflicts=tuple(conflicts),
            autoscaling=scaling,
        )

    async def _write_status(self, svc: _Service, new: s.PDInferenceServiceStatus, outcome: Outcome) -> None:
        """Patch the status when it changed, and post an Event when the phase did."""
        outcome.phase = new.phase
        if svc.prev is not None and svc.prev.wire() == new.wire():
            return
        # A merge patch: nulls remove what the new status no longer reports; lists are replaced.
        patch = {"status": new.model_dump(mode="json", by_alias=True)}
        await asyncio.to_thread(self.kube.merge_patch, PDIS, svc.owner.namespace, svc.owner.name, patch, "status")
        outcome.status_written = True
        event = st.transition_event(svc.prev, new)
        if event is not None:
            await self._event(svc, *event)

    async def _event(self, svc: _Service, type_: ev.EventType, reason: str, message: str) -> None:
        """Events are best effort, as with client-go's recorder: a failed post is logged, not retried."""
        try:
            await asyncio.to_thread(self.kube.post_event, svc.body, type_, reason, message)
        except KubeError as exc:
            log.warning(
                kv(
                    event="event_post_failed",
                    service=svc.owner.key,
                    reason=reason,
                    status=exc.status,
                    error=exc.message,
                )
            )


def parse(svc: _Service) -> s.PDInferenceServiceSpec:
    """The spec, checked beyond the CRD's schema; InvalidSpec says what is wrong."""
    if len(svc.owner.name) > s.MAX_NAME_LENGTH:
        raise InvalidSpec(f"metadata.name {svc.owner.name!r} is longer than {s.MAX_NAME_LENGTH} characters")
    try:
        return s.parse_spec(svc.body.get("spec"))
    except ValidationError as exc:
        raise InvalidSpec(s.describe(exc)) from exc
    except ValueError as exc:
        raise InvalidSpec(str(exc)) from exc


# Children of APIs a cluster may lack (a CRD of another project): without it the service still
# serves, so the reconcile goes on and the status says Degraded and what to install or grant.
# A LeaderWorkerSet is the decode itself: without it no decode runs, and the status says so
# (Degraded, what to install) rather than quietly falling back to the StatefulSet the user opted out of.
OPTIONAL_KINDS = {
    "InferencePool": "the Gateway API Inference Extension's CRDs (InferencePool, inference.networking.k8s.io/v1)",
    "LeaderWorkerSet": "LeaderWorkerSet (sigs.k8s.io/lws, leaderworkerset.x-k8s.io/v1), "
    "or set spec.decode.groupScheduling: statefulSet",
    "DisaggregatedSet": "DisaggregatedSet (sigs.k8s.io/lws v0.10 or later, disaggregatedset.x-k8s.io/v1), "
    "or set spec.workload: Deployments",
    "InferenceObjective": "its CRD (llm-d.ai/v1alpha2 from llm-d-router; an install of the Inference Extension up to "
    "v1.5 has inference.networking.x-k8s.io/v1alpha2: set the chart value inferencePool.objectiveApiVersion)",
}
GRANTS = {
    "InferencePool": "inferencePool.enabled=true",
    "LeaderWorkerSet": "leaderWorkerSet.enabled=true",
    "InferenceObjective": "inferencePool.enabled=true",
    "DisaggregatedSet": "disaggregatedSet.enabled=true",
}


def _unavailable(want: Live, exc: KubeError) -> str:
    label = f"{want['kind']}/{want['metadata']['name']}"
    if exc.status == 404:
        return f"{label}: the cluster has no {want['apiVersion']} {want['kind']} API: install {OPTIONAL_KINDS[want['kind']]}"
    return f"{label}: the operator may not write it ({exc.message}): grant it (chart value {GRANTS[want['kind']]})"


def _ours(svc: _Service, obj: Live | None) -> bool:
    """Whether `obj` exists and is this service's to delete: it names the service among its
    owners and no other controller claims it."""
    if obj is None or drift.controller_other_than({svc.owner.uid}, obj) is not None:
        return False
    return any(ref.get("uid") == svc.owner.uid for ref in obj["metadata"].get("ownerReferences") or [])


def _pod_readiness(decode: dg.DecodeWorkload, pod: Live) -> tuple[int, bool]:
    conditions = (pod.get("status") or {}).get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    return decode.place(pod), ready
