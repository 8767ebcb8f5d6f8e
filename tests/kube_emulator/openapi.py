"""OpenAPI value validation of a custom resource, with the API server's field errors.

Upstream validates with kube-openapi's `pkg/validation/validate` (read at
d427ff9ee9ad05f5da435abbb7c5929cb713ac56) and turns each result into a field error in
apiextensions-apiserver `pkg/apiserver/validation/validation.go` `kubeOpenAPIResultToFieldErrors`:
a missing required property is `Required value`, an enum miss `Unsupported value: ...: supported
values: ...`, maxLength `Too long`, maxItems/maxProperties `Too many`, a wrong type `Invalid value`
(type FieldValueTypeInvalid) with "<path> in body must be of type <t>: \"<found>\"", and every
other keyword `Invalid value: <v>: <path> in body should be ...` with kube-openapi's templates
(`pkg/validation/errors/schema.go`). The walk follows `ConvertJSONSchemaProps`: int-or-string
is type [integer, string]; `nullable` admits null.

Not ported: `format` checks (StripUnsupportedFormatsPostProcessor keeps a handful; our CRDs set no
format) and the ratcheting of unchanged values on update, which schema.py applies to the errors
this returns (see `schema.ratchet`).
"""

from __future__ import annotations

import json
import math
from typing import Any

from . import field as F
from .field import FieldError, Path, go_float
from .go_regexp import search

Schema = dict[str, Any]


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _num(value: Any) -> str:
    return go_float(float(value)) if isinstance(value, float) else str(value)


def validate(value: Any, schema: Schema, path: Path = F.ROOT) -> list[FieldError]:
    """All errors of `value` against `schema`; `path` prefixes field paths (e.g. `...default`)."""
    return _validate(value, schema, path, "")


def _name(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _validate(value: Any, s: Schema, path: Path, name: str) -> list[FieldError]:
    errs: list[FieldError] = []
    int_or_string = s.get("x-kubernetes-int-or-string") is True
    types = ["integer", "string"] if int_or_string else ([s["type"]] if s.get("type") else [])
    if value is None:
        if types and not s.get("nullable"):
            errs.append(F.type_invalid(path, "null", f'{name} in body must be of type {",".join(types)}: "null"'))
        return errs
    actual = _json_type(value)
    if types:
        ok = (
            actual in types
            or actual == "integer"
            and "number" in types
            or actual == "number"
            and "integer" in types
            and float(value).is_integer()
        )
        if not ok:
            errs.append(F.type_invalid(path, actual, f'{name} in body must be of type {",".join(types)}: "{actual}"'))
            return errs
    if "enum" in s and not any(_json_equal(value, e) for e in s["enum"]):
        valid = [e if isinstance(e, str) else json.dumps(e) for e in s["enum"]]
        errs.append(F.not_supported(path, value, valid))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        errs += _number(value, s, path, name)
    if isinstance(value, str):
        if s.get("maxLength") is not None and len(value) > s["maxLength"]:
            errs.append(F.too_long(path, s["maxLength"]))
        if s.get("minLength") is not None and len(value) < s["minLength"]:
            errs.append(F.invalid(path, value, f"{name} in body should be at least {s['minLength']} chars long"))
        if s.get("pattern") and not search(s["pattern"], value):
            errs.append(F.invalid(path, value, f"{name} in body should match '{s['pattern']}'"))
    if isinstance(value, list):
        if s.get("maxItems") is not None and len(value) > s["maxItems"]:
            errs.append(F.too_many(path, len(value), s["maxItems"]))
        if s.get("minItems") is not None and len(value) < s["minItems"]:
            errs.append(F.invalid(path, value, f"{name} in body should have at least {s['minItems']} items"))
        if isinstance(s.get("items"), dict):
            for i, item in enumerate(value):
                errs += _validate(item, s["items"], path.index(i), f"{name}[{i}]")
    if isinstance(value, dict):
        if s.get("maxProperties") is not None and len(value) > s["maxProperties"]:
            errs.append(F.too_many(path, len(value), s["maxProperties"]))
        if s.get("minProperties") is not None and len(value) < s["minProperties"]:
            errs.append(F.invalid(path, value, f"{name} in body should have at least {s['minProperties']} properties"))
        for req in s.get("required") or []:
            if req not in value:
                errs.append(F.required(path.child(req), ""))
        props = s.get("properties") or {}
        extra = s.get("additionalProperties")
        for key, sub_value in value.items():
            sub = props.get(key)
            if sub is None and isinstance(extra, dict):
                sub = extra
            if sub is not None:
                errs += _validate(sub_value, sub, path.child(key), _name(name, key))
    errs += _junctors(value, s, path, name)
    return errs


def _number(value: float, s: Schema, path: Path, name: str) -> list[FieldError]:
    errs = []
    if s.get("maximum") is not None:
        if s.get("exclusiveMaximum") and value >= s["maximum"]:
            errs.append(F.invalid(path, value, f"{name} in body should be less than {_num(s['maximum'])}"))
        elif value > s["maximum"]:
            errs.append(F.invalid(path, value, f"{name} in body should be less than or equal to {_num(s['maximum'])}"))
    if s.get("minimum") is not None:
        if s.get("exclusiveMinimum") and value <= s["minimum"]:
            errs.append(F.invalid(path, value, f"{name} in body should be greater than {_num(s['minimum'])}"))
        elif value < s["minimum"]:
            errs.append(
                F.invalid(path, value, f"{name} in body should be greater than or equal to {_num(s['minimum'])}")
            )
    factor = s.get("multipleOf")
    if factor and not math.isclose(value / factor, round(value / factor)):
        errs.append(F.invalid(path, value, f"{name} in body should be a multiple of {_num(factor)}"))
    return errs


def _junctors(value: Any, s: Schema, path: Path, name: str) -> list[FieldError]:
    """schema_props.go: anyOf/oneOf/allOf/not with kube-openapi's composite messages."""
    errs: list[FieldError] = []
    quoted = json.dumps(name)
    if s.get("anyOf"):
        if not any(not _validate(value, sub, path, name) for sub in s["anyOf"]):
            errs.append(F.invalid(path, value, f"{quoted} must validate at least one schema (anyOf)"))
    if s.get("oneOf"):
        valid = sum(1 for sub in s["oneOf"] if not _validate(value, sub, path, name))
        if valid != 1:
            more = "Found none valid" if valid == 0 else f"Found {valid} valid alternatives"
            errs.append(F.invalid(path, value, f"{quoted} must validate one and only one schema (oneOf). {more}"))
    if s.get("allOf"):
        results = [_validate(value, sub, path, name) for sub in s["allOf"]]
        failed = [r for r in results if r]
        if failed:
            errs.append(
                F.invalid(
                    path,
                    value,
                    f"{quoted} must validate all the schemas (allOf)"
                    f"{'. None validated' if len(failed) == len(results) else ''}",
                )
            )
            for r in failed:
                errs += r
    if isinstance(s.get("not"), dict) and not _validate(value, s["not"], path, name):
        errs.append(F.invalid(path, value, f"{quoted} must not validate the schema (not)"))
    return errs


def _json_equal(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return a == b


BLOCKING = {F.NOT_SUPPORTED, F.REQUIRED, F.TOO_LONG, F.TOO_MANY, F.TYPE_INVALID}
