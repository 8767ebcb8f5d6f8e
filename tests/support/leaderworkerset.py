"""LeaderWorkerSet for tests: its upstream CRD for the API emulator, and what LWS and the kubelet
make of a rendered LeaderWorkerSet's pods (names, labels, environment).

`CRD` is the upstream file, unchanged: kubernetes-sigs/lws at 060ab4da (v0.10.0-11),
config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml (support/upstream_crds.py, the
copy in tests/upstream_crds/). It types the full pod templates; what LWS's validating webhook
refuses (a size below 1, for one) is not in it and so not checked here.
"""

from __future__ import annotations

import base64
import re
from typing import Any

from support import upstream_crds

GROUP = "leaderworkerset.x-k8s.io"
GROUP_INDEX = "leaderworkerset.sigs.k8s.io/group-index"
WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_NAME = "leaderworkerset.sigs.k8s.io/name"

API_VERSION = f"{GROUP}/v1"
CRD: dict[str, Any] = upstream_crds.crd(API_VERSION, "LeaderWorkerSet")


def pod_names(lws: str, group: int, size: int) -> list[str]:
    """LWS's pod names for one group: the leader `lws-g` (its leader StatefulSet's ordinal g),
    the workers `lws-g-1 … lws-g-(size-1)` (the group's worker StatefulSet, ordinals from 1)."""
    return [f"{lws}-{group}"] + [f"{lws}-{group}-{w}" for w in range(1, size)]


def pod_labels(lws_obj: dict[str, Any], group: int, worker: int) -> dict[str, str]:
    """The labels a pod of the group carries: the template's plus LWS's indices."""
    template = lws_obj["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    return {
        **template["metadata"]["labels"],
        LWS_NAME: lws_obj["metadata"]["name"],
        GROUP_INDEX: str(group),
        WORKER_INDEX: str(worker),
    }


_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(value: str, defined: dict[str, str]) -> str:
    """The kubelet's `$(VAR)` expansion of an env value (k8s.io/kubernetes
    third_party/forked/golang/expansion, MappingFuncFor): a variable defined earlier in the list
    is replaced, `$$` is a literal `$`, an undefined reference stays as written."""

    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return defined.get(name, m.group(0))

    return _REF.sub(one, value)


def pod_environ(
    template: dict[str, Any], pod_name: str, labels: dict[str, str], secret: dict[str, Any] | None
) -> dict[str, str]:
    """The environment the kubelet gives a pod of `template`: downward-API name, IP and labels,
    Secret keys, and `$(VAR)` references expanded in order."""
    env: dict[str, str] = {}
    for e in template["spec"]["containers"][0]["env"]:
        if "value" in e:
            env[e["name"]] = expand(e["value"], env)
            continue
        source = e.get("valueFrom", {})
        field = source.get("fieldRef", {}).get("fieldPath", "")
        if field == "metadata.name":
            env[e["name"]] = pod_name
        elif field == "status.podIP":
            env[e["name"]] = "10.0.0.1"
        elif field.startswith("metadata.labels['"):
            env[e["name"]] = labels[field[len("metadata.labels['") : -2]]
        elif "secretKeyRef" in source and secret is not None:
            env[e["name"]] = base64.b64decode(secret["data"][source["secretKeyRef"]["key"]]).decode()
    return env
