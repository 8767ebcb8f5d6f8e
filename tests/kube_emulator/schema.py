"""What the API server does to a custom resource before storing it, in upstream's order.

Ported from kubernetes/apiextensions-apiserver at 1aa2717a552ee6ca1e2a18f1f8ffccde981db923:

1. decoding (`customresource_handler.go` `unstructuredSchemaCoercer.apply`): prune unknown fields
   (`schema/pruning/algorithm.go` `prune`/`skipPrune`: `prune`), then drop nulls of non-nullable
   fields that have no default (`schema/defaulting/prunenulls.go`: `prune_nulls`);
2. defaulting (`unstructuredDefaulter` -> `schema/defaulting/algorithm.go` `Default`: `default`),
   a non-nullable null with a default is replaced by it;
3. the strategy (`registry/customresource/strategy.go`, `status_strategy.go`): on create `status`
   is dropped when the status subresource is on; an update through the main endpoint keeps the old
   status, one through `/status` keeps everything but status; generation moves on any change
   outside metadata;
4. validation (`validator.go` + strategy `Validate`/`ValidateUpdate`): apiVersion/kind, OpenAPI
   schema (openapi.py), scale replicas paths, list-type set/map uniqueness
   (`schema/listtype/validation.go`), then the CEL rules (`schema/cel/validation.go`) unless a
   "blocking" error (Required, NotSupported, TooLong, TooMany, TypeInvalid) was found, in which case
   one error says some rules were not checked (`hasBlockingErr`).

On update, with ratcheting (feature CRDValidationRatcheting, on by default since 1.30): schema errors
and CEL errors of rules without oldSelf are dropped where the value is unchanged from the old
object (correlated through object fields and map-list keys); transition rules (using oldSelf) run
only when an old value correlates. CEL runs on celpy; runtime errors are worded as cel-go's where
known ("no such key: x", "division by zero").

Not ported: ObjectMeta validation of embedded resources, messageExpression, CEL cost budgets.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from dataclasses import dataclass
from typing import Any

import celpy

from . import celcheck, openapi
from . import field as F
from .field import FieldError, Path

Schema = dict[str, Any]
_META = ("apiVersion", "kind", "metadata")


# ---------------------------------------------------------------- 1. pruning (pruning/algorithm.go)


def prune(x: Any, s: Schema | None, resource_root: bool = False) -> Any:
    """`PruneWithOptions`: a copy of x without what s does not specify. At a resource root (and in
    x-kubernetes-embedded-resource objects) apiVersion, kind and metadata are kept."""
    if resource_root:
        s = {**(s or {}), "x-kubernetes-embedded-resource": True}
    return _prune(copy.deepcopy(x), s, top=True)


def _extra(s: Schema) -> Schema | None | bool:
    value = s.get("additionalProperties")
    return value if isinstance(value, dict) else (True if value is not None else None)


def _prune(x: Any, s: Schema | None, top: bool = False) -> Any:
    if s is not None and s.get("x-kubernetes-preserve-unknown-fields") is True:
        return _skip_prune(x, s)
    if isinstance(x, dict):
        if s is None:
            return {}
        out = {}
        embedded = s.get("x-kubernetes-embedded-resource") is True
        props = s.get("properties") or {}
        extra = _extra(s)
        for k, v in x.items():
            if embedded and k in _META:
                out[k] = v
            elif k in props:
                out[k] = _prune(v, props[k])
            elif extra is not None:
                out[k] = _prune(v, extra if isinstance(extra, dict) else None)
        return out
    if isinstance(x, list):
        items = s.get("items") if s is not None and isinstance(s.get("items"), dict) else None
        return [_prune(v, items) for v in x]
    return x


def _skip_prune(x: Any, s: Schema) -> Any:
    if isinstance(x, dict):
        embedded = s.get("x-kubernetes-embedded-resource") is True
        props = s.get("properties") or {}
        extra = _extra(s)
        out = {}
        for k, v in x.items():
            if embedded and k in _META:
                out[k] = v
            elif k in props:
                out[k] = _prune(v, props[k])
            elif extra is not None:
                out[k] = _prune(v, extra if isinstance(extra, dict) else None)
            else:
                out[k] = v
        return out
    if isinstance(x, list):
        items = s.get("items") if isinstance(s.get("items"), dict) else None
        return [_skip_prune(v, items) if items else v for v in x]
    return x


def unknown_fields(x: Any, s: Schema | None) -> list[str]:
    """The unknown fields of a strict decode: those of the root's metadata, then the paths
    `PruneWithOptions` (pruning/algorithm.go) records with TrackUnknownFieldPaths on, sorted (root
    apiVersion/kind never count), as `spec.a`, `spec.list[0].b` (`schema/options.go`)."""
    found: list[str] = []
    _unknown(x, {**(s or {}), "x-kubernetes-embedded-resource": True}, "", found)
    # The root's metadata first, as `unstructuredSchemaCoercer.apply` appends them: objectmeta/
    # coerce.go GetObjectMetaWithOptions (UnmarshalStrict into ObjectMeta), its own keys only here.
    meta = x.get("metadata") if isinstance(x, dict) else None
    in_meta = [f"metadata.{k}" for k in meta if k not in OBJECT_META_FIELDS] if isinstance(meta, dict) else []
    return in_meta + sorted(found)


# metav1.ObjectMeta's JSON fields (k8s.io/apimachinery pkg/apis/meta/v1/types.go).
OBJECT_META_FIELDS = frozenset(
    (
        "name generateName namespace selfLink uid resourceVersion generation creationTimestamp deletionTimestamp "
        "deletionGracePeriodSeconds labels annotations ownerReferences finalizers managedFields"
    ).split()
)


def _join(parent: str, key: str) -> str:
    return f"{parent}.{key}" if parent else key


def _unknown(x: Any, s: Schema | None, parent: str, found: list[str], skip: bool = False) -> None:
    """`prune` (skip=False) and `skipPrune` (skip=True, below x-kubernetes-preserve-unknown-fields)."""
    if s is not None and s.get("x-kubernetes-preserve-unknown-fields") is True:
        skip = True
    if skip and s is None:
        return
    if isinstance(x, dict):
        if s is None:
            found.extend(_join(parent, k) for k in x)
            return
        embedded = s.get("x-kubernetes-embedded-resource") is True
        props, extra = s.get("properties") or {}, _extra(s)
        for k, v in x.items():
            if embedded and k in _META:
                continue
            if k in props:
                _unknown(v, props[k], _join(parent, k), found)
            elif extra is not None:
                _unknown(v, extra if isinstance(extra, dict) else None, _join(parent, k), found)
            elif not skip and (k not in _META or parent):
                found.append(_join(parent, k))
    elif isinstance(x, list):
        items = s.get("items") if s is not None and isinstance(s.get("items"), dict) else None
        for i, v in enumerate(x):
            _unknown(v, items, f"{parent}[{i}]", found, skip)


# ---------------------------------------------------------------- nulls and defaults


def _sub_schema(s: Schema | None, key: str) -> Schema | None:
    if s is None:
        return None
    props = s.get("properties") or {}
    if key in props:
        return props[key]
    extra = s.get("additionalProperties")
    return extra if isinstance(extra, dict) else None


def prune_nulls(x: Any, s: Schema | None) -> Any:
    """`PruneNonNullableNullsWithoutDefaults`."""
    if isinstance(x, dict):
        out = {}
        for k, v in x.items():
            sub = _sub_schema(s, k)
            if v is None and sub is not None and not sub.get("nullable") and "default" not in sub:
                continue
            out[k] = prune_nulls(v, sub)
        return out
    if isinstance(x, list):
        items = s.get("items") if s is not None and isinstance(s.get("items"), dict) else None
        return [prune_nulls(v, items) for v in x]
    return x


def _non_nullable_null(x: Any, s: Schema | None) -> bool:
    return x is None and s is not None and not s.get("nullable")


def default(x: Any, s: Schema | None) -> Any:
    """`Default`: absent fields (and non-nullable nulls) get their default, top-down, so a
    defaulted `{}` then receives its own fields' defaults."""
    if s is None:
        return x
    if isinstance(x, dict):
        out = dict(x)
        props = s.get("properties") or {}
        for k, prop in props.items():
            if "default" in prop and prop["default"] is not None and (k not in out or _non_nullable_null(out[k], prop)):
                out[k] = copy.deepcopy(prop["default"])
        extra = s.get("additionalProperties")
        for k in list(out):
            if k in props:
                out[k] = default(out[k], props[k])
            elif isinstance(extra, dict):
                if _non_nullable_null(out[k], extra) and extra.get("default") is not None:
                    out[k] = copy.deepcopy(extra["default"])
                out[k] = default(out[k], extra)
        return out
    if isinstance(x, list):
        items = s.get("items") if isinstance(s.get("items"), dict) else None
        out_list = []
        for v in x:
            if items is not None and _non_nullable_null(v, items) and items.get("default") is not None:
                v = copy.deepcopy(items["default"])
            out_list.append(default(v, items))
        return out_list
    return x


# ---------------------------------------------------------------- list types (listtype/validation.go)


def list_sets_and_maps(path: Path, s: Schema | None, obj: Any) -> list[FieldError]:
    """`ValidateListSetsAndMaps`: no duplicate items in set lists, no duplicate keys in map lists."""
    errs: list[FieldError] = []
    if s is None:
        return errs
    if isinstance(obj, dict):
        extra = s.get("additionalProperties")
        props = s.get("properties") or {}
        for k, v in obj.items():
            if isinstance(extra, dict):
                errs += list_sets_and_maps(path.key(k), extra, v)
            if k in props:
                errs += list_sets_and_maps(path.child(k), props[k], v)
    elif isinstance(obj, list):
        list_type = s.get("x-kubernetes-list-type")
        if list_type == "set":
            errs += [F.duplicate(path.index(i), obj[i]) for i in _non_unique(obj)]
        elif list_type == "map":
            errs += _list_map(path, s, obj)
        items = s.get("items") if isinstance(s.get("items"), dict) else None
        if items is not None:
            for i, v in enumerate(obj):
                errs += list_sets_and_maps(path.index(i), items, v)
    return errs


_UNSPECIFIED = object()


def _non_unique(values: list[Any]) -> list[int]:
    seen: dict[str, int] = {}
    out = []
    for i, v in enumerate(values):
        key = "<unspecified>" if v is _UNSPECIFIED else json.dumps(v, sort_keys=True)
        seen[key] = seen.get(key, 0) + 1
        if seen[key] == 2:
            out.append(i)
    return out


def _map_keys(s: Schema, item: Any) -> Any:
    keys = s.get("x-kubernetes-list-map-keys") or []
    if not isinstance(item, dict):
        return _UNSPECIFIED
    if len(keys) == 1:
        return item.get(keys[0], _UNSPECIFIED)
    return {k: item[k] for k in keys if k in item}


def _list_map(path: Path, s: Schema, obj: list[Any]) -> list[FieldError]:
    for i, x in enumerate(obj):
        if x is not None and not isinstance(x, dict):
            return [F.invalid(path.index(i), x, "must be an object for an array of list-type map")]
    keys = [_map_keys(s, x) for x in obj]
    errs = []
    for i in _non_unique(keys):
        k = keys[i]
        names = s.get("x-kubernetes-list-map-keys") or []
        value = {} if k is _UNSPECIFIED else ({names[0]: k} if len(names) == 1 else k)
        errs.append(F.duplicate(path.index(i), value))
    return errs


# ---------------------------------------------------------------- correlation (ratcheting)


def _correlate_item(s: Schema | None, item: Any, old_list: Any) -> Any:
    """Only map lists correlate items (by their keys); anything else: no old value."""
    if s is None or s.get("x-kubernetes-list-type") != "map" or not isinstance(old_list, list):
        return None
    key = _map_keys(s, item)
    if key is _UNSPECIFIED:
        return None
    for old in old_list:
        if _map_keys(s, old) == key:
            return old
    return None


_ABSENT = object()


@dataclass
class _Corr:
    """A node of `common.CorrelatedObject`: the old value that corresponds to the new one (or none)."""

    old: Any = _ABSENT

    def unchanged(self, new: Any) -> bool:
        return self.old is not _ABSENT and self.old == new


# ---------------------------------------------------------------- CEL (cel/validation.go)


@functools.lru_cache(maxsize=1)
def _environment() -> Any:
    return celpy.Environment()  # builds a parser: about 0.7 s, so once per process


@functools.lru_cache(maxsize=1024)
def _program(rule: str) -> Any:
    env = _environment()
    return env.program(env.compile(rule))


@functools.lru_cache(maxsize=1024)
def _mentions_old_self(rule: str) -> bool:
    """compileRule's UsesOldSelf: the checked expression references the variable oldSelf."""
    return celcheck.compile_rule(rule, celcheck.DYN).uses_old_self


def _cel_error_text(exc: Any) -> str:
    """cel-go's wording of a runtime error. Where both operands of || / && fail, celpy reports an
    overload error while cel-go reports the first operand's error: that one is dug out."""
    args = getattr(exc, "args", ()) or ()
    text = str(args[0]) if args else str(exc)
    if (
        text.startswith(("found no matching overload for _||_", "found no matching overload for _&&_"))
        and len(args) > 2
        and args[2]
    ):
        inner = re.search(r"CELEvalError\(\*\((\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*')", str(args[2][0]))
        if inner:
            text = inner.group(1)[1:-1].replace("\\'", "'")
    if text.startswith("no such member in mapping: "):
        return "no such key: " + text.removeprefix("no such member in mapping: ").strip("'")
    if "divide by zero" in text:
        return "division by zero"
    return text


def rule_error_string(rule: dict[str, Any]) -> str:
    return (rule.get("message") or "").strip() or rule.get("rule", "").strip()


def _field_error_for_reason(path: Path, value: Any, detail: str, reason: str | None) -> FieldError:
    if reason == "FieldValueForbidden":
        return F.forbidden(path, detail)
    if reason == "FieldValueRequired":
        return F.required(path, detail)
    if reason == "FieldValueDuplicate":
        return F.duplicate(path, value)
    return F.invalid(path, value, detail)


def _rule_path(path: Path, rule: dict[str, Any], s: Schema) -> Path:
    fp = rule.get("fieldPath")
    if not fp:
        return path
    try:
        steps, _ = celcheck.valid_field_path(fp, s)
    except celcheck.FieldPathError:
        return path
    for kind, name in steps:
        path = path.child(name) if kind == "child" else path.key(name)
    return path


def cel_validate(
    s: Schema | None, obj: Any, old: Any, path: Path = F.ROOT, resource_root: bool = True, ratcheting: bool = False
) -> tuple[list[FieldError], list[str]]:
    """`Validator.Validate`: every rule where its node has a value; returns (errors, warnings).

    `old` is None on create (transition rules skipped); on update it is the old object, and with
    `ratcheting` errors of non-transition rules on unchanged values become warnings."""
    errors: list[FieldError] = []
    warnings: list[str] = []
    _cel(
        s,
        obj,
        old,
        path,
        resource_root,
        _Corr(old if ratcheting and old is not None else _ABSENT),
        ratcheting,
        errors,
        warnings,
    )
    return errors, warnings


def _cel(
    s: Schema | None,
    obj: Any,
    old: Any,
    path: Path,
    resource_root: bool,
    corr: _Corr,
    ratcheting: bool,
    errors: list[FieldError],
    warnings: list[str],
) -> None:
    if s is None or obj is None:
        return
    rules = s.get("x-kubernetes-validations") or []
    if rules:
        activation = {"self": celpy.json_to_cel(obj)}
        if old is not None:
            activation["oldSelf"] = celpy.json_to_cel(old)
        type_ = s.get("type", "")
        for rule in rules:
            expr = rule.get("rule", "")
            if not expr.strip():
                continue
            uses_old = _mentions_old_self(expr)
            if uses_old and old is None:
                continue  # transition rules need a correlated old value (optionalOldSelf not ported)
            try:
                result = _program(expr).evaluate(activation)
            except Exception as exc:  # celpy raises CELEvalError (no such key, division by zero, ...)
                errors.append(
                    F.invalid(path, type_, f"{_cel_error_text(exc)} evaluating rule: {rule_error_string(rule)}")
                )
                continue
            if isinstance(result, celpy.CELEvalError):
                errors.append(
                    F.invalid(path, type_, f"{_cel_error_text(result)} evaluating rule: {rule_error_string(rule)}")
                )
                continue
            if result is True or isinstance(result, celpy.celtypes.BoolType) and bool(result):
                continue
            detail = (rule.get("message") or "").strip() or f"failed rule: {rule_error_string(rule)}"
            value = F.OMIT if type_ in ("object", "array") else obj
            err = _field_error_for_reason(_rule_path(path, rule, s), value, detail, rule.get("reason"))
            if not uses_old and ratcheting and corr.unchanged(obj):
                warnings.append(str(err))
            else:
                errors.append(err)
    if isinstance(obj, dict):
        correlatable = s.get("x-kubernetes-map-type") in (None, "granular", "atomic")
        extra = s.get("additionalProperties")
        props = s.get("properties") or {}
        for k, v in obj.items():
            old_v = old.get(k) if correlatable and isinstance(old, dict) else None
            sub_corr = _Corr(corr.old[k] if isinstance(corr.old, dict) and k in corr.old else _ABSENT)
            if isinstance(extra, dict):
                _cel(extra, v, old_v, path.key(k), False, sub_corr, ratcheting, errors, warnings)
            if k in props:
                _cel(props[k], v, old_v, path.child(k), False, sub_corr, ratcheting, errors, warnings)
    elif isinstance(obj, list) and isinstance(s.get("items"), dict):
        for i, v in enumerate(obj):
            old_v = _correlate_item(s, v, old)
            sub_corr = _Corr(old_v if old_v is not None else _ABSENT)
            _cel(s["items"], v, old_v, path.index(i), False, sub_corr, ratcheting, errors, warnings)


# ---------------------------------------------------------------- schema ratcheting


def _value_at(obj: Any, field_path: str) -> Any:
    """The value at a printed field path (`spec.a[0].b`, `spec.m[key]`) or _ABSENT."""
    import re

    cur = obj
    for name, index in re.findall(r"([^.\[\]]+)|\[([^\]]*)\]", field_path):
        if name:
            if not isinstance(cur, dict) or name not in cur:
                return _ABSENT
            cur = cur[name]
        elif isinstance(cur, list):
            if not index.isdigit() or int(index) >= len(cur):
                return _ABSENT
            cur = cur[int(index)]
        elif isinstance(cur, dict):
            if index not in cur:
                return _ABSENT
            cur = cur[index]
        else:
            return _ABSENT
    return cur


def _correlated_old(new: Any, old: Any, s: Schema, field_path: str) -> Any:
    """Follow a field path in new and old together; list items correlate only in map lists."""
    import re

    cur_new, cur_old, cur_s = new, old, s
    for name, index in re.findall(r"([^.\[\]]+)|\[([^\]]*)\]", field_path):
        if cur_old is _ABSENT:
            return _ABSENT
        if name or isinstance(cur_new, dict):
            key = name or index
            if not isinstance(cur_new, dict) or not isinstance(cur_old, dict) or key not in cur_old:
                return _ABSENT
            cur_new, cur_old, cur_s = cur_new.get(key), cur_old[key], _sub_schema(cur_s, key) or {}
        else:
            if not isinstance(cur_new, list) or not index.isdigit() or int(index) >= len(cur_new):
                return _ABSENT
            item = cur_new[int(index)]
            matched = _correlate_item(cur_s, item, cur_old)
            cur_new, cur_old = item, (matched if matched is not None else _ABSENT)
            cur_s = cur_s.get("items") if isinstance(cur_s.get("items"), dict) else {}
    return cur_old


def ratchet(errors: list[FieldError], new: Any, old: Any, s: Schema) -> list[FieldError]:
    """Drop schema errors whose value did not change (ratcheting.go, CRDValidationRatcheting)."""
    kept = []
    for err in errors:
        path = err.field
        value = _value_at(new, path)
        if err.type == F.REQUIRED:  # the missing field's parent is what ratchets
            parent = path.rsplit(".", 1)[0] if "." in path else ""
            value = _value_at(new, parent) if parent else new
            old_value = _correlated_old(new, old, s, parent) if parent else old
        else:
            old_value = _correlated_old(new, old, s, path)
        if old_value is not _ABSENT and value is not _ABSENT and old_value == value:
            continue
        kept.append(err)
    return kept


# ---------------------------------------------------------------- scale (validator.go)


def _go_v(value: Any) -> str:
    """Go's %v of a JSON value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return F.go_float(value)
    if isinstance(value, dict):
        return "map[" + " ".join(f"{k}:{_go_v(v)}" for k, v in sorted(value.items())) + "]"
    if isinstance(value, list):
        return "[" + " ".join(_go_v(v) for v in value) + "]"
    return "<nil>" if value is None else str(value)


def _go_type(v: Any) -> str:
    return {
        bool: "bool",
        int: "int64",
        float: "float64",
        str: "string",
        list: "[]interface {}",
        dict: "map[string]interface {}",
    }.get(type(v), "<nil>")


def _nested(obj: Any, dotted: str, want: type, want_name: str) -> tuple[Any, str | None]:
    """`unstructured.NestedInt64` / `NestedString`: (value, error); absent is (None, None)."""
    cur = obj
    parts = dotted.lstrip(".").split(".")
    for i, part in enumerate(parts):
        if not isinstance(cur, dict):
            return None, (
                f".{'.'.join(parts[:i])} accessor error: {_go_v(cur)} is of the type {_go_type(cur)}, "
                "expected map[string]interface{}"
            )
        if part not in cur:
            return None, None
        cur = cur[part]
    if isinstance(cur, bool) or not isinstance(cur, want):
        return (
            None,
            f".{'.'.join(parts)} accessor error: {_go_v(cur)} is of the type {_go_type(cur)}, expected {want_name}",
        )
    return cur, None


def scale_errors(obj: Any, scale: dict[str, Any] | None, spec: bool) -> list[FieldError]:
    """`ValidateScaleSpec` (spec=True) and `ValidateScaleStatus`."""
    if not scale:
        return []
    errs = []
    checks = [scale.get("specReplicasPath")] if spec else []
    checks.append(scale.get("statusReplicasPath"))
    for dotted in checks:
        if not dotted:
            continue
        value, err = _nested(obj, dotted, int, "int64")
        path = Path(dotted)
        if err:
            errs.append(F.invalid(path, 0, err))
        elif value is not None and value < 0:
            errs.append(F.invalid(path, value, "should be a non-negative integer"))
        elif value is not None and value > 2**31 - 1:
            errs.append(F.invalid(path, value, f"should be less than or equal to {2**31 - 1}"))
    selector = scale.get("labelSelectorPath")
    if selector:
        _, err = _nested(obj, selector, str, "string")
        if err:
            errs.append(F.invalid(Path(selector), "", err))
    return errs


# ---------------------------------------------------------------- admission


@dataclass
class Version:
    """What admission needs of one served CRD version."""

    group: str
    version: str
    kind: str
    schema: Schema | None
    status: bool = False
    scale: dict[str, Any] | None = None


def decode(obj: dict[str, Any], v: Version) -> dict[str, Any]:
    """Decoding + defaulting of a request body (or a stored object read back)."""
    if v.schema is None:
        return obj
    pruned = prune(obj, v.schema, resource_root=True)
    for key in _META:  # restored as the coercer does: pruning never touches them at the root
        if key in obj:
            pruned[key] = obj[key]
    return default(prune_nulls(pruned, v.schema), v.schema)


def _type_meta(obj: dict[str, Any], v: Version) -> list[FieldError]:
    errs = []
    if obj.get("kind") != v.kind:
        errs.append(F.invalid(Path("kind"), obj.get("kind", ""), f"must be {v.kind}"))
    want = f"{v.group}/{v.version}"
    if obj.get("apiVersion") != want:
        errs.append(F.invalid(Path("apiVersion"), obj.get("apiVersion", ""), f"must be {want}"))
    return errs


def _blocking(errs: list[FieldError]) -> bool:
    return any(e.type in openapi.BLOCKING for e in errs)


_NOT_CHECKED = F.FieldError(
    F.INVALID,
    "<nil>",
    None,
    "some validation rules were not checked because the object was invalid; correct the "
    "existing errors to complete validation",
)


def _body(obj: dict[str, Any], s: Schema) -> tuple[dict[str, Any], Schema]:
    """The object and schema as kube-openapi sees them: metadata is validated elsewhere."""
    props = {k: v for k, v in (s.get("properties") or {}).items() if k != "metadata"}
    return {k: v for k, v in obj.items() if k != "metadata"}, {**s, "properties": props}


def validate_create(obj: dict[str, Any], v: Version) -> list[FieldError]:
    """customResourceStrategy.Validate."""
    errs = _type_meta(obj, v)
    if errs:
        return errs
    if v.schema is not None:
        body, s = _body(obj, v.schema)
        errs += openapi.validate(body, s)
    errs += scale_errors(obj, v.scale, spec=True)
    if v.schema is not None:
        errs += list_sets_and_maps(F.ROOT, v.schema, obj)
        if _blocking(errs):
            errs.append(_NOT_CHECKED)
        else:
            errs += cel_validate(v.schema, obj, None)[0]
    return errs


def validate_update(
    new: dict[str, Any], old: dict[str, Any], v: Version, status_only: bool = False
) -> list[FieldError]:
    """customResourceStrategy.ValidateUpdate / statusStrategy.ValidateUpdate, with ratcheting."""
    errs = _type_meta(new, v)
    if errs:
        return errs
    s = v.schema
    if s is not None:
        if status_only:
            status_schema = (s.get("properties") or {}).get("status")
            if "status" in new and status_schema is not None:
                found = openapi.validate(new["status"], status_schema, Path("status"))
                errs += ratchet(found, new, old, s)
        else:
            body, body_schema = _body(new, s)
            errs += ratchet(openapi.validate(body, body_schema), new, old, s)
    if not status_only:
        errs += scale_errors(new, v.scale, spec=True)
    else:
        errs += scale_errors(new, v.scale, spec=False)
    if s is not None:
        new_list_errs = list_sets_and_maps(F.ROOT, s, new)
        if new_list_errs and not list_sets_and_maps(F.ROOT, s, old):
            errs += new_list_errs
        if _blocking(errs):
            errs.append(_NOT_CHECKED)
        else:
            errs += cel_validate(s, new, old, ratcheting=True)[0]
    return errs


def generation_changed(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """PrepareForUpdate: any change outside metadata bumps the generation."""
    return {k: v for k, v in old.items() if k != "metadata"} != {k: v for k, v in new.items() if k != "metadata"}


def admit(obj: dict[str, Any], s: Schema) -> tuple[dict[str, Any], list[FieldError]]:
    """Create-time admission of `obj` against a bare schema (no CRD around it): decode, then the
    schema, list-type and CEL checks of validate_create. For tests of a schema on its own."""
    stored = default(prune_nulls(prune(obj, s, resource_root=True), s), s)
    body, body_schema = _body(stored, s)
    errs = openapi.validate(body, body_schema) + list_sets_and_maps(F.ROOT, s, stored)
    if _blocking(errs):
        return stored, errs + [_NOT_CHECKED]
    return stored, errs + cel_validate(s, stored, None)[0]
