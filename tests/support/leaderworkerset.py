"""LeaderWorkerSet for tests: a CRD for the API emulator, and what LWS and the kubelet make of a
rendered LeaderWorkerSet's pods (names, labels, environment).

The CRD is a TRANSCRIPTION, not the upstream file: the upstream CRD
(sigs.k8s.io/lws config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml) could not be
fetched on this machine (no network beyond package registries, and no package ships it). It
types the fields of `LeaderWorkerSetSpec` (api/leaderworkerset/v1/leaderworkerset_types.go) that
pdserve writes, with their enums, minimums and defaults as that file declares them in its
kubebuilder markers, and keeps the pod templates open (upstream embeds the full PodTemplateSpec
schema). So it catches a misspelt field, a wrong enum value or size 0, not a bad pod template;
docs/gang-scheduling.md says the same.
"""

from __future__ import annotations

import base64
import re
from typing import Any

GROUP = "leaderworkerset.x-k8s.io"
GROUP_INDEX = "leaderworkerset.sigs.k8s.io/group-index"
WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_NAME = "leaderworkerset.sigs.k8s.io/name"

_OPEN: dict[str, Any] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
_INT_OR_STRING: dict[str, Any] = {
    "x-kubernetes-int-or-string": True,
    "anyOf": [{"type": "integer"}, {"type": "string"}],
}

_SPEC: dict[str, Any] = {
    "type": "object",
    "required": ["leaderWorkerTemplate"],
    "properties": {
        "replicas": {"type": "integer", "format": "int32", "default": 1},
        "leaderWorkerTemplate": {
            "type": "object",
            "required": ["workerTemplate"],
            "properties": {
                "leaderTemplate": _OPEN,
                "workerTemplate": _OPEN,
                "size": {"type": "integer", "format": "int32", "default": 1, "minimum": 1},
                "restartPolicy": {
                    "type": "string",
                    "default": "RecreateGroupOnPodRestart",
                    "enum": ["RecreateGroupOnPodRestart", "Default", "None"],
                },
                "subGroupPolicy": {
                    "type": "object",
                    "properties": {"subGroupSize": {"type": "integer", "format": "int32", "minimum": 1}},
                },
            },
        },
        "rolloutStrategy": {
            "type": "object",
            "properties": {
                "type": {"type": "string", "default": "RollingUpdate", "enum": ["RollingUpdate"]},
                "rollingUpdateConfiguration": {
                    "type": "object",
                    "properties": {"maxUnavailable": _INT_OR_STRING, "maxSurge": _INT_OR_STRING},
                },
            },
        },
        "startupPolicy": {"type": "string", "default": "LeaderCreated", "enum": ["LeaderCreated", "LeaderReady"]},
        "networkConfig": {
            "type": "object",
            "properties": {"subdomainPolicy": {"type": "string", "enum": ["Shared", "UniquePerReplica"]}},
        },
    },
}

_STATUS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "replicas": {"type": "integer", "format": "int32"},
        "readyReplicas": {"type": "integer", "format": "int32"},
        "updatedReplicas": {"type": "integer", "format": "int32"},
        "hpaPodSelector": {"type": "string"},
        "conditions": {"type": "array", "items": _OPEN},
    },
}

CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": f"leaderworkersets.{GROUP}"},
    "spec": {
        "group": GROUP,
        "scope": "Namespaced",
        "names": {
            "kind": "LeaderWorkerSet",
            "listKind": "LeaderWorkerSetList",
            "plural": "leaderworkersets",
            "singular": "leaderworkerset",
            "shortNames": ["lws"],
        },
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": {"type": "object", "properties": {"spec": _SPEC, "status": _STATUS}}},
                "subresources": {
                    "status": {},
                    "scale": {
                        "specReplicasPath": ".spec.replicas",
                        "statusReplicasPath": ".status.replicas",
                        "labelSelectorPath": ".status.hpaPodSelector",
                    },
                },
            }
        ],
    },
}


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
