"""Which live objects run each role under spec.workload, and what a change of it removes. Pure.

- `role_live`: the object whose status counts a role: the prefill Deployment and the decode
  workload, or under a DisaggregatedSet its `status.roleStatuses` entry (disaggregated_set.py).
- `replaced`: after spec.workload (or decode.groupScheduling) changed, what ran the roles before
  goes, once what the spec asks for exists (never leave the service without prefill or decode).
  The status records the kind that ran decode (`status.decode.workloadKind`); only that kind is
  looked for, so no API the cluster may lack is read. The router never changes. A switch between
  a decode StatefulSet and a LeaderWorkerSet keeps the prefill Deployment and its pods; a switch
  to or from a DisaggregatedSet recreates both roles' pods, because the DisaggregatedSet's
  controller makes its own LeaderWorkerSets and cannot adopt a Deployment's pods.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdserve_operator import spec as s
from pdserve_operator.reconcile import decode_groups as dg
from pdserve_operator.reconcile.children.disaggregated_set import DS_KIND, ds_name, role_workload
from pdserve_operator.reconcile.children.meta import workload_name

Live = dict[str, Any]


def running_kind(spec: s.PDInferenceServiceSpec) -> str:
    """What status.decode.workloadKind records for this spec once its workload exists."""
    return DS_KIND if spec.workload == DS_KIND else dg.of("", spec).kind


def role_live(
    name: str, spec: s.PDInferenceServiceSpec, live: Mapping[tuple[str, str], Live], role: str
) -> Live | None:
    """The live object whose status counts `role` (None: not there yet)."""
    if spec.workload == DS_KIND and role in ("prefill", "decode"):
        return role_workload(live.get((DS_KIND, ds_name(name))), role)
    if role == "decode":
        return live.get(dg.of(name, spec).key)
    return live.get(("Deployment", workload_name(name, role)))


def replaced(
    name: str, spec: s.PDInferenceServiceSpec, was: str | None, live: Mapping[tuple[str, str], Live]
) -> list[tuple[str, str]]:
    """(kind, name) of the objects to remove now, after a switch from `was` (the recorded kind)."""
    now = running_kind(spec)
    if was is None or was == now:
        return []
    if now == DS_KIND:
        if (DS_KIND, ds_name(name)) not in live:
            return []  # not created (no CRD, no grant): the old workloads keep serving
        return [("Deployment", workload_name(name, "prefill")), (was, workload_name(name, "decode"))]
    decode = dg.of(name, spec)
    if decode.key not in live or ("Deployment", workload_name(name, "prefill")) not in live:
        return []
    if was == DS_KIND:
        return [(DS_KIND, ds_name(name))]
    return [(was, decode.name)]
