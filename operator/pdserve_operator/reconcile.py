"""One reconcile of one PDInferenceService: read it, apply its children, write its status.

Everything the kopf handlers trigger funnels into `Reconciler.reconcile(namespace, name)`:
creation, spec updates, resumption after a restart, a child edited or deleted by hand, a child
whose readiness changed, and the periodic resync that refreshes broker counts. The work is
idempotent (get → create if missing → merge-patch only what drifted → status only if it
changed), so running it too often costs reads, never writes.

Requests for the same service are coalesced: while one reconcile runs, any number of further
requests collapse into a single follow-up run, which then sees everything that happened
meanwhile. Under a burst of child events (ten children created → ten ADDED events) this keeps
the API traffic proportional to services, not to events.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdserve_worker.logs import kv

from pdserve_operator import children as ch
from pdserve_operator import drift
from pdserve_operator import spec as s
from pdserve_operator import status as st
from pdserve_operator.broker_view import BrokerView
from pdserve_operator.kube import KINDS, PDIS, KubeClient, KubeError

log = logging.getLogger("pdserve.operator.reconcile")


class EventSink(Protocol):
    def __call__(self, obj: dict[str, Any], type_: str, reason: str, message: str) -> None: ...


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def new_token() -> str:
    return secrets.token_urlsafe(32)


@dataclass
class Outcome:
    """What one reconcile did (for logs, events and tests)."""

    created: list[str] = field(default_factory=list)
    patched: list[str] = field(default_factory=list)
    status_written: bool = False
    phase: str = ""


@dataclass
class _Slot:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    waiting: bool = False


class Reconciler:
    def __init__(
        self,
        kube: KubeClient,
        broker: BrokerView,
        defaults: ch.Defaults,
        events: EventSink,
        clock: Callable[[], str] = utc_now,
        token_factory: Callable[[], str] = new_token,
    ) -> None:
        self.kube = kube
        self.broker = broker
        self.defaults = defaults
        self.events = events
        self.clock = clock
        self.token_factory = token_factory
        self._slots: dict[tuple[str, str], _Slot] = {}

    async def request(self, namespace: str, name: str, why: str) -> Outcome | None:
        """Reconcile soon; returns None when an already queued run will cover this request."""
        slot = self._slots.setdefault((namespace, name), _Slot())
        if slot.waiting:
            return None
        slot.waiting = True
        async with slot.lock:
            slot.waiting = False
            return await self.reconcile(namespace, name, why)

    def forget(self, namespace: str, name: str) -> None:
        self._slots.pop((namespace, name), None)

    async def reconcile(self, namespace: str, name: str, why: str) -> Outcome | None:
        call = asyncio.to_thread
        body = await call(self.kube.get, PDIS, namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return None  # gone or going: ownerReferences let the garbage collector take the children
        meta = body["metadata"]
        owner = ch.Owner(name=name, namespace=namespace, uid=meta["uid"])
        generation = int(meta.get("generation") or 1)
        prev = st.previous(body.get("status"))
        outcome = Outcome()
        try:
            spec = s.parse_spec(body.get("spec"))
            if len(name) > s.MAX_NAME_LENGTH:
                raise ValueError(f"metadata.name {name!r} is longer than {s.MAX_NAME_LENGTH} characters")
        except (s.ValidationError, ValueError) as exc:
            reason = s.describe(exc) if isinstance(exc, s.ValidationError) else str(exc)
            new = st.invalid(owner, generation, reason, prev, self.clock())
            await self._write_status(body, prev, new, outcome)
            log.warning(kv(event="spec_invalid", service=owner.key, reason=reason))
            return outcome

        secret_live = await call(self.kube.get, KINDS["Secret"], namespace, ch.secret_name(name))
        token = ch.token_of(secret_live) or self.token_factory()
        self.broker.set_service_token(owner.key, token)

        spec_unchanged = prev is not None and prev.observed_generation == generation
        live: dict[tuple[str, str], dict[str, Any] | None] = {}
        conflicts: list[str] = []
        for desired in ch.render(owner, spec, token, self.defaults):
            kind = KINDS[desired["kind"]]
            cname = desired["metadata"]["name"]
            label = f"{desired['kind']}/{cname}"
            current = secret_live if desired["kind"] == "Secret" else await call(self.kube.get, kind, namespace, cname)
            if current is None:
                try:
                    current = await call(self.kube.create, desired)
                    outcome.created.append(label)
                except KubeError as exc:
                    if exc.status != 409:
                        raise
                    current = await call(self.kube.get, kind, namespace, cname)
            elif (foreign := drift.foreign_controller(desired, current)) is not None:
                conflicts.append(label)
                log.warning(kv(event="child_conflict", service=owner.key, child=label, controller=foreign))
            elif paths := drift.content_drift(desired, current):
                current = await call(self.kube.merge_patch, kind, namespace, cname, drift.merge_patch(desired))
                outcome.patched.append(label)
                if spec_unchanged:
                    # The spec did not move since the last reconcile: someone else changed the child.
                    self.events(body, "Warning", "DriftReverted", f"{label}: reverted {', '.join(paths[:5])}")
                log.info(kv(event="child_patched", service=owner.key, child=label, fields=",".join(paths[:8])))
            live[(desired["kind"], cname)] = current
        if outcome.created:
            log.info(kv(event="children_created", service=owner.key, children=",".join(outcome.created)))

        decode_pods = None
        if spec.decode.layer_shards > 1:
            pods = await call(self.kube.list, KINDS["Pod"], namespace, ch.selector_string(name, "decode"))
            decode_pods = tuple(_pod_readiness(p) for p in pods)
        observed = st.Observed(
            prefill=live.get(("Deployment", ch.workload_name(name, "prefill"))),
            decode=live.get(("StatefulSet", ch.workload_name(name, "decode"))),
            router=live.get(("Deployment", ch.workload_name(name, "router"))),
            decode_pods=decode_pods,
            registered=self.broker.registered_counts(owner.key),
            slots_used=self.broker.slots_in_use(owner.key),
            conflicts=tuple(conflicts),
        )
        new = st.compute(owner, spec, generation, observed, prev, self.clock())
        await self._write_status(body, prev, new, outcome)
        log.debug(kv(event="reconciled", service=owner.key, why=why, phase=new.phase))
        return outcome

    async def _write_status(
        self,
        body: dict[str, Any],
        prev: s.PDInferenceServiceStatus | None,
        new: s.PDInferenceServiceStatus,
        outcome: Outcome,
    ) -> None:
        outcome.phase = new.phase
        if prev is not None and prev.wire() == new.wire():
            return
        meta = body["metadata"]
        # A merge patch: nulls remove what the new status no longer reports; lists are replaced.
        patch = {"status": new.model_dump(mode="json", by_alias=True)}
        await asyncio.to_thread(self.kube.merge_patch, PDIS, meta["namespace"], meta["name"], patch, "status")
        outcome.status_written = True
        event = st.transition_event(prev, new)
        if event is not None:
            self.events(body, *event)


def _pod_readiness(pod: dict[str, Any]) -> tuple[int, bool]:
    from pdserve_worker.pod_env import ordinal_of

    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in (pod.get("status") or {}).get("conditions") or []
    )
    return ordinal_of(pod["metadata"]["name"]), ready
