"""CustomResourceDefinition admission: the checks of the API server that a CRD can fail.

Ported from kubernetes/apiextensions-apiserver at 1aa2717a552ee6ca1e2a18f1f8ffccde981db923,
`pkg/apis/apiextensions/validation/validation.go`, function by function:

- `ValidateCustomResourceDefinition` -> `validate_crd` (metadata.name = plural.group)
- `validateCustomResourceDefinitionSpec` -> `_spec` (group, scope, names, versions, storage)
- `ValidateCustomResourceDefinitionNames` -> `_names`
- `validateCustomResourceDefinitionValidation` -> `_validation` (root restrictions with the status
  subresource, nullable root, then structural schema -> defaults -> OpenAPI/CEL checks)
- `ValidateCustomResourceDefinitionOpenAPISchema` -> `_openapi` (spec standard validator,
  uniqueItems, additionalProperties vs properties, map/list types, list-map keys,
  `validateMapListKeysMapSet`, the static checks of x-kubernetes-validations with `fieldPath` via
  `pathValid`/`ValidFieldPath`, and the CEL compilation of each rule, celcheck.py)
- `pkg/apiserver/schema/defaulting/validation.go` `ValidateDefaults` -> `_defaults` (pruned,
  schema-valid, CEL-valid defaults)
- `ValidateCustomResourceDefinitionSubresources` / `validateSimpleJSONPath` -> `_subresources`
- `ValidateCustomResourceColumnDefinition` -> `_column`

The v1 -> internal conversion (`apis/apiextensions/v1/conversion.go`) moves per-version schema,
subresources and printer columns to the top (`spec.validation`, `spec.subresources`,
`spec.additionalPrinterColumns`) when every version has the same; error paths follow that, so a
single-version CRD's schema errors read `spec.validation.openAPIV3Schema...`, as kubectl shows.

Not ported (cannot bite a CRD of ours, or need machinery we do not have): conversion webhooks,
selectable fields, deprecation warnings, CEL cost limits, messageExpression compilation, the
update-only ratchets of validateCustomResourceDefinitionUpdate, ObjectMeta checks of defaults
inside embedded resources.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from . import celcheck, openapi, schema, structural
from . import field as F
from .field import FieldError, Path

Obj = dict[str, Any]

_OPENAPI_TYPES = ["array", "boolean", "integer", "number", "object", "string"]
_PRINTER_TYPES = ["boolean", "date", "integer", "number", "string"]
_PRINTER_FORMATS = ["byte", "date", "date-time", "double", "float", "int32", "int64", "password"]
_REASONS = ["FieldValueDuplicate", "FieldValueForbidden", "FieldValueInvalid", "FieldValueRequired"]
_ALLOWED_AT_ROOT = [
    "Description",
    "Type",
    "Format",
    "Title",
    "Maximum",
    "ExclusiveMaximum",
    "Minimum",
    "ExclusiveMinimum",
    "MaxLength",
    "MinLength",
    "Pattern",
    "MaxItems",
    "MinItems",
    "UniqueItems",
    "MultipleOf",
    "Required",
    "Items",
    "Properties",
    "ExternalDocs",
    "Example",
    "XPreserveUnknownFields",
    "XValidations",
]
# JSON keys of JSONSchemaProps -> the Go field names allowedAtRootSchema compares against.
_GO_FIELD = {
    "description": "Description",
    "type": "Type",
    "format": "Format",
    "title": "Title",
    "maximum": "Maximum",
    "exclusiveMaximum": "ExclusiveMaximum",
    "minimum": "Minimum",
    "exclusiveMinimum": "ExclusiveMinimum",
    "maxLength": "MaxLength",
    "minLength": "MinLength",
    "pattern": "Pattern",
    "maxItems": "MaxItems",
    "minItems": "MinItems",
    "uniqueItems": "UniqueItems",
    "multipleOf": "MultipleOf",
    "required": "Required",
    "items": "Items",
    "properties": "Properties",
    "externalDocs": "ExternalDocs",
    "example": "Example",
    "x-kubernetes-preserve-unknown-fields": "XPreserveUnknownFields",
    "x-kubernetes-validations": "XValidations",
    "default": "Default",
    "enum": "Enum",
    "allOf": "AllOf",
    "anyOf": "AnyOf",
    "oneOf": "OneOf",
    "not": "Not",
    "additionalProperties": "AdditionalProperties",
    "nullable": "Nullable",
    "maxProperties": "MaxProperties",
    "minProperties": "MinProperties",
    "x-kubernetes-embedded-resource": "XEmbeddedResource",
    "x-kubernetes-int-or-string": "XIntOrString",
    "x-kubernetes-list-type": "XListType",
    "x-kubernetes-list-map-keys": "XListMapKeys",
    "x-kubernetes-map-type": "XMapType",
}
_NEWLINE = re.compile(r"[\n\r]+")


def _dns1035(value: str) -> list[str]:
    """`utilvalidation.IsDNS1035Label`."""
    errs = []
    if len(value) > 63:
        errs.append("must be no more than 63 characters")
    if not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", value):
        errs.append(
            "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an "
            "alphabetic character, and end with an alphanumeric character (e.g. 'my-name',  or 'abc-123', "
            "regex used for validation is '[a-z]([-a-z0-9]*[a-z0-9])?')"
        )
    return errs


def _dns1123_subdomain(value: str) -> list[str]:
    errs = []
    if len(value) > 253:
        errs.append("must be no more than 253 characters")
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*", value):
        errs.append(
            "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', "
            "and must start and end with an alphanumeric character (e.g. 'example.com', regex used for "
            "validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
        )
    return errs


def set_defaults(crd: Obj) -> Obj:
    """`SetDefaults_CustomResourceDefinitionSpec` (apis/apiextensions/v1/defaults.go): singular
    and listKind from kind, conversion strategy None. Applied before validation, as on decode."""
    crd = copy.deepcopy(crd)
    names = crd.setdefault("spec", {}).setdefault("names", {})
    if not names.get("singular"):
        names["singular"] = (names.get("kind") or "").lower()
    if not names.get("listKind") and names.get("kind"):
        names["listKind"] = names["kind"] + "List"
    crd["spec"].setdefault("conversion", {"strategy": "None"})
    return crd


def validate_crd(crd: Obj) -> list[FieldError]:
    """`ValidateCustomResourceDefinition` (create) for an apiextensions.k8s.io/v1 object,
    after the v1 defaults."""
    crd = set_defaults(crd)
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    errs: list[FieldError] = []
    name = (crd.get("metadata") or {}).get("name", "")
    if name != f"{names.get('plural', '')}.{spec.get('group', '')}":
        errs.append(F.invalid(Path("metadata", "name"), name, 'must be spec.names.plural+"."+spec.group'))
    errs += _spec(spec, Path("spec"))
    return _dedup(errs)


def _dedup(errs: list[FieldError]) -> list[FieldError]:
    seen, out = set(), []
    for e in errs:
        if str(e) not in seen:
            seen.add(str(e))
            out.append(e)
    return out


def _spec(spec: Obj, path: Path) -> list[FieldError]:
    errs: list[FieldError] = []
    group = spec.get("group") or ""
    if not group:
        errs.append(F.required(path.child("group"), ""))
    elif _dns1123_subdomain(group):
        errs.append(F.invalid(path.child("group"), group, ",".join(_dns1123_subdomain(group))))
    elif len(group.split(".")) < 2:
        errs.append(F.invalid(path.child("group"), group, "should be a domain with at least one dot"))
    scope = spec.get("scope") or ""
    if not scope:
        errs.append(F.required(path.child("scope"), ""))
    elif scope not in ("Cluster", "Namespaced"):
        errs.append(F.not_supported(path.child("scope"), scope, ["Cluster", "Namespaced"]))
    if spec.get("preserveUnknownFields") is True:
        errs.append(
            F.invalid(path.child("preserveUnknownFields"), True, "must be false in order to use defaults in the schema")
        )

    versions = spec.get("versions") or []
    # conversion.go: identical per-version fields move to the top level.
    same = lambda key: len(versions) > 0 and all(v.get(key) == versions[0].get(key) for v in versions)  # noqa: E731
    top_schema, top_sub, top_cols = same("schema"), same("subresources"), same("additionalPrinterColumns")
    storage, seen, unique = 0, set(), True
    for i, version in enumerate(versions):
        vpath = path.child("versions").index(i)
        storage += 1 if version.get("storage") else 0
        unique = unique and version.get("name") not in seen
        seen.add(version.get("name"))
        if _dns1035(version.get("name") or ""):
            errs.append(
                F.invalid(vpath.child("name"), version.get("name") or "", ",".join(_dns1035(version.get("name") or "")))
            )
        if not (version.get("schema") or {}).get("openAPIV3Schema") and not top_schema:
            errs.append(F.required(vpath.child("schema").child("openAPIV3Schema"), ""))
        status_on = "status" in (version.get("subresources") or {})
        if not top_schema:
            errs += _validation(version.get("schema"), status_on, vpath.child("schema"))
        if not top_sub:
            errs += _subresources(version.get("subresources"), vpath.child("subresources"))
        if not top_cols:
            for j, col in enumerate(version.get("additionalPrinterColumns") or []):
                errs += _column(col, vpath.child("additionalPrinterColumns").index(j))
    if not unique:
        errs.append(F.invalid(path.child("versions"), F.OMIT, "must contain unique version names"))
    if storage != 1:
        errs.append(
            F.invalid(path.child("versions"), F.OMIT, "must have exactly one version marked as storage version")
        )
    for key, what in (("plural", "plural"), ("singular", "singular"), ("kind", "kind"), ("listKind", "listKind")):
        if not (spec.get("names") or {}).get(key):
            errs.append(F.required(path.child("names", what), ""))
    errs += _names(spec.get("names") or {}, path.child("names"))
    if versions:
        if top_schema and (versions[0].get("schema") or {}).get("openAPIV3Schema") is None:
            errs += [
                F.required(path.child("versions").index(i).child("schema").child("openAPIV3Schema"), "")
                for i in range(len(versions))
            ]
        if top_schema:
            status_on = any("status" in (v.get("subresources") or {}) for v in versions)
            errs += _validation(versions[0].get("schema"), status_on, path.child("validation"))
        if top_sub:
            errs += _subresources(versions[0].get("subresources"), path.child("subresources"))
        if top_cols:
            for j, col in enumerate(versions[0].get("additionalPrinterColumns") or []):
                errs += _column(col, path.child("additionalPrinterColumns").index(j))
    return errs


def _names(names: Obj, path: Path) -> list[FieldError]:
    errs = []
    for key in ("plural", "singular"):
        if names.get(key) and _dns1035(names[key]):
            errs.append(F.invalid(path.child(key), names[key], ",".join(_dns1035(names[key]))))
    for key in ("kind", "listKind"):
        if names.get(key) and _dns1035(names[key].lower()):
            errs.append(
                F.invalid(
                    path.child(key),
                    names[key],
                    "may have mixed case, but should otherwise match: " + ",".join(_dns1035(names[key].lower())),
                )
            )
    for key in ("shortNames", "categories"):
        for i, value in enumerate(names.get(key) or []):
            if _dns1035(value):
                errs.append(F.invalid(path.child(key).index(i), value, ",".join(_dns1035(value))))
    if names.get("kind") and names.get("kind") == names.get("listKind"):
        errs.append(F.invalid(path.child("listKind"), names["listKind"], "kind and listKind may not be the same"))
    return errs


def _column(col: Obj, path: Path) -> list[FieldError]:
    """`ValidateCustomResourceColumnDefinition`: note upstream does not resolve the JSONPath
    against the schema, it only checks that it is a simple path."""
    errs = []
    if not col.get("name"):
        errs.append(F.required(path.child("name"), ""))
    type_ = col.get("type") or ""
    if not type_:
        errs.append(F.required(path.child("type"), f"must be one of {','.join(_PRINTER_TYPES)}"))
    elif type_ not in _PRINTER_TYPES:
        errs.append(F.invalid(path.child("type"), type_, f"must be one of {','.join(_PRINTER_TYPES)}"))
    if col.get("format") and col["format"] not in _PRINTER_FORMATS:
        errs.append(F.invalid(path.child("format"), col["format"], f"must be one of {','.join(_PRINTER_FORMATS)}"))
    if not col.get("jsonPath"):
        errs.append(F.required(path.child("JSONPath"), ""))
    else:
        errs += _simple_json_path(col["jsonPath"], path.child("JSONPath"))
    return errs


def _simple_json_path(s: str, path: Path) -> list[FieldError]:
    if not s:
        return [F.invalid(path, s, "must not be empty")]
    if s[0] != ".":
        return [F.invalid(path, s, "must be a simple json path starting with .")]
    return []


def _subresources(sub: Obj | None, path: Path) -> list[FieldError]:
    """`ValidateCustomResourceDefinitionSubresources`: scale paths are simple JSON paths under
    .spec / .status (upstream does not check that they exist or are integers at this point; the
    custom resource's writes are checked instead: schema.scale_errors)."""
    errs: list[FieldError] = []
    scale = (sub or {}).get("scale")
    if scale is None:
        return errs
    for key, prefixes, where in (
        ("specReplicasPath", (".spec.",), ".spec"),
        ("statusReplicasPath", (".status.",), ".status"),
    ):
        value = scale.get(key) or ""
        p = path.child(f"scale.{key}")
        if not value:
            errs.append(F.required(p, ""))
        elif _simple_json_path(value, p):
            errs += _simple_json_path(value, p)
        elif not value.startswith(prefixes):
            errs.append(F.invalid(p, value, f"should be a json path under {where}"))
    selector = scale.get("labelSelectorPath")
    if selector:
        p = path.child("scale.labelSelectorPath")
        if _simple_json_path(selector, p):
            errs += _simple_json_path(selector, p)
        elif not selector.startswith((".spec.", ".status.")):
            errs.append(F.invalid(p, selector, "should be a json path under either .spec or .status"))
    return errs


# ---------------------------------------------------------------- the schema


def _validation(validation: Obj | None, status_on: bool, path: Path) -> list[FieldError]:
    """`validateCustomResourceDefinitionValidation`."""
    errs: list[FieldError] = []
    s = (validation or {}).get("openAPIV3Schema")
    if s is None:
        return errs
    if status_on:
        for key, value in s.items():
            if value is None or value is False or value == "" or value == [] or value == {}:
                continue  # Go zero values are skipped
            go_name = _GO_FIELD.get(key, key)
            if go_name == "Type":
                if value != "object":
                    errs.append(
                        F.invalid(
                            path.child("openAPIV3Schema.type"),
                            value,
                            'only "object" is allowed as the type at the root of the schema if the '
                            "status subresource is enabled",
                        )
                    )
                    break
                continue
            if go_name not in _ALLOWED_AT_ROOT:
                errs.append(
                    F.invalid(
                        path.child("openAPIV3Schema"),
                        F.OMIT,
                        f"only [{' '.join(_ALLOWED_AT_ROOT)}] fields are allowed at the root of the "
                        "schema if the status subresource is enabled",
                    )
                )
                break
    if s.get("nullable") is True:
        errs.append(F.forbidden(path.child("openAPIV3Schema.nullable"), "nullable cannot be true at the root"))
    root = path.child("openAPIV3Schema")
    cel_ok = False
    init_error = structural.unsupported_field(s)
    init_errs = [F.invalid(root, "", init_error)] if init_error else []
    if not init_error:
        found = structural.validate_structural(root, s)
        if found:
            errs += found
        else:
            found = _defaults(root, s)
            errs += found
            cel_ok = not found
    schema_errs, cel_errs = _openapi(s, root, _Ctx(), is_root=True, cel_ok=cel_ok, resource_root=True)
    errs += schema_errs + cel_errs
    if not errs and init_errs:
        errs += init_errs
    return errs


class _Ctx:
    """specStandardValidatorV3's state while descending."""

    def __init__(
        self,
        allow_defaults: bool = True,
        reason: str = "",
        inside_meta: bool = False,
        uncorrelatable: Path | None = None,
    ) -> None:
        self.allow_defaults, self.reason, self.inside_meta, self.uncorrelatable = (
            allow_defaults,
            reason,
            inside_meta,
            uncorrelatable,
        )

    def forbid_defaults(self, reason: str) -> _Ctx:
        return _Ctx(False, reason, self.inside_meta, self.uncorrelatable)

    def meta(self) -> _Ctx:
        return _Ctx(self.allow_defaults, self.reason, True, self.uncorrelatable)

    def forbid_old_self(self, path: Path) -> _Ctx:
        return (
            self if self.uncorrelatable is not None else _Ctx(self.allow_defaults, self.reason, self.inside_meta, path)
        )


def _standard(s: Obj, path: Path, ctx: _Ctx) -> list[FieldError]:
    """`specStandardValidatorV3.validate`."""
    errs = []
    type_ = s.get("type") or ""
    if type_ and type_ not in _OPENAPI_TYPES:
        errs.append(F.not_supported(path.child("type"), type_, _OPENAPI_TYPES))
    if s.get("default") is not None and not ctx.allow_defaults:
        errs.append(F.forbidden(path.child("default"), "must not be set" + (f" {ctx.reason}" if ctx.reason else "")))
    for key, what in (
        ("id", "id is not supported"),
        ("additionalItems", "additionalItems is not supported"),
        ("patternProperties", "patternProperties is not supported"),
        ("definitions", "definitions is not supported"),
        ("dependencies", "dependencies is not supported"),
        ("$ref", "$ref is not supported"),
    ):
        if key in s and s[key] not in (None, "", {}):
            errs.append(F.forbidden(path.child(key), what))
    if type_ == "null":
        errs.append(F.forbidden(path.child("type"), "type cannot be set to null, use nullable as an alternative"))
    if isinstance(s.get("items"), list):
        errs.append(F.forbidden(path.child("items"), "items must be a schema object and not an array"))
    if ctx.inside_meta and s.get("x-kubernetes-embedded-resource") is True:
        errs.append(
            F.forbidden(path.child("x-kubernetes-embedded-resource"), "must not be used inside of resource meta")
        )
    return errs


def _openapi(
    s: Obj | None, path: Path, ctx: _Ctx, is_root: bool, cel_ok: bool, resource_root: bool = False
) -> tuple[list[FieldError], list[FieldError]]:
    """`ValidateCustomResourceDefinitionOpenAPISchema`: (schema errors, CEL errors)."""
    schema_errs: list[FieldError] = []
    cel_errs: list[FieldError] = []
    if s is None:
        return schema_errs, cel_errs
    schema_errs += _standard(s, path, ctx)
    if s.get("uniqueItems") is True:
        schema_errs.append(
            F.forbidden(
                path.child("uniqueItems"),
                "uniqueItems cannot be set to true since the runtime complexity becomes quadratic",
            )
        )
    extra = s.get("additionalProperties")
    if extra is not None:
        if s.get("properties") and (extra is False or isinstance(extra, dict)):
            schema_errs.append(
                F.forbidden(
                    path.child("additionalProperties"), "additionalProperties and properties are mutual exclusive"
                )
            )
        sub_ctx = (
            ctx.forbid_defaults("inside additionalProperties applying to object metadata") if ctx.inside_meta else ctx
        )
        if isinstance(extra, dict):
            a, b = _openapi(extra, path.child("additionalProperties"), sub_ctx, False, cel_ok)
            schema_errs += a
            cel_errs += b
    embedded = s.get("x-kubernetes-embedded-resource") is True
    for name, prop in sorted((s.get("properties") or {}).items()):
        sub_ctx = ctx
        if s.get("x-kubernetes-map-type") not in (None, "granular", "atomic"):
            sub_ctx = sub_ctx.forbid_old_self(path)
        if (is_root or embedded) and name in ("metadata", "kind", "apiVersion"):
            sub_ctx = sub_ctx.meta()
            if is_root:
                sub_ctx = sub_ctx.forbid_defaults(f"in top-level {name}")
        a, b = _openapi(
            prop,
            path.child("properties").key(name),
            sub_ctx,
            False,
            cel_ok,
            resource_root=prop.get("x-kubernetes-embedded-resource") is True,
        )
        schema_errs += a
        cel_errs += b
    if isinstance(s.get("not"), dict):
        schema_errs += _openapi(s["not"], path.child("not"), ctx, False, False)[0]
    for key in ("allOf", "oneOf", "anyOf"):
        for i, sub in enumerate(s.get(key) or []):
            schema_errs += _openapi(sub, path.child(key).index(i), ctx, False, False)[0]
    items = s.get("items")
    if isinstance(items, dict):
        sub_ctx = ctx if s.get("x-kubernetes-list-type") == "map" else ctx.forbid_old_self(path)
        a, b = _openapi(
            items,
            path.child("items"),
            sub_ctx,
            False,
            cel_ok,
            resource_root=items.get("x-kubernetes-embedded-resource") is True,
        )
        schema_errs += a
        cel_errs += b
    if s.get("x-kubernetes-preserve-unknown-fields") is False:
        schema_errs.append(
            F.invalid(path.child("x-kubernetes-preserve-unknown-fields"), False, "must be true or undefined")
        )
    schema_errs += _map_and_list_types(s, path)
    schema_errs += _map_list_keys_map_set(s, path)
    schema_errs += _rules_static(s, path)
    if not schema_errs and cel_ok and s.get("x-kubernetes-validations"):
        cel_errs += _rules_compile(s, path, ctx, resource_root or is_root)
    return schema_errs, cel_errs


def _map_and_list_types(s: Obj, path: Path) -> list[FieldError]:
    errs: list[FieldError] = []
    type_ = s.get("type") or ""
    map_type, list_type = s.get("x-kubernetes-map-type"), s.get("x-kubernetes-list-type")
    if map_type is not None and type_ != "object":
        errs.append(
            F.required(path.child("type"), "must be object if x-kubernetes-map-type is specified")
            if not type_
            else F.invalid(path.child("type"), type_, "must be object if x-kubernetes-map-type is specified")
        )
    if map_type is not None and map_type not in ("atomic", "granular"):
        errs.append(F.not_supported(path.child("x-kubernetes-map-type"), map_type, ["atomic", "granular"]))
    items = s.get("items") if isinstance(s.get("items"), dict) else None
    if list_type is not None and type_ != "array":
        errs.append(
            F.required(path.child("type"), "must be array if x-kubernetes-list-type is specified")
            if not type_
            else F.invalid(path.child("type"), type_, "must be array if x-kubernetes-list-type is specified")
        )
    elif list_type == "set" and items is not None:
        if items.get("type") == "array" and items.get("x-kubernetes-list-type") not in (None, "atomic"):
            errs.append(
                F.invalid(
                    path.child("items").child("x-kubernetes-list-type"),
                    items["x-kubernetes-list-type"],
                    "must be atomic as item of a list with x-kubernetes-list-type=set",
                )
            )
        if items.get("type") == "object" and items.get("x-kubernetes-map-type") != "atomic":
            errs.append(
                F.invalid(
                    path.child("items").child("x-kubernetes-map-type"),
                    items.get("x-kubernetes-list-type"),
                    "must be atomic as item of a list with x-kubernetes-list-type=set",
                )
            )
    if list_type is not None and list_type not in ("atomic", "set", "map"):
        errs.append(F.not_supported(path.child("x-kubernetes-list-type"), list_type, ["atomic", "set", "map"]))
    keys = s.get("x-kubernetes-list-map-keys") or []
    if keys:
        if list_type is None:
            errs.append(
                F.required(
                    path.child("x-kubernetes-list-type"), "must be map if x-kubernetes-list-map-keys is non-empty"
                )
            )
        elif list_type != "map":
            errs.append(
                F.invalid(
                    path.child("x-kubernetes-list-type"),
                    list_type,
                    "must be map if x-kubernetes-list-map-keys is non-empty",
                )
            )
    if list_type == "map":
        if not keys:
            errs.append(
                F.required(
                    path.child("x-kubernetes-list-map-keys"), "must not be empty if x-kubernetes-list-type is map"
                )
            )
        if "items" not in s:
            errs.append(F.required(path.child("items"), "must have a schema if x-kubernetes-list-type is map"))
        if isinstance(s.get("items"), list):
            errs.append(
                F.invalid(
                    path.child("items"), F.OMIT, "must only have a single schema if x-kubernetes-list-type is map"
                )
            )
        if items is not None and items.get("type") != "object":
            errs.append(
                F.invalid(
                    path.child("items").child("type"),
                    items.get("type") or "",
                    "must be object if parent array's x-kubernetes-list-type is map",
                )
            )
        if items is not None and items.get("type") == "object":
            seen: set[str] = set()
            for k in keys:
                prop = (items.get("properties") or {}).get(k)
                if prop is not None:
                    if prop.get("type") in ("array", "object"):
                        errs.append(
                            F.invalid(
                                path.child("items").child("properties").key(k).child("type"),
                                items.get("type"),
                                "must be a scalar type if parent array's x-kubernetes-list-type is map",
                            )
                        )
                else:
                    errs.append(
                        F.invalid(
                            path.child("x-kubernetes-list-map-keys"),
                            keys,
                            "entries must all be names of item properties",
                        )
                    )
                if k in seen:
                    errs.append(
                        F.invalid(path.child("x-kubernetes-list-map-keys"), keys, "must not contain duplicate entries")
                    )
                seen.add(k)
    return errs


def _map_list_keys_map_set(s: Obj, path: Path) -> list[FieldError]:
    """`validateMapListKeysMapSet`: set/map items not nullable; map keys required or defaulted."""
    items = s.get("items") if isinstance(s.get("items"), dict) else None
    list_type = s.get("x-kubernetes-list-type")
    if items is None or list_type not in ("set", "map"):
        return []
    errs = []
    if items.get("nullable") is True:
        errs.append(
            F.forbidden(
                path.child("items").child("nullable"), f"cannot be nullable when x-kubernetes-list-type is {list_type}"
            )
        )
    if list_type == "map":
        required = set(items.get("required") or [])
        for k in s.get("x-kubernetes-list-map-keys") or []:
            prop = (items.get("properties") or {}).get(k)
            if prop is None:
                continue
            if k not in required and prop.get("default") is None:
                errs.append(
                    F.required(
                        path.child("items").child("properties").key(k).child("default"),
                        "this property is in x-kubernetes-list-map-keys, so it must have a default or "
                        "be a required property",
                    )
                )
            if prop.get("nullable") is True:
                errs.append(
                    F.forbidden(
                        path.child("items").child("properties").key(k).child("nullable"),
                        "this property is in x-kubernetes-list-map-keys, so it cannot be nullable",
                    )
                )
    return errs


def _rules_static(s: Obj, path: Path) -> list[FieldError]:
    """The x-kubernetes-validations checks that need no CEL: rule, message, reason, fieldPath."""
    errs: list[FieldError] = []
    for i, rule in enumerate(s.get("x-kubernetes-validations") or []):
        p = path.child("x-kubernetes-validations").index(i)
        text, msg = (rule.get("rule") or "").strip(), (rule.get("message") or "").strip()
        if not text:
            errs.append(F.required(p.child("rule"), "rule is not specified"))
        elif rule.get("message") and not msg:
            errs.append(F.invalid(p.child("message"), rule["message"], "must be non-empty if specified"))
        elif _NEWLINE.search(msg):
            errs.append(F.invalid(p.child("message"), rule["message"], "must not contain line breaks"))
        elif _NEWLINE.search(text) and not msg:
            errs.append(F.required(p.child("message"), "message must be specified if rule contains line breaks"))
        if (
            rule.get("messageExpression") is not None
            and rule["messageExpression"] != ""
            and not rule["messageExpression"].strip()
        ):
            errs.append(F.required(p.child("messageExpression"), "messageExpression must be non-empty if specified"))
        if rule.get("reason") is not None and rule["reason"] not in _REASONS:
            errs.append(F.not_supported(p.child("reason"), rule["reason"], _REASONS))
        fp = rule.get("fieldPath")
        if fp and not fp.strip():
            errs.append(F.invalid(p.child("fieldPath"), fp, "must be non-empty if specified"))
        if fp and _NEWLINE.search(fp):
            errs.append(F.invalid(p.child("fieldPath"), fp, "must not contain line breaks"))
        if fp and not structural.unsupported_field(s):
            try:
                celcheck.valid_field_path(fp, s)
            except celcheck.FieldPathError:
                errs.append(F.invalid(p.child("fieldPath"), fp, "must be a valid path"))
    return errs


def _rules_compile(s: Obj, path: Path, ctx: _Ctx, resource_root: bool) -> list[FieldError]:
    errs: list[FieldError] = []
    self_type = celcheck.decl_type(s, resource_root)
    for i, rule in enumerate(s.get("x-kubernetes-validations") or []):
        p = path.child("x-kubernetes-validations").index(i)
        compiled = celcheck.compile_rule(rule.get("rule") or "", self_type, rule.get("optionalOldSelf") is True)
        if compiled.error:
            errs.append(F.invalid(p.child("rule"), _go_rule(rule), compiled.error))
        if compiled.uses_old_self:
            if ctx.uncorrelatable is not None:
                errs.append(
                    F.invalid(
                        p.child("rule"),
                        rule.get("rule"),
                        f"oldSelf cannot be used on the uncorrelatable portion of the schema within "
                        f"{ctx.uncorrelatable}",
                    )
                )
        elif rule.get("optionalOldSelf") is not None and not compiled.error:
            errs.append(
                F.invalid(
                    p.child("optionalOldSelf"), rule["optionalOldSelf"], "may not be set if oldSelf is not used in rule"
                )
            )
    return errs


def _go_rule(rule: Obj) -> F.GoStruct:
    """How the internal ValidationRule struct (no json tags) prints as a bad value."""
    return F.GoStruct(
        Rule=rule.get("rule", ""),
        Message=rule.get("message", ""),
        MessageExpression=rule.get("messageExpression", ""),
        Reason=rule.get("reason"),
        FieldPath=rule.get("fieldPath", ""),
        OptionalOldSelf=rule.get("optionalOldSelf"),
    )


# ---------------------------------------------------------------- defaults (defaulting/validation.go)


def _defaults(path: Path, s: Obj) -> list[FieldError]:
    """`ValidateDefaults` with requirePrunedDefaults: every default is pruned, valid against its
    node's schema and passes its node's CEL rules (evaluated on the default as it is, with
    oldSelf = the default)."""
    root = {**s, "x-kubernetes-embedded-resource": True}
    return _default_walk(path, root, inside_meta=False)


def _default_walk(path: Path, s: Obj, inside_meta: bool) -> list[FieldError]:
    errs: list[FieldError] = []
    if s.get("x-kubernetes-embedded-resource") is True:
        inside_meta = False
    value = s.get("default")
    if value is not None and not inside_meta:
        pruned = schema.prune(copy.deepcopy(value), s, resource_root=s.get("x-kubernetes-embedded-resource") is True)
        if pruned != value:
            errs.append(F.invalid(path.child("default"), value, "must not have unknown fields"))
        found = openapi.validate(value, s, path.child("default"))
        if found:
            errs += found
        else:
            errs += schema.cel_validate(s, value, value, path.child("default"), resource_root=False)[0]
    items = s.get("items")
    if isinstance(items, dict):
        errs += _default_walk(path.child("items"), items, inside_meta)
    embedded = s.get("x-kubernetes-embedded-resource") is True
    for name, prop in sorted((s.get("properties") or {}).items()):
        sub_meta = inside_meta or (embedded and name in ("metadata", "apiVersion", "kind"))
        errs += _default_walk(path.child("properties").key(name), prop, sub_meta)
    return errs
