"""Spec models → the PDInferenceService CustomResourceDefinition.

Pydantic emits JSON Schema 2020-12; Kubernetes wants a *structural* OpenAPI v3.0 schema. The
translation here is mechanical and total: `$ref`s are inlined, `Optional[X]` becomes "X, not
required", `additionalProperties: false` (from `extra="forbid"`) is dropped because the API
server prunes unknown fields instead, numeric exclusive bounds become OpenAPI 3.0 booleans, and
object defaults collapse to `{}` so that the API server fills nested defaults one level at a
time (a dumped default object would freeze today's nested defaults into the schema).
`manifests/crd.yaml` is the output of `pdserve crd`; a test keeps the two equal.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from pdserve_operator import spec as s
from pdserve_operator.spec import scaling_adapter as sa

# Keys pydantic emits that OpenAPI v3.0 in a CRD either lacks or that only add noise.
_DROP_KEYS = {"title", "$defs", "const", "examples"}

# Fields whose list items are keyed: lets server-side apply and strategic merges address them.
_LIST_MAP_KEYS: dict[str, str] = {"conditions": "type", "env": "name"}


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    """Resolve `$ref`s against `defs`, merging sibling keys (the field's own description wins)."""
    if isinstance(node, list):
        return [_inline(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**copy.deepcopy(target), **{k: v for k, v in node.items() if k != "$ref"}}
        return _inline(merged, defs)
    return {k: _inline(v, defs) for k, v in node.items()}


def _has_defaults(node: dict[str, Any]) -> bool:
    """An object some of whose (nested) fields declare defaults: worth defaulting to {}."""
    if node.get("type") != "object" or "properties" not in node:
        return False
    return any("default" in p or _has_defaults(p) for p in node["properties"].values())


def _structural(node: dict[str, Any], name: str = "") -> dict[str, Any]:
    """Rewrite one inlined pydantic schema node (and its children) into a structural one."""
    node = dict(node)
    # Optional[X]: pydantic writes anyOf [X, null]; Kubernetes prunes nulls of non-nullable fields,
    # so the field becomes X and simply not required.
    any_of = node.get("anyOf")
    if any_of and not node.get("x-kubernetes-int-or-string"):
        non_null = [b for b in any_of if b.get("type") != "null"]
        if len(non_null) == 1 and len(non_null) < len(any_of):
            del node["anyOf"]
            node = {**non_null[0], **node}
            if node.get("default", 0) is None:
                del node["default"]
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP_KEYS:
            continue
        if key == "additionalProperties" and value is False:
            continue
        if key == "exclusiveMinimum" and not isinstance(value, bool):
            out["minimum"], out["exclusiveMinimum"] = value, True
            continue
        if key == "exclusiveMaximum" and not isinstance(value, bool):
            out["maximum"], out["exclusiveMaximum"] = value, True
            continue
        if key == "properties":
            out["properties"] = {k: _structural(v, k) for k, v in value.items()}
            for k, sub in out["properties"].items():
                # default_factory leaves no default in pydantic's schema; an absent nested object
                # must still default to {} so the API server fills its fields' defaults.
                optional = value[k].get("default", 0) is None  # `X | None = None`: absent stays absent
                if _has_defaults(sub) and k not in node.get("required", []) and not optional:
                    sub.setdefault("default", {})
        elif key == "items":
            out["items"] = _structural(value)
        elif key == "additionalProperties" and isinstance(value, dict):
            out["additionalProperties"] = _structural(value)
        else:
            out[key] = copy.deepcopy(value)
    if "default" in out:
        if out.get("type") == "object" and "properties" in out:
            out["default"] = {}  # let the API server apply the nested defaults itself
        elif out.get("type") in ("object", "array"):
            del out["default"]  # empty maps/lists: absent means empty; no noise in stored objects
    if out.get("type") == "array" and name in _LIST_MAP_KEYS:
        out["x-kubernetes-list-type"] = "map"
        out["x-kubernetes-list-map-keys"] = [_LIST_MAP_KEYS[name]]
    if "type" in out or "description" in out:  # readable YAML: what a node is comes first
        head: dict[str, Any] = {k: out[k] for k in ("type", "description") if k in out}
        out = {**head, **{k: v for k, v in out.items() if k not in head}}
    if out.get("type") == "object" and "properties" in out and out.get("required") is not None:
        out["required"] = [r for r in out["required"] if r in out["properties"]]
        if not out["required"]:
            del out["required"]
    return out


def _defaulted(value: Any, node: dict[str, Any]) -> Any:
    """`value` with the defaults of `node`'s fields filled in, top-down: what the API server
    stores where the field was absent (apiextensions-apiserver defaulting/algorithm.go)."""
    if not isinstance(value, dict):
        return value
    out = dict(value)
    for name, prop in (node.get("properties") or {}).items():
        if name not in out and "default" in prop:
            out[name] = copy.deepcopy(prop["default"])
        if name in out:
            out[name] = _defaulted(out[name], prop)
    return out


def _spell_out_ruled_defaults(node: dict[str, Any]) -> None:
    """An object default of `{}` on a node with CEL rules is written out in full.

    The API server checks each default against its node's rules as written, without applying the
    nested defaults first (ValidateDefaults in defaulting/validation.go), so `{}` fails any rule
    that reads a field (`no such key: type`) and the whole CRD is refused. The spelled-out default
    is exactly what the API server would have stored for an absent field anyway.
    """
    for sub in (node.get("properties") or {}).values():
        _spell_out_ruled_defaults(sub)
    if isinstance(node.get("items"), dict):
        _spell_out_ruled_defaults(node["items"])
    if node.get("x-kubernetes-validations") and node.get("default") == {}:
        node["default"] = _defaulted({}, node)


def model_schema(model: type[s.Model]) -> dict[str, Any]:
    """The structural OpenAPI schema of one model (with its CEL rules)."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.get("$defs", {})
    return _structural(_inline(raw, defs))


def openapi_schema() -> dict[str, Any]:
    spec = model_schema(s.PDInferenceServiceSpec)
    spec["default"] = {}
    _spell_out_ruled_defaults(spec)
    status = model_schema(s.PDInferenceServiceStatus)
    return {
        "type": "object",
        "description": (
            "PDInferenceService runs a prefill/decode disaggregated LLM service: prefill pods push "
            "KV into decode pods' slots; routers serve the OpenAI API."
        ),
        "properties": {
            "apiVersion": {"type": "string", "description": "API version of this object (pdserve.dev/v1alpha1)."},
            "kind": {"type": "string", "description": "Kind of this object (PDInferenceService)."},
            # Exactly {type: object}: at the root the API server allows nothing else here but
            # restrictions on name/generateName (not even a description), see
            # validateStructuralMetadataInvariants in apiextensions-apiserver.
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
        "x-kubernetes-validations": [
            {
                "rule": f"size(self.metadata.name) <= {s.MAX_NAME_LENGTH}",
                "message": f"metadata.name must be at most {s.MAX_NAME_LENGTH} characters (children append suffixes)",
            }
        ],
    }


PRINTER_COLUMNS: list[dict[str, Any]] = [
    {
        "name": "Prefill",
        "type": "string",
        "jsonPath": ".status.prefill.summary",
        "description": "Ready/desired prefill pods.",
    },
    {
        "name": "Decode",
        "type": "string",
        "jsonPath": ".status.decode.summary",
        "description": "Ready/desired decode groups.",
    },
    {
        "name": "Slots",
        "type": "string",
        "jsonPath": ".status.slots.summary",
        "description": "Used/total request slots.",
    },
    {"name": "KV", "type": "string", "jsonPath": ".status.kvTokens.summary", "description": "Used/total KV tokens."},
    {
        "name": "Scale",
        "type": "string",
        "jsonPath": ".status.autoscaling.summary",
        "description": "Autoscaled roles: current[->desired] replicas (P: prefill, D: decode groups).",
    },
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "description": "Lifecycle phase."},
    {
        "name": "Endpoint",
        "type": "string",
        "jsonPath": ".status.endpoint",
        "priority": 1,
        "description": "OpenAI API URL.",
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]

SCALE = {
    "specReplicasPath": ".spec.decode.replicas",
    "statusReplicasPath": ".status.decode.replicas",
    "labelSelectorPath": ".status.decode.selector",
}


def _crd(names: dict[str, Any], version: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{names['plural']}.{s.GROUP}",
            "labels": {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/part-of": "pdserve"},
        },
        "spec": {
            "group": s.GROUP,
            "scope": "Namespaced",
            "names": {**names, "listKind": f"{names['kind']}List", "categories": ["pdserve"]},
            "versions": [{"name": s.VERSION, "served": True, "storage": True, **version}],
        },
    }


def build_crd() -> dict[str, Any]:
    """The PDInferenceService CustomResourceDefinition (a plain dict, ready for YAML or the API)."""
    names = {"kind": s.KIND, "plural": s.PLURAL, "singular": s.SINGULAR, "shortNames": list(s.SHORT_NAMES)}
    return _crd(
        names,
        {
            "schema": {"openAPIV3Schema": openapi_schema()},
            "subresources": {"status": {}, "scale": dict(SCALE)},
            "additionalPrinterColumns": [dict(c) for c in PRINTER_COLUMNS],
        },
    )


def adapter_schema() -> dict[str, Any]:
    spec = model_schema(sa.ScalingAdapterSpec)
    spec["x-kubernetes-validations"] = [dict(sa.IMMUTABLE_TARGET)]
    return {
        "type": "object",
        "description": (
            "PDScalingAdapter is one role's scale target (kubectl scale, an HPA, KEDA): its replicas are "
            "the PDInferenceService's spec.<role>.replicas."
        ),
        "properties": {
            "apiVersion": {"type": "string", "description": "API version of this object (pdserve.dev/v1alpha1)."},
            "kind": {"type": "string", "description": "Kind of this object (PDScalingAdapter)."},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": model_schema(sa.ScalingAdapterStatus),
        },
        "required": ["spec"],
    }


ADAPTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Service", "type": "string", "jsonPath": ".spec.serviceName", "description": "The PDInferenceService."},
    {"name": "Role", "type": "string", "jsonPath": ".spec.role", "description": "prefill or decode."},
    {"name": "Desired", "type": "integer", "jsonPath": ".spec.replicas", "description": "Replicas asked for."},
    {"name": "Current", "type": "integer", "jsonPath": ".status.replicas", "description": "Replicas now."},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def build_adapter_crd() -> dict[str, Any]:
    """The PDScalingAdapter CustomResourceDefinition (spec/scaling_adapter.py)."""
    names = {
        "kind": sa.ADAPTER_KIND,
        "plural": sa.ADAPTER_PLURAL,
        "singular": sa.ADAPTER_SINGULAR,
        "shortNames": list(sa.ADAPTER_SHORT_NAMES),
    }
    return _crd(
        names,
        {
            "schema": {"openAPIV3Schema": adapter_schema()},
            "subresources": {"status": {}, "scale": dict(sa.ADAPTER_SCALE)},
            "additionalPrinterColumns": [dict(c) for c in ADAPTER_COLUMNS],
        },
    )


def crd_yaml() -> str:
    """`pdserve crd` output and the content of manifests/crd.yaml: both CRDs, one document each."""
    header = "# Generated by `pdserve crd` from pdserve_operator/spec/. Do not edit by hand.\n"
    return header + yaml.safe_dump_all(
        [build_crd(), build_adapter_crd()], sort_keys=False, width=100, allow_unicode=True
    )
