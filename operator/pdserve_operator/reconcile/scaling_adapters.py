"""Each role's PDScalingAdapter and the service's `spec.<role>.replicas`, kept equal.

Two objects hold one number, so each reconcile decides which one moved (`decide`, pure): an
adapter scaled since the operator last took its value (generation ahead of observedGeneration)
→ the service's spec takes it; otherwise the spec moved → the adapter takes it (a patch with
its resourceVersion, so a racing scale wins next time); a value the service refuses → a
`ScaleRefused` Warning and the adapter goes back. A role driven `external` gets an
`AdapterIgnored` Warning. Status (what an HPA reads through /scale): `replicas` is the role's
current count (prefill pods, decode groups), `selector` its pods. Adapters another controller
owns are left alone; without the CRD the operator serves on without adapters and looks again
every CRD_RECHECK_S. The rules in detail: docs/operator.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pdserve_common.logs import kv
from pdserve_operator import events as ev
from pdserve_operator import spec as s
from pdserve_operator.kube import KINDS, PDIS, KubeClient, KubeError
from pdserve_operator.reconcile import decode_groups as dg
from pdserve_operator.reconcile import drift
from pdserve_operator.reconcile import workload_kinds as wk
from pdserve_operator.reconcile.children.autoscaling import scaling_adapter
from pdserve_operator.reconcile.children.meta import Owner, adapter_name, selector_string
from pdserve_operator.spec.scaling_adapter import ADAPTER_KIND, ADAPTER_ROLES

log = logging.getLogger(__name__)

Live = dict[str, Any]
EventFn = Callable[[ev.EventType, str, str], Awaitable[None]]
ADAPTER = KINDS[ADAPTER_KIND]
SCALE_REFUSED = "ScaleRefused"
ADAPTER_IGNORED = "AdapterIgnored"


class _NoCRD(Exception):
    """The PDScalingAdapter CRD is not installed (the API has no such resource)."""


@dataclass(frozen=True)
class Decision:
    to_service: int | None = None  # the adapter was scaled: the service's spec.<role>.replicas takes this
    to_adapter: int | None = None  # the service's spec moved: the adapter's spec.replicas takes this


def decide(adapter: Live, service_replicas: int) -> Decision:
    """Which of the two moved since the last sync (module docstring)."""
    wanted = int(adapter["spec"]["replicas"])
    if wanted == service_replicas:
        return Decision()
    generation = int(adapter["metadata"].get("generation") or 0)
    observed = int((adapter.get("status") or {}).get("observedGeneration") or 0)
    if observed and generation > observed:
        return Decision(to_service=wanted)
    return Decision(to_adapter=service_replicas)


def role_replicas(spec: s.PDInferenceServiceSpec, role: str) -> int:
    return int(getattr(spec, role).replicas)


def current_replicas(spec: s.PDInferenceServiceSpec, role: str, live: Mapping[tuple[str, str], Live], name: str) -> int:
    """The role's count now, from its workload's status (decode: whole groups)."""
    workload = wk.role_live(name, spec, live, role) or {}
    replicas = int((workload.get("status") or {}).get("replicas") or 0)
    return replicas if role == "prefill" else dg.of(name, spec).groups(replicas)


def status_of(adapter: Live, replicas: int, selector: str) -> dict[str, Any]:
    return {
        "replicas": replicas,
        "selector": selector,
        "observedGeneration": int(adapter["metadata"].get("generation") or 0),
    }


CRD_RECHECK_S = 300.0  # how often a service without the adapter CRD looks for it again


class ScalingAdapters:
    """The adapters' side of a reconcile: `sync` before the children, `report` after."""

    def __init__(self, kube: KubeClient, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.kube = kube
        self.monotonic = monotonic
        # Services whose adapters could not be made because the CRD is not installed, and when
        # to look again: without it every reconcile paid a GET and a failed CREATE.
        self._missing: dict[str, float] = {}

    async def sync(
        self, body: Live, owner: Owner, spec: s.PDInferenceServiceSpec, post: EventFn
    ) -> tuple[Live, dict[str, Live]]:
        """The service as it is after the sync (patched when an adapter won) and each role's adapter."""
        adapters: dict[str, Live] = {}
        if self.monotonic() < self._missing.get(owner.key, 0.0):
            return body, {}
        for role in ADAPTER_ROLES:
            name = adapter_name(owner.name, role)
            adapter = await asyncio.to_thread(self.kube.get, ADAPTER, owner.namespace, name)
            if adapter is None:
                try:
                    created = await self._create(owner, role, role_replicas(spec, role))
                except _NoCRD:
                    return body, {}
                if created is not None:
                    adapters[role] = created
                continue
            if drift.controller_other_than({owner.uid}, adapter) is not None:
                log.warning(kv(event="adapter_foreign", service=owner.key, adapter=name))
                continue
            decision = decide(adapter, role_replicas(spec, role))
            if decision.to_service is not None:
                await _warn_if_external(spec, role, adapter, post)
                current = role_replicas(spec, role)
                body, adapter = await self._to_service(body, owner, role, adapter, (decision.to_service, current), post)
            elif decision.to_adapter is not None:
                adapter = await self._to_adapter(owner, adapter, decision.to_adapter)
            adapters[role] = adapter
        return body, adapters

    async def _create(self, owner: Owner, role: str, replicas: int) -> Live | None:
        """The new adapter; None when it was made since our get (the next reconcile syncs it)."""
        try:
            created = await asyncio.to_thread(self.kube.create, scaling_adapter(owner, role, replicas))
            self._missing.pop(owner.key, None)
            return created
        except KubeError as exc:
            if exc.status == 409:
                return None
            if exc.status != 404:
                raise
        told = owner.key in self._missing
        self._missing[owner.key] = self.monotonic() + CRD_RECHECK_S
        if not told:
            log.warning(
                kv(
                    event="adapter_crd_missing",
                    service=owner.key,
                    crd="pdscalingadapters.pdserve.dev",
                    fix="kubectl apply -f manifests/crd.yaml",
                )
            )
        raise _NoCRD

    async def _to_service(
        self, body: Live, owner: Owner, role: str, adapter: Live, values: tuple[int, int], post: EventFn
    ) -> tuple[Live, Live]:
        """`values`: (the adapter's replicas, the service's now); a refusal puts the adapter back at the latter."""
        replicas, current = values
        patch = {"spec": {role: {"replicas": replicas}}}
        try:
            body = await asyncio.to_thread(self.kube.merge_patch, PDIS, owner.namespace, owner.name, patch)
        except KubeError as exc:
            if exc.status != 422:
                raise
            label = f"{ADAPTER_KIND}/{adapter['metadata']['name']}"
            await post(ev.WARNING, SCALE_REFUSED, f"{label}: replicas {replicas} refused: {exc.message}")
            log.warning(kv(event="adapter_scale_refused", service=owner.key, role=role, replicas=replicas))
            reverted = await self._to_adapter(owner, adapter, current)
            return body, reverted
        log.info(kv(event="adapter_scaled_service", service=owner.key, role=role, replicas=replicas))
        return body, adapter

    async def _to_adapter(self, owner: Owner, adapter: Live, replicas: int) -> Live:
        meta = adapter["metadata"]
        patch = {"metadata": {"resourceVersion": meta["resourceVersion"]}, "spec": {"replicas": replicas}}
        try:
            return await asyncio.to_thread(self.kube.merge_patch, ADAPTER, owner.namespace, meta["name"], patch)
        except KubeError as exc:
            if exc.status != 409:
                raise
            log.info(kv(event="adapter_scaled_meanwhile", service=owner.key, adapter=meta["name"]))
            return adapter  # its new scale wins at the next reconcile (the watch brings one)

    async def report(
        self,
        owner: Owner,
        spec: s.PDInferenceServiceSpec,
        adapters: Mapping[str, Live],
        live: Mapping[tuple[str, str], Live],
    ) -> None:
        """Write each adapter's status: current count, selector, the generation taken."""
        for role, adapter in adapters.items():
            current = current_replicas(spec, role, live, owner.name)
            want = status_of(adapter, current, selector_string(owner.name, role))
            if {k: (adapter.get("status") or {}).get(k) for k in want} == want:
                continue
            name = adapter["metadata"]["name"]
            await asyncio.to_thread(self.kube.merge_patch, ADAPTER, owner.namespace, name, {"status": want}, "status")


async def _warn_if_external(spec: s.PDInferenceServiceSpec, role: str, adapter: Live, post: EventFn) -> None:
    """With driver external another controller owns the workload's replicas: the value an
    adapter gives the spec is then only the count at creation. Said, not silently dropped."""
    a = spec.autoscaling
    if a is None or not getattr(a, role).enabled or getattr(a, role).driver != "external":
        return
    await post(
        ev.WARNING,
        ADAPTER_IGNORED,
        f"{ADAPTER_KIND}/{adapter['metadata']['name']}: {role}'s replicas belong to an external autoscaler "
        f"(autoscaling.{role}.driver external), so this scale changes nothing running: scale the workload "
        f"itself, or turn autoscaling.{role} off to drive the role through this adapter",
    )
