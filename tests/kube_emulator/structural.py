"""Is a CRD schema structural? The API server's own rules, ported function by function.

Source: kubernetes/apiextensions-apiserver at commit 1aa2717a552ee6ca1e2a18f1f8ffccde981db923,
`pkg/apiserver/schema/`:

- `convert.go` `NewStructural` / `validateUnsupportedFields` -> `unsupported_field`
- `validation.go` `ValidateStructural` -> `validate_structural` (errors sorted by text, as upstream)
  - `validateStructuralInvariants` -> `_invariants`
  - `validateStructuralMetadataInvariants` -> `_metadata_invariants`
  - `validateExtensions` -> `_extensions`
  - `validateValueValidation` / `validateNestedValueValidation` -> `_value_validation` / `_nested`
  - `isIntOrStringAnyOfPattern` / `isIntOrStringAllOfPattern`
- `complete.go` `validateStructuralCompleteness` -> `_completeness` / `_nested_completeness`

Upstream first converts the JSON schema into Go structs (`Structural`, whose value validations
under allOf/anyOf/oneOf/not are `NestedValueValidation`s) and compares them with
`reflect.DeepEqual`; here the same decisions are made on the JSON dicts, with Go's zero values
(`""`, `false`, absent) counting as "not set". Messages and field paths are upstream's, so a test
can hold the emulator's answer against the upstream text.

`pattern` is compiled with RE2 (go_regexp.py), the syntax Go's regexp accepts; the detail of an
invalid-pattern error is RE2's wording, not Go's (the path and the first half of the message match).
"""

from __future__ import annotations

from typing import Any

from .field import FieldError, Path, forbidden, invalid, required
from .go_regexp import PatternError, compile_pattern

Schema = dict[str, Any]

ROOT_LEVEL, ITEM_LEVEL, FIELD_LEVEL = 0, 1, 2

# Generic (validation.go: Structural.Generic) and Extensions: set under a junctor, they are errors.
_INT_OR_STRING_ANY_OF = [{"type": "integer"}, {"type": "string"}]


def _set(node: Schema, key: str) -> bool:
    """Go's "not the zero value": absent, None, "", False and empty lists/maps are unset."""
    value = node.get(key)
    return not (value is None or value is False or value == "" or value == [] or value == {})


def unsupported_field(node: Any) -> str | None:
    """`validateUnsupportedFields` (convert.go) over the whole tree: the first one found."""
    if not isinstance(node, dict):
        return None
    for key, name in (
        ("id", "id"),
        ("$schema", "schema"),
        ("$ref", "$ref"),
        ("patternProperties", "patternProperties"),
        ("dependencies", "dependencies"),
        ("definitions", "definitions"),
    ):
        if _set(node, key):
            return f"OpenAPIV3Schema '{name}' is not supported"
    if "additionalItems" in node:
        return "OpenAPIV3Schema 'additionalItems' is not supported"
    if isinstance(node.get("items"), list):
        return "OpenAPIV3Schema 'items' must be a schema, but is an array"
    children: list[Any] = [node.get("items"), node.get("not")]
    children += list((node.get("properties") or {}).values())
    if isinstance(node.get("additionalProperties"), dict):
        children.append(node["additionalProperties"])
    for key in ("allOf", "anyOf", "oneOf"):
        children += list(node.get(key) or [])
    for child in children:
        found = unsupported_field(child)
        if found:
            return found
    return None


def validate_structural(path: Path, schema: Schema) -> list[FieldError]:
    """`ValidateStructural`: invariants plus completeness, sorted by their text."""
    errors = _invariants(schema, ROOT_LEVEL, path) + _completeness(schema, path)
    return sorted(errors, key=str)


# ---------------------------------------------------------------- invariants (validation.go)


def _has_additional_properties(node: Schema) -> bool:
    # NewStructural: any `additionalProperties` (schema, true or false) is a non-nil StructuralOrBool.
    return "additionalProperties" in node and node["additionalProperties"] is not None


def _invariants(s: Schema | None, lvl: int, path: Path) -> list[FieldError]:
    if s is None:
        return []
    errs: list[FieldError] = []
    type_ = s.get("type") or ""
    items = s.get("items") if isinstance(s.get("items"), dict) else None
    if type_ == "array" and items is None:
        errs.append(required(path.child("items"), "must be specified"))
    errs += _invariants(items, ITEM_LEVEL, path.child("items"))
    for name, sub in sorted((s.get("properties") or {}).items()):
        errs += _invariants(sub, FIELD_LEVEL, path.child("properties").key(name))
    if _has_additional_properties(s):
        if lvl == ROOT_LEVEL:
            errs.append(forbidden(path.child("additionalProperties"), "must not be used at the root"))
        if isinstance(s["additionalProperties"], dict):
            errs += _invariants(s["additionalProperties"], FIELD_LEVEL, path.child("additionalProperties"))
    errs += _extensions(s, path)
    skip_any_of = _is_int_or_string_any_of(s)
    skip_first_all_of_any_of = _is_int_or_string_all_of(s)
    errs += _value_validation(s, skip_any_of, skip_first_all_of_any_of, lvl, path)

    embedded = s.get("x-kubernetes-embedded-resource") is True
    check_metadata = lvl == ROOT_LEVEL or embedded
    if embedded and type_ != "object":
        if not type_:
            errs.append(required(path.child("type"), "must be object if x-kubernetes-embedded-resource is true"))
        else:
            errs.append(invalid(path.child("type"), type_, "must be object if x-kubernetes-embedded-resource is true"))
    elif (
        not type_
        and s.get("x-kubernetes-int-or-string") is not True
        and s.get("x-kubernetes-preserve-unknown-fields") is not True
    ):
        what = {
            ROOT_LEVEL: "must not be empty at the root",
            ITEM_LEVEL: "must not be empty for specified array items",
            FIELD_LEVEL: "must not be empty for specified object fields",
        }[lvl]
        errs.append(required(path.child("type"), what))
    if embedded and _has_additional_properties(s):
        errs.append(
            forbidden(path.child("additionalProperties"), "must not be used if x-kubernetes-embedded-resource is set")
        )
    if lvl == ROOT_LEVEL and type_ and type_ != "object":
        errs.append(invalid(path.child("type"), type_, "must be object at the root"))

    props = s.get("properties") or {}
    for meta_field in ("kind", "apiVersion"):
        if meta_field in props and check_metadata and (props[meta_field].get("type") or "") != "string":
            errs.append(
                invalid(
                    path.child("properties").key(meta_field).child("type"),
                    props[meta_field].get("type") or "",
                    "must be string",
                )
            )
    if "metadata" in props:
        errs += _metadata_invariants(props["metadata"], check_metadata, lvl, path.child("properties").key("metadata"))
    if embedded and s.get("x-kubernetes-preserve-unknown-fields") is not True and not props:
        errs.append(
            required(
                path.child("properties"),
                "must not be empty if x-kubernetes-embedded-resource is true without "
                "x-kubernetes-preserve-unknown-fields",
            )
        )
    return errs


def _metadata_invariants(s: Schema, check_metadata: bool, lvl: int, path: Path) -> list[FieldError]:
    """At the root, metadata's schema minus `type`, `default` and name/generateName restrictions
    must be empty (upstream: `reflect.DeepEqual(*s, Structural{ValueValidation: &ValueValidation{}})`,
    which takes `description` into account too)."""
    errs: list[FieldError] = []
    if check_metadata and (s.get("type") or "") != "object":
        errs.append(invalid(path.child("type"), s.get("type") or "", "must be object"))
    if lvl == ROOT_LEVEL:
        rest = {k: v for k, v in s.items() if _set(s, k) or k == "default" and v is not None}
        props = set(rest.get("properties") or {})
        if props and props <= {"name", "generateName"}:
            rest.pop("properties")
        rest.pop("type", None)
        rest.pop("default", None)
        if rest:
            errs.append(
                forbidden(
                    path,
                    "must not specify anything other than name and generateName, but metadata is implicitly specified",
                )
            )
    return errs


def _is_int_or_string_any_of(s: Schema) -> bool:
    return s.get("anyOf") == _INT_OR_STRING_ANY_OF


def _is_int_or_string_all_of(s: Schema) -> bool:
    all_of = s.get("allOf") or []
    return len(all_of) >= 1 and isinstance(all_of[0], dict) and all_of[0].get("anyOf") == _INT_OR_STRING_ANY_OF


def _extensions(s: Schema, path: Path) -> list[FieldError]:
    errs = []
    if s.get("x-kubernetes-int-or-string") is True and s.get("x-kubernetes-preserve-unknown-fields") is True:
        errs.append(
            invalid(
                path.child("x-kubernetes-preserve-unknown-fields"),
                True,
                "must be false if x-kubernetes-int-or-string is true",
            )
        )
    if s.get("x-kubernetes-int-or-string") is True and s.get("x-kubernetes-embedded-resource") is True:
        errs.append(
            invalid(
                path.child("x-kubernetes-embedded-resource"),
                True,
                "must be false if x-kubernetes-int-or-string is true",
            )
        )
    return errs


def _value_validation(
    v: Schema, skip_any_of: bool, skip_first_all_of_any_of: bool, lvl: int, path: Path
) -> list[FieldError]:
    """`validateValueValidation`: recurse into the junctors; the pattern must compile."""
    errs: list[FieldError] = []
    if not skip_any_of:
        for i, sub in enumerate(v.get("anyOf") or []):
            errs += _nested(sub, False, False, lvl, path.child("anyOf").index(i))
    for i, sub in enumerate(v.get("allOf") or []):
        errs += _nested(sub, skip_first_all_of_any_of and i == 0, False, lvl, path.child("allOf").index(i))
    for i, sub in enumerate(v.get("oneOf") or []):
        errs += _nested(sub, False, False, lvl, path.child("oneOf").index(i))
    errs += _nested(v.get("not"), False, False, lvl, path.child("not"))
    pattern = v.get("pattern")
    if pattern:
        try:
            compile_pattern(pattern)
        except PatternError as exc:
            errs.append(
                invalid(path.child("pattern"), pattern, f"must be a valid regular expression, but isn't: {exc}")
            )
    return errs


def _nested(v: Schema | None, skip_any_of: bool, skip_all_of_any_of: bool, lvl: int, path: Path) -> list[FieldError]:
    """`validateNestedValueValidation`: under allOf/anyOf/oneOf/not only value validations may be
    set; everything structural (type, description, default, ...) must stay outside."""
    if v is None:
        return []
    errs = _value_validation(v, skip_any_of, skip_all_of_any_of, lvl, path)
    items = v.get("items") if isinstance(v.get("items"), dict) else None
    errs += _nested(items, False, False, lvl, path.child("items"))
    for name, sub in sorted((v.get("properties") or {}).items()):
        errs += _nested(sub, False, False, FIELD_LEVEL, path.child("properties").key(name))
    if _set(v, "type"):
        errs.append(forbidden(path.child("type"), "must be empty to be structural"))
    # newNestedValueValidation: a schema or `true` makes AdditionalProperties non-nil, `false` does not.
    extra = v.get("additionalProperties")
    if isinstance(extra, dict) or extra is True:
        errs.append(forbidden(path.child("additionalProperties"), "must be undefined to be structural"))
    if v.get("default") is not None:
        errs.append(forbidden(path.child("default"), "must be undefined to be structural"))
    if _set(v, "title"):
        errs.append(forbidden(path.child("title"), "must be empty to be structural"))
    if _set(v, "description"):
        errs.append(forbidden(path.child("description"), "must be empty to be structural"))
    if v.get("nullable") is True:
        errs.append(forbidden(path.child("nullable"), "must be false to be structural"))
    for ext in ("x-kubernetes-preserve-unknown-fields", "x-kubernetes-embedded-resource", "x-kubernetes-int-or-string"):
        if v.get(ext) is True:
            errs.append(forbidden(path.child(ext), "must be false to be structural"))
    if _set(v, "x-kubernetes-list-map-keys"):
        errs.append(forbidden(path.child("x-kubernetes-list-map-keys"), "must be empty to be structural"))
    for ext in ("x-kubernetes-list-type", "x-kubernetes-map-type"):
        if v.get(ext) is not None:
            errs.append(forbidden(path.child(ext), "must be undefined to be structural"))
    if _set(v, "x-kubernetes-validations"):
        errs.append(forbidden(path.child("x-kubernetes-validations"), "must be empty to be structural"))
    if "metadata" in (v.get("properties") or {}):
        errs.append(forbidden(path.child("properties").key("metadata"), "must not be specified in a nested context"))
    return errs


# ---------------------------------------------------------------- completeness (complete.go)


def _completeness(s: Schema, path: Path) -> list[FieldError]:
    return _vv_completeness(s, s, path, path)


def _vv_completeness(v: Schema, s: Schema | None, s_path: Path, v_path: Path) -> list[FieldError]:
    if s is None:
        return [required(s_path, f"because it is defined in {v_path}")]
    errs = _nested_completeness(v.get("not"), s, s_path, v_path.child("not"))
    for key in ("allOf", "anyOf", "oneOf"):
        for i, sub in enumerate(v.get(key) or []):
            errs += _nested_completeness(sub, s, s_path, v_path.child(key).index(i))
    return errs


def _nested_completeness(v: Schema | None, s: Schema | None, s_path: Path, v_path: Path) -> list[FieldError]:
    """Every property or items named under a junctor must be specified structurally too."""
    if v is None:
        return []
    if s is None:
        return [required(s_path, f"because it is defined in {v_path}")]
    errs = _vv_completeness(v, s, s_path, v_path)
    v_items = v.get("items") if isinstance(v.get("items"), dict) else None
    s_items = s.get("items") if isinstance(s.get("items"), dict) else None
    errs += _nested_completeness(v_items, s_items, s_path.child("items"), v_path.child("items"))
    s_props = s.get("properties") or {}
    for name, sub in sorted((v.get("properties") or {}).items()):
        if name not in s_props:
            errs.append(
                required(
                    s_path.child("properties").key(name),
                    f"because it is defined in {v_path.child('properties').key(name)}",
                )
            )
        else:
            errs += _nested_completeness(
                sub, s_props[name], s_path.child("properties").key(name), v_path.child("properties").key(name)
            )
    return errs
