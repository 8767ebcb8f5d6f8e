"""Which workload runs the decode groups, and how its counts and pods map onto groups. Pure.

`spec.decode.groupScheduling` picks one of two workloads (docs/gang-scheduling.md):

- **StatefulSet** (the default): `replicas × layerShards` pods; a pod's ordinal says its place
  (`group = ordinal // shards`, `member = ordinal % shards`); a group registers as its member 0,
  the pod `NAME-decode-{group × shards}`. Its `replicas` counts pods.
- **LeaderWorkerSet** (leaderworkerset.x-k8s.io/v1): `replicas` groups of `size = layerShards`
  pods, created, scheduled, restarted (RecreateGroupOnPodRestart) and rolled as a unit. LWS
  names the leader `NAME-decode-{group}` and the workers `NAME-decode-{group}-{member}` and
  labels each pod with both indices; its `replicas` counts groups.

Everything in the operator that counts groups, names the groups a scale-down drains, or places a
pod in its group asks a `DecodeWorkload` rather than assuming one of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve_common.pod_env import ordinal_of
from pdserve_operator import spec as s
from pdserve_operator.reconcile.children.meta import LWS_GROUP_INDEX, LWS_WORKER_INDEX, workload_name
from pdserve_operator.reconcile.children.workloads import decode_kind


@dataclass(frozen=True)
class DecodeWorkload:
    kind: str  # "StatefulSet" | "LeaderWorkerSet"
    name: str
    shards: int

    @property
    def key(self) -> tuple[str, str]:
        """How the reconciler's map of live children knows it: (kind, name)."""
        return self.kind, self.name

    @property
    def per_replica(self) -> int:
        """What one of the workload's `replicas` is worth in pods of a group: a StatefulSet's
        replica is one pod (a group is `shards` of them), a LeaderWorkerSet's a whole group."""
        return self.shards if self.kind == "StatefulSet" else 1

    def groups(self, replicas: int) -> int:
        """Whole groups in a count the workload reports (spec.replicas, status.readyReplicas)."""
        return replicas // self.per_replica

    def replicas(self, groups: int) -> int:
        """The workload's `replicas` for this many groups."""
        return groups * self.per_replica

    def leader_ids(self, groups: range) -> tuple[str, ...]:
        """Worker ids (pod names) the groups register under: each group's member 0."""
        if self.kind == "StatefulSet":
            return tuple(f"{self.name}-{g * self.shards}" for g in groups)
        return tuple(f"{self.name}-{g}" for g in groups)

    def runs(self, pod: dict[str, Any]) -> bool:
        """Whether this workload runs the pod: during a switch of groupScheduling the pods of
        the other kind still match the decode selector until they are gone."""
        lws = LWS_GROUP_INDEX in ((pod.get("metadata") or {}).get("labels") or {})
        return lws == (self.kind == "LeaderWorkerSet")

    def place(self, pod: dict[str, Any]) -> int:
        """A pod's place in the groups as a StatefulSet ordinal would say it (group × shards +
        member), so one rule (`status.ready_groups`) counts complete groups of either kind."""
        meta = pod.get("metadata") or {}
        if self.kind == "StatefulSet":
            return ordinal_of(meta["name"])
        lbl = meta.get("labels") or {}
        try:
            return int(lbl[LWS_GROUP_INDEX]) * self.shards + int(lbl[LWS_WORKER_INDEX])
        except (KeyError, ValueError) as exc:
            raise ValueError(f"pod {meta.get('name')!r} lacks the LeaderWorkerSet index labels: {exc}") from exc


def of(name: str, spec: s.PDInferenceServiceSpec) -> DecodeWorkload:
    """The decode workload of service `name` as its spec asks for it."""
    return DecodeWorkload(decode_kind(spec)[1], workload_name(name, "decode"), spec.decode.layer_shards)
