"""What the API server does to a custom resource before storing it: prune, default, validate.

Order as in kube-apiserver: drop unknown fields (pruning) and nulls of non-nullable fields,
apply `default`s top-down (so a defaulted `{}` receives its own fields' defaults), validate
against the OpenAPI schema, then evaluate the `x-kubernetes-validations` CEL rules.
Validation uses `jsonschema`'s Draft 4 (OpenAPI 3.0's boolean exclusive bounds), CEL uses
`cel-python` (celpy). Errors come back as (field path, message) pairs for a 422 Status.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import celpy
import jsonschema

FieldError = tuple[str, str]


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def prune(data: Any, schema: dict[str, Any], root: bool = True) -> Any:
    """Remove what the schema does not declare (unless it preserves unknown fields)."""
    if isinstance(data, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        preserve = schema.get("x-kubernetes-preserve-unknown-fields") is True
        out: dict[str, Any] = {}
        for key, value in data.items():
            if root and key in ("apiVersion", "kind", "metadata"):
                out[key] = value
                continue
            sub = (props or {}).get(key)
            if sub is None and isinstance(extra, dict):
                sub = extra
            if value is None and not (sub or {}).get("nullable"):
                continue  # null of a non-nullable field: pruned, then possibly defaulted
            if sub is not None:
                out[key] = prune(value, sub, root=False)
            elif preserve or extra is True:
                out[key] = value
        return out
    if isinstance(data, list) and isinstance(schema.get("items"), dict):
        return [prune(item, schema["items"], root=False) for item in data]
    return data


def default(data: Any, schema: dict[str, Any]) -> Any:
    """Fill absent fields that declare a default, then recurse (defaults may nest)."""
    if isinstance(data, dict):
        props = schema.get("properties") or {}
        out = dict(data)
        for key, sub in props.items():
            if key not in out and "default" in sub:
                out[key] = copy.deepcopy(sub["default"])
            if key in out:
                out[key] = default(out[key], sub)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in list(out):
                if key not in props:
                    out[key] = default(out[key], extra)
        return out
    if isinstance(data, list) and isinstance(schema.get("items"), dict):
        return [default(item, schema["items"]) for item in data]
    return data


def validate(data: Any, schema: dict[str, Any]) -> list[FieldError]:
    validator = jsonschema.Draft4Validator(schema)
    errors = []
    for err in sorted(validator.iter_errors(data), key=lambda e: list(e.absolute_path)):
        path = ""
        for part in err.absolute_path:
            path = _join(path, part)
        errors.append((path or "<root>", f"Invalid value: {_short(err.instance)}: {err.message}"))
    return errors


def _short(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return '"object"' if isinstance(value, dict) else '"array"'
    text = repr(value) if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else str(value)
    return text if len(text) < 80 else text[:77] + "..."


@functools.lru_cache(maxsize=1)
def _environment() -> Any:
    return celpy.Environment()  # builds a parser: about 0.7 s, so once per process


@functools.lru_cache(maxsize=512)
def _program(rule: str) -> Any:
    env = _environment()
    return env.program(env.compile(rule))


def cel_errors(data: Any, schema: dict[str, Any], path: str = "") -> list[FieldError]:
    """Evaluate every `x-kubernetes-validations` rule where its node has data."""
    errors: list[FieldError] = []
    for rule in schema.get("x-kubernetes-validations") or []:
        expr = rule["rule"]
        if "oldSelf" in expr:
            continue  # transition rules need the old object; creation-only semantics here
        where = path + rule.get("fieldPath", "") if rule.get("fieldPath") else path
        message = rule.get("message") or f"failed rule: {expr}"
        try:
            ok = _program(expr).evaluate({"self": celpy.json_to_cel(data)})
        except Exception as exc:  # a rule that cannot evaluate fails, as in the API server
            ok, message = False, f"{message} (rule could not be evaluated: {type(exc).__name__})"
        if not bool(ok) or isinstance(ok, celpy.CELEvalError):
            errors.append((where.lstrip(".") or "<root>", f'Invalid value: {_short(data)}: {message}'))
    if isinstance(data, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key in data:
                errors += cel_errors(data[key], sub, _join(path, key))
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key, value in data.items():
                errors += cel_errors(value, extra, _join(path, key))
    if isinstance(data, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(data):
            errors += cel_errors(item, schema["items"], _join(path, i))
    return errors


def admit(obj: dict[str, Any], schema: dict[str, Any]) -> tuple[dict[str, Any], list[FieldError]]:
    """Prune, default and validate a custom resource; returns (stored form, errors)."""
    pruned = prune(obj, schema)
    defaulted = default(pruned, schema)
    checked = {k: v for k, v in defaulted.items() if k != "metadata"}
    body_schema = {**schema, "properties": {k: v for k, v in (schema.get("properties") or {}).items() if k != "metadata"}}
    errors = validate(checked, body_schema)
    if not errors:
        errors = cel_errors(defaulted, schema)
    return defaulted, errors
