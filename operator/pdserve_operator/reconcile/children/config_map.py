"""The ConfigMap: the spec as pods read it, and the hash that rolls pods when it changes."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pdserve_operator import spec as s
from pdserve_operator.reconcile.children.meta import ROLES, Owner, config_name, object_meta

ANNOTATION_SPEC_HASH = "pdserve.dev/config-hash"


CONFIG_KEY = "service.json"


CONFIG_DIR = "/etc/pdserve"


def service_config(spec: s.PDInferenceServiceSpec) -> dict[str, Any]:
    """What pods read from the ConfigMap: the spec without replica counts, autoscaling, workload.


    Both are left out so that scaling does not change the config hash and roll every pod of
    every role.
    """
    wire = spec.wire()
    for role in ROLES:
        wire.get(role, {}).pop("replicas", None)
    wire.pop("autoscaling", None)  # who scales a role is no pod's business: changing it rolls nothing
    # Nor what object runs the pods (a switch keeps the router's), nor the gateway's objectives.
    wire.pop("workload", None)
    wire.pop("disaggregatedSet", None)
    wire.get("router", {}).get("inferencePool", {}).pop("objectives", None)
    return wire


def config_hash(spec: s.PDInferenceServiceSpec) -> str:
    blob = json.dumps(service_config(spec), sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def config_map(owner: Owner, spec: s.PDInferenceServiceSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_meta(owner, config_name(owner.name)),
        "data": {CONFIG_KEY: json.dumps(service_config(spec), sort_keys=True, indent=2)},
    }
