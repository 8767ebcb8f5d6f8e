"""Is a CRD schema *structural*? The rules of the Kubernetes documentation, checked in Python.

https://kubernetes.io/docs/tasks/extend-kubernetes/custom-resources/custom-resource-definitions/#specifying-a-structural-schema
No packaged tool checks this (FACTS.md), so the rules are written out here; the emulator refuses
a CRD that breaks them (as the API server does), and the CRD test runs them on our own CRD.

1. Every node has a non-empty `type`, except where `x-kubernetes-int-or-string: true` or
   `x-kubernetes-preserve-unknown-fields: true` stand in for it.
2. A field or item named inside allOf/anyOf/oneOf/not is also specified outside them.
3. No description, type, default, additionalProperties or nullable inside allOf/anyOf/oneOf/not
   (except the two int-or-string patterns).
4. Under `metadata`, only restrictions on name and generateName.
Plus the API server's own refusals for v1 CRDs: no `$ref`, `definitions`, `dependencies`,
`patternProperties`, `additionalItems`, `uniqueItems: true`, `additionalProperties: false`,
`properties` together with `additionalProperties`, and list-map keys that are required or
defaulted scalars.
"""

from __future__ import annotations

from typing import Any

_JUNCTORS = ("allOf", "anyOf", "oneOf", "not")
_FORBIDDEN = ("$ref", "definitions", "dependencies", "patternProperties", "additionalItems", "id", "$schema")
_NOT_IN_JUNCTOR = ("description", "type", "default", "additionalProperties", "nullable")
_ALLOWED = {
    "description", "type", "format", "title", "default", "maximum", "exclusiveMaximum", "minimum",
    "exclusiveMinimum", "maxLength", "minLength", "pattern", "maxItems", "minItems", "uniqueItems",
    "multipleOf", "enum", "maxProperties", "minProperties", "required", "items", "allOf", "oneOf",
    "anyOf", "not", "properties", "additionalProperties", "externalDocs", "example", "nullable",
}
_INT_OR_STRING = ([{"type": "integer"}, {"type": "string"}],)


def _junctor_branches(node: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for key in _JUNCTORS:
        value = node.get(key)
        if isinstance(value, list):
            out += [(key, v) for v in value if isinstance(v, dict)]
        elif isinstance(value, dict):
            out.append((key, value))
    return out


def _check_junctor_branch(branch: dict[str, Any], outer: dict[str, Any], path: str, errors: list[str]) -> None:
    int_or_string = outer.get("x-kubernetes-int-or-string") is True
    for key in _NOT_IN_JUNCTOR:
        if key in branch and not (int_or_string and key == "type"):
            errors.append(f"{path}: {key} must not be set inside allOf/anyOf/oneOf/not")
    for name in (branch.get("properties") or {}):
        if name not in (outer.get("properties") or {}):
            errors.append(f"{path}.{name}: field named in a junctor is not specified outside it")
    if "items" in branch and "items" not in outer:
        errors.append(f"{path}[]: items named in a junctor are not specified outside it")
    for _, sub in _junctor_branches(branch):
        _check_junctor_branch(sub, outer, path, errors)


def structural_errors(node: Any, path: str = "", root: bool = True) -> list[str]:
    """Every violation, as 'path: what' (an empty list means the schema is structural)."""
    errors: list[str] = []
    if not isinstance(node, dict):
        return [f"{path or '<root>'}: schema node must be an object, got {type(node).__name__}"]
    where = path or "<root>"
    for key in node:
        if key in _FORBIDDEN:
            errors.append(f"{where}: {key} is not allowed in a CRD schema")
        elif key not in _ALLOWED and not key.startswith("x-kubernetes-"):
            errors.append(f"{where}: unknown schema keyword {key!r}")
    escape = node.get("x-kubernetes-int-or-string") is True or node.get("x-kubernetes-preserve-unknown-fields") is True
    type_ = node.get("type")
    if not type_ and not escape:
        errors.append(f"{where}: type must be set")
    if type_ and type_ not in ("object", "array", "string", "integer", "number", "boolean"):
        errors.append(f"{where}: unknown type {type_!r}")
    if node.get("x-kubernetes-int-or-string") is True and type_:
        errors.append(f"{where}: type must be empty with x-kubernetes-int-or-string")
    if node.get("uniqueItems") is True:
        errors.append(f"{where}: uniqueItems cannot be true")
    if node.get("additionalProperties") is False:
        errors.append(f"{where}: additionalProperties cannot be false")
    if "additionalProperties" in node and "properties" in node:
        errors.append(f"{where}: additionalProperties and properties are mutually exclusive")
    if "items" in node and not isinstance(node["items"], dict):
        errors.append(f"{where}: items must be a single schema")
    if type_ == "array" and "items" not in node:
        errors.append(f"{where}: arrays must specify items")
    for key, branch in _junctor_branches(node):
        _check_junctor_branch(branch, node, where, errors)
    for name, sub in (node.get("properties") or {}).items():
        sub_path = f"{path}.{name}" if path else name
        if root and name == "metadata" and isinstance(sub, dict):
            extra = set(sub) - {"type", "description", "properties"}
            if extra or set((sub.get("properties") or {})) - {"name", "generateName"}:
                errors.append(f"{sub_path}: only restrictions on metadata.name and generateName are allowed")
        errors += structural_errors(sub, sub_path, root=False)
    if isinstance(node.get("items"), dict):
        errors += structural_errors(node["items"], f"{path}[]", root=False)
    if isinstance(node.get("additionalProperties"), dict):
        errors += structural_errors(node["additionalProperties"], f"{path}{{}}", root=False)
    if node.get("x-kubernetes-list-type") == "map":
        items = node.get("items") or {}
        for key in node.get("x-kubernetes-list-map-keys") or []:
            prop = (items.get("properties") or {}).get(key)
            if prop is None:
                errors.append(f"{where}: list-map key {key!r} is not a property of the items")
            elif key not in (items.get("required") or []) and "default" not in prop:
                errors.append(f"{where}: list-map key {key!r} must be required or defaulted")
        if not node.get("x-kubernetes-list-map-keys"):
            errors.append(f"{where}: x-kubernetes-list-type map needs x-kubernetes-list-map-keys")
    return errors
