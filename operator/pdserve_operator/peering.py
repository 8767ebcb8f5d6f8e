"""Is the kopf peering object this operator needs there? What to tell the user when it is not.

kopf (read at nolar/kopf 60d02aefb11c98cda6afab483f7953f6bb2ab9d6) with mandatory peering
pauses every handler while the peering CRD is absent (`orchestration.adjust_tasks` turns the
toggle "peering CRD is missing" on) and, when the CRD exists but the object does not, starts
paused ("preactivated" conflicts toggle in `spawn_missing_peerings`) until an event of that object
arrives, which never happens; its keep-alive PATCH gets a 404 and logs it at debug level only
(`peering.touch`). Either way the operator reconciles nothing and says nothing. This module finds
out which of the two it is (API discovery, which every authenticated user may read, then a list
of the objects by name) and words the message: what is missing, and the command that creates it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pdserve_operator.kube import KubeError, RestKubeClient

GROUP, VERSION = "kopf.dev", "v1"
CRD_MANIFEST = "manifests/kopf-peering.yaml"


@dataclass(frozen=True)
class PeeringObject:
    """One peering object kopf needs: ClusterKopfPeering for all namespaces, else a KopfPeering
    in each watched namespace (kopf's guess_selectors: clusterwide vs namespaced)."""

    name: str
    namespace: str | None

    @property
    def kind(self) -> str:
        return "KopfPeering" if self.namespace else "ClusterKopfPeering"

    @property
    def plural(self) -> str:
        return "kopfpeerings" if self.namespace else "clusterkopfpeerings"

    @property
    def crd(self) -> str:
        return f"{self.plural}.{GROUP}"

    @property
    def collection(self) -> str:
        where = f"/namespaces/{self.namespace}" if self.namespace else ""
        return f"/apis/{GROUP}/{VERSION}{where}/{self.plural}"

    def __str__(self) -> str:
        return f"{self.kind} {self.namespace}/{self.name}" if self.namespace else f"{self.kind} {self.name}"

    def manifest(self) -> str:
        meta = {"name": self.name, **({"namespace": self.namespace} if self.namespace else {})}
        return json.dumps(
            {"apiVersion": f"{GROUP}/{VERSION}", "kind": self.kind, "metadata": meta}, separators=(",", ":")
        )

    def create_command(self) -> str:
        return f"echo '{self.manifest()}' | kubectl create -f -"


@dataclass(frozen=True)
class Missing:
    """What is missing for one peering object, and the command that fixes it."""

    obj: PeeringObject
    crd_missing: bool

    @property
    def what(self) -> str:
        return f"CRD {self.obj.crd}" if self.crd_missing else str(self.obj)

    @property
    def fix(self) -> str:
        create = self.obj.create_command()
        return f"kubectl apply -f {CRD_MANIFEST} && {create}" if self.crd_missing else create


def peering_objects(name: str, namespaces: list[str]) -> list[PeeringObject]:
    if not namespaces:
        return [PeeringObject(name, None)]
    return [PeeringObject(name, ns) for ns in namespaces]


def served_plurals(kube: RestKubeClient) -> set[str]:
    """The kopf.dev/v1 resources the API serves (empty when the group is unknown)."""
    try:
        doc = kube.request("GET", f"/apis/{GROUP}/{VERSION}")
    except KubeError as exc:
        if exc.status == 404:
            return set()
        raise
    return {r.get("name", "") for r in doc.get("resources") or []}


def find_missing(kube: RestKubeClient, objects: list[PeeringObject]) -> list[Missing]:
    """Which peering objects (or their CRDs) are absent. API errors other than 404 propagate."""
    plurals = served_plurals(kube)
    missing = []
    for obj in objects:
        if obj.plural not in plurals:
            missing.append(Missing(obj, crd_missing=True))
            continue
        # A list by name, not a GET: kopf itself lists and watches these, so the chart's RBAC
        # grants list (and nothing more is needed for this check).
        found = kube.request("GET", obj.collection, query={"fieldSelector": f"metadata.name={obj.name}"})
        if not found.get("items"):
            missing.append(Missing(obj, crd_missing=False))
    return missing
