"""The emulator refuses what the API server refuses, with the API server's words.

Each case is a small CRD that an upstream function of kubernetes/apiextensions-apiserver refuses
(read at commit 1aa2717a552ee6ca1e2a18f1f8ffccde981db923; the function and file are named in the
case), posted to the emulator over HTTP as kubectl would. The expected text is derived from the
upstream code: the field path the function builds and its message, as `field.Error.Error()`
prints them. A single-version CRD's schema, subresources and printer columns move to
`spec.validation`, `spec.subresources`, `spec.additionalPrinterColumns` in the internal version
(apis/apiextensions/v1/conversion.go), which is where the errors point.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from kube_emulator import EmulatorThread  # noqa: E402
from pdserve_operator import crd as pdcrd  # noqa: E402

CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
V = "spec.validation.openAPIV3Schema"
COMMIT = "1aa2717a552ee6ca1e2a18f1f8ffccde981db923"


class Api:
    """POSTs CRDs to the emulator as kubectl would (JSON, a bearer token)."""

    def __init__(self, url: str) -> None:
        self.client = httpx.Client(base_url=url, headers={"Authorization": "Bearer admin"}, timeout=30)

    def post(self, doc: dict[str, Any]) -> httpx.Response:
        return self.client.post(CRDS, json=doc)


@pytest.fixture(scope="module")
def kube() -> Iterator[Api]:
    with EmulatorThread() as emu:
        api = Api(emu.url)
        yield api
        api.client.close()


def crd(
    spec_schema: dict[str, Any] | None = None,
    *,
    root: dict[str, Any] | None = None,
    subresources: dict[str, Any] | None = None,
    columns: list[dict[str, Any]] | None = None,
    plural: str = "widgets",
) -> dict[str, Any]:
    """A minimal valid CRD whose `spec` property (or whole root schema) a case replaces."""
    schema = root or {"type": "object", "properties": {"spec": spec_schema or {"type": "object"}}}
    version: dict[str, Any] = {"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": schema}}
    if subresources is not None:
        version["subresources"] = subresources
    if columns is not None:
        version["additionalPrinterColumns"] = columns
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.example.com"},
        "spec": {
            "group": "example.com",
            "scope": "Namespaced",
            "names": {"plural": plural, "singular": plural[:-1], "kind": "Widget"},
            "versions": [version],
        },
    }


_n = iter(range(10_000))


def _renamed(doc: dict[str, Any]) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    plural = f"widgets{next(_n)}"
    doc["metadata"]["name"] = f"{plural}.example.com"
    doc["spec"]["names"].update(plural=plural, singular=plural[:-1])
    return doc


def refused(kube: Api, doc: dict[str, Any]) -> list[str]:
    """POST the CRD under a fresh name; return the causes (`field: message`) of the 422 Status."""
    rsp = kube.post(_renamed(doc))
    assert rsp.status_code == 422, rsp.text
    status = rsp.json()
    assert status["reason"] == "Invalid" and status["kind"] == "Status"
    causes = status["details"]["causes"]
    for cause in causes:  # each cause is also in the message, as NewInvalid aggregates them
        assert f"{cause['field']}: {cause['message']}" in status["message"]
    return [f"{c['field']}: {c['message']}" for c in causes]


def accepted(kube: Api, doc: dict[str, Any]) -> None:
    rsp = kube.post(_renamed(doc))
    assert rsp.status_code == 201, rsp.text


S = {"type": "string"}
INT = {"type": "integer"}

# (case id, CRD, the expected error text, upstream function in file)
CASES: list[tuple[str, dict[str, Any], str, str]] = [
    # ---- pkg/apiserver/schema/validation.go
    (
        "metadata-description",
        crd(
            root={
                "type": "object",
                "properties": {"metadata": {"type": "object", "description": "Standard object metadata."}},
            }
        ),
        f"{V}.properties[metadata]: Forbidden: must not specify anything other than name and generateName, but metadata "
        "is implicitly specified",
        "validateStructuralMetadataInvariants in pkg/apiserver/schema/validation.go",
    ),
    (
        "metadata-other-field",
        crd(
            root={
                "type": "object",
                "properties": {"metadata": {"type": "object", "properties": {"labels": {"type": "object"}}}},
            }
        ),
        f"{V}.properties[metadata]: Forbidden: must not specify anything other than name and generateName, but metadata "
        "is implicitly specified",
        "validateStructuralMetadataInvariants in pkg/apiserver/schema/validation.go",
    ),
    (
        "field-without-type",
        crd({"type": "object", "properties": {"x": {"description": "no type"}}}),
        f"{V}.properties[spec].properties[x].type: Required value: must not be empty for specified object fields",
        "validateStructuralInvariants in pkg/apiserver/schema/validation.go",
    ),
    (
        "items-without-type",
        crd({"type": "object", "properties": {"l": {"type": "array", "items": {"description": "x"}}}}),
        f"{V}.properties[spec].properties[l].items.type: Required value: must not be empty for specified array items",
        "validateStructuralInvariants in pkg/apiserver/schema/validation.go",
    ),
    (
        "array-without-items",
        crd({"type": "object", "properties": {"l": {"type": "array"}}}),
        f"{V}.properties[spec].properties[l].items: Required value: must be specified",
        "validateStructuralInvariants in pkg/apiserver/schema/validation.go",
    ),
    (
        "root-not-object",
        crd(root={"type": "string"}),
        f'{V}.type: Invalid value: "string": must be object at the root',
        "validateStructuralInvariants in pkg/apiserver/schema/validation.go",
    ),
    (
        "additional-properties-at-root",
        crd(root={"type": "object", "additionalProperties": {"type": "string"}}),
        f"{V}.additionalProperties: Forbidden: must not be used at the root",
        "validateStructuralInvariants in pkg/apiserver/schema/validation.go",
    ),
    (
        "kind-not-string",
        crd(root={"type": "object", "properties": {"kind": INT}}),
        f'{V}.properties[kind].type: Invalid value: "integer": must be string',
        "validateStructuralInvariants in pkg/apiserver/schema/validation.go",
    ),
    (
        "int-or-string-and-preserve",
        crd(
            {
                "type": "object",
                "properties": {"x": {"x-kubernetes-int-or-string": True, "x-kubernetes-preserve-unknown-fields": True}},
            }
        ),
        f"{V}.properties[spec].properties[x].x-kubernetes-preserve-unknown-fields: Invalid value: true: must be false if "
        "x-kubernetes-int-or-string is true",
        "validateExtensions in pkg/apiserver/schema/validation.go",
    ),
    (
        "description-in-anyof",
        crd({"type": "object", "properties": {"x": {"type": "string", "anyOf": [{"description": "d"}]}}}),
        f"{V}.properties[spec].properties[x].anyOf[0].description: Forbidden: must be empty to be structural",
        "validateNestedValueValidation in pkg/apiserver/schema/validation.go",
    ),
    (
        "type-in-allof",
        crd({"type": "object", "properties": {"x": {"type": "string", "allOf": [{"type": "string"}]}}}),
        f"{V}.properties[spec].properties[x].allOf[0].type: Forbidden: must be empty to be structural",
        "validateNestedValueValidation in pkg/apiserver/schema/validation.go",
    ),
    (
        "default-in-oneof",
        crd({"type": "object", "properties": {"x": {"type": "string", "oneOf": [{"default": "a"}]}}}),
        f"{V}.properties[spec].properties[x].oneOf[0].default: Forbidden: must be undefined to be structural",
        "validateNestedValueValidation in pkg/apiserver/schema/validation.go",
    ),
    (
        "rules-in-not",
        crd(
            {
                "type": "object",
                "properties": {"x": {"type": "string", "not": {"x-kubernetes-validations": [{"rule": "self == 'a'"}]}}},
            }
        ),
        f"{V}.properties[spec].properties[x].not.x-kubernetes-validations: Forbidden: must be empty to be structural",
        "validateNestedValueValidation in pkg/apiserver/schema/validation.go",
    ),
    (
        "metadata-nested",
        crd(
            {
                "type": "object",
                "properties": {"metadata": {"type": "object"}},
                "anyOf": [{"properties": {"metadata": {}}}],
            }
        ),
        f"{V}.properties[spec].anyOf[0].properties[metadata]: Forbidden: must not be specified in a nested context",
        "validateNestedValueValidation in pkg/apiserver/schema/validation.go",
    ),
    (
        "int-or-string-pattern-broken",
        crd(
            {
                "type": "object",
                "properties": {
                    "x": {
                        "x-kubernetes-int-or-string": True,
                        "anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}],
                    }
                },
            }
        ),
        f"{V}.properties[spec].properties[x].anyOf[0].type: Forbidden: must be empty to be structural",
        "validateNestedValueValidation (isIntOrStringAnyOfPattern) in pkg/apiserver/schema/validation.go",
    ),
    (
        "pattern-not-re2",
        crd({"type": "object", "properties": {"x": {"type": "string", "pattern": "^(?!kube-).*$"}}}),
        # Go's regexp (RE2 syntax) has no lookahead. The detail after "isn't: " is RE2's wording; Go
        # prints "error parsing regexp: invalid or unsupported Perl syntax: `(?!`".
        f'{V}.properties[spec].properties[x].pattern: Invalid value: "^(?!kube-).*$": must be a valid regular '
        "expression, but isn't: invalid perl operator: (?!",
        "validateValueValidation in pkg/apiserver/schema/validation.go (regexp.Compile)",
    ),
    # ---- pkg/apiserver/schema/complete.go
    # (upstream checks completeness of the root's junctors only: validateStructuralCompleteness
    # starts from the root's ValueValidation and follows nothing but the junctors' own nesting)
    (
        "junctor-field-not-specified",
        crd(root={"type": "object", "properties": {"spec": {"type": "object"}}, "anyOf": [{"properties": {"y": {}}}]}),
        f"{V}.properties[y]: Required value: because it is defined in {V}.anyOf[0].properties[y]",
        "validateStructuralCompleteness in pkg/apiserver/schema/complete.go",
    ),
    (
        "junctor-items-not-specified",
        crd(root={"type": "object", "properties": {"spec": {"type": "object"}}, "allOf": [{"items": {}}]}),
        f"{V}.items: Required value: because it is defined in {V}.allOf[0].items",
        "validateNestedValueValidationCompleteness in pkg/apiserver/schema/complete.go",
    ),
    # ---- pkg/apiserver/schema/defaulting/validation.go (ValidateDefaults, requirePrunedDefaults)
    (
        "default-not-pruned",
        crd({"type": "object", "properties": {"a": INT}, "default": {"bogus": 1}}),
        f'{V}.properties[spec].default: Invalid value: {{"bogus":1}}: must not have unknown fields',
        "validate (ValidateDefaults) in pkg/apiserver/schema/defaulting/validation.go",
    ),
    (
        "default-invalid",
        crd({"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}, "default": {"n": 0}}),
        f"{V}.properties[spec].default.n: Invalid value: 0: n in body should be greater than or equal to 1",
        "validate (ValidateDefaults) in pkg/apiserver/schema/defaulting/validation.go",
    ),
    (
        "default-fails-its-rule",
        crd(
            {
                "type": "object",
                "properties": {"a": INT},
                "default": {},
                "x-kubernetes-validations": [{"rule": "self.a > 0"}],
            }
        ),
        f'{V}.properties[spec].default: Invalid value: "object": no such key: a evaluating rule: self.a > 0',
        "validate (ValidateDefaults) in pkg/apiserver/schema/defaulting/validation.go + validateExpressions in "
        "pkg/apiserver/schema/cel/validation.go",
    ),
    # ---- pkg/apis/apiextensions/validation/validation.go
    (
        "default-in-metadata",
        crd(
            root={
                "type": "object",
                "properties": {
                    "metadata": {"type": "object", "properties": {"name": {"type": "string", "default": "x"}}}
                },
            }
        ),
        f"{V}.properties[metadata].properties[name].default: Forbidden: must not be set in top-level metadata",
        "specStandardValidatorV3.validate in pkg/apis/apiextensions/validation/validation.go",
    ),
    (
        "unique-items",
        crd({"type": "object", "properties": {"l": {"type": "array", "items": S, "uniqueItems": True}}}),
        f"{V}.properties[spec].properties[l].uniqueItems: Forbidden: uniqueItems cannot be set to true since the runtime "
        "complexity becomes quadratic",
        "ValidateCustomResourceDefinitionOpenAPISchema in pkg/apis/apiextensions/validation/validation.go",
    ),
    (
        "properties-and-additional-properties",
        crd({"type": "object", "properties": {"a": S}, "additionalProperties": S}),
        f"{V}.properties[spec].additionalProperties: Forbidden: additionalProperties and properties are mutual exclusive",
        "ValidateCustomResourceDefinitionOpenAPISchema in pkg/apis/apiextensions/validation/validation.go",
    ),
    (
        "unknown-type",
        crd({"type": "object", "properties": {"a": {"type": "float"}}}),
        f'{V}.properties[spec].properties[a].type: Unsupported value: "float": supported values: "array", "boolean", '
        '"integer", "number", "object", "string"',
        "specStandardValidatorV3.validate in pkg/apis/apiextensions/validation/validation.go",
    ),
    (
        "list-map-key-not-required",
        crd(
            {
                "type": "object",
                "properties": {
                    "l": {
                        "type": "array",
                        "x-kubernetes-list-type": "map",
                        "x-kubernetes-list-map-keys": ["name"],
                        "items": {"type": "object", "properties": {"name": S}},
                    }
                },
            }
        ),
        f"{V}.properties[spec].properties[l].items.properties[name].default: Required value: this property is in "
        "x-kubernetes-list-map-keys, so it must have a default or be a required property",
        "validateMapListKeysMapSet in pkg/apis/apiextensions/validation/validation.go",
    ),
    (
        "list-map-keys-without-map",
        crd(
            {
                "type": "object",
                "properties": {
                    "l": {
                        "type": "array",
                        "x-kubernetes-list-map-keys": ["name"],
                        "items": {"type": "object", "required": ["name"], "properties": {"name": S}},
                    }
                },
            }
        ),
        f"{V}.properties[spec].properties[l].x-kubernetes-list-type: Required value: must be map if "
        "x-kubernetes-list-map-keys is non-empty",
        "ValidateCustomResourceDefinitionOpenAPISchema in pkg/apis/apiextensions/validation/validation.go",
    ),
    (
        "list-map-key-not-a-property",
        crd(
            {
                "type": "object",
                "properties": {
                    "l": {
                        "type": "array",
                        "x-kubernetes-list-type": "map",
                        "x-kubernetes-list-map-keys": ["nope"],
                        "items": {"type": "object", "properties": {"name": S}},
                    }
                },
            }
        ),
        f'{V}.properties[spec].properties[l].x-kubernetes-list-map-keys: Invalid value: ["nope"]: entries must all be '
        "names of item properties",
        "ValidateCustomResourceDefinitionOpenAPISchema in pkg/apis/apiextensions/validation/validation.go",
    ),
    (
        "list-type-on-string",
        crd({"type": "object", "properties": {"s": {"type": "string", "x-kubernetes-list-type": "set"}}}),
        f'{V}.properties[spec].properties[s].type: Invalid value: "string": must be array if x-kubernetes-list-type is '
        "specified",
        "ValidateCustomResourceDefinitionOpenAPISchema in pkg/apis/apiextensions/validation/validation.go",
    ),
    (
        "list-type-unknown",
        crd({"type": "object", "properties": {"l": {"type": "array", "items": S, "x-kubernetes-list-type": "bag"}}}),
        f'{V}.properties[spec].properties[l].x-kubernetes-list-type: Unsupported value: "bag": supported values: '
        '"atomic", "set", "map"',
        "ValidateCustomResourceDefinitionOpenAPISchema in pkg/apis/apiextensions/validation/validation.go",
    ),
    (
        "set-of-granular-objects",
        crd(
            {
                "type": "object",
                "properties": {
                    "l": {
                        "type": "array",
                        "x-kubernetes-list-type": "set",
                        "items": {"type": "object", "properties": {"a": S}},
                    }
                },
            }
        ),
        f"{V}.properties[spec].properties[l].items.x-kubernetes-map-type: Invalid value: null: must be atomic as item of "
        "a list with x-kubernetes-list-type=set",
        "ValidateCustomResourceDefinitionOpenAPISchema (requireAtomicSetType) in pkg/apis/apiextensions/validation/validation.go",
    ),
    (
        "rule-empty",
        crd({"type": "object", "x-kubernetes-validations": [{"rule": " "}]}),
        f"{V}.properties[spec].x-kubernetes-validations[0].rule: Required value: rule is not specified",
        "ValidateCustomResourceDefinitionOpenAPISchema in pkg/apis/apiextensions/validation/validation.go",
    ),
    (
        "rule-reason-unknown",
        crd(
            {
                "type": "object",
                "properties": {"a": INT},
                "x-kubernetes-validations": [{"rule": "self.a > 0", "reason": "FieldValueBogus"}],
            }
        ),
        f'{V}.properties[spec].x-kubernetes-validations[0].reason: Unsupported value: "FieldValueBogus": supported values: '
        '"FieldValueDuplicate", "FieldValueForbidden", "FieldValueInvalid", "FieldValueRequired"',
        "ValidateCustomResourceDefinitionOpenAPISchema in pkg/apis/apiextensions/validation/validation.go",
    ),
    (
        "rule-field-path-invalid",
        crd(
            {
                "type": "object",
                "properties": {"a": INT},
                "x-kubernetes-validations": [{"rule": "self.a > 0", "fieldPath": ".b"}],
            }
        ),
        f'{V}.properties[spec].x-kubernetes-validations[0].fieldPath: Invalid value: ".b": must be a valid path',
        "ValidateCustomResourceDefinitionOpenAPISchema + pathValid in pkg/apis/apiextensions/validation/validation.go, "
        "ValidFieldPath in pkg/apiserver/schema/cel/validation.go",
    ),
    (
        "rule-message-newline",
        crd(
            {
                "type": "object",
                "properties": {"a": INT},
                "x-kubernetes-validations": [{"rule": "self.a > 0", "message": "two\nlines"}],
            }
        ),
        f'{V}.properties[spec].x-kubernetes-validations[0].message: Invalid value: "two\\nlines": must not contain line '
        "breaks",
        "ValidateCustomResourceDefinitionOpenAPISchema in pkg/apis/apiextensions/validation/validation.go",
    ),
    (
        "rule-undefined-field",
        crd({"type": "object", "properties": {"a": INT}, "x-kubernetes-validations": [{"rule": "self.b > 0"}]}),
        f'{V}.properties[spec].x-kubernetes-validations[0].rule: Invalid value: {{"Rule":"self.b > 0","Message":"",'
        '"MessageExpression":"","Reason":null,"FieldPath":"","OptionalOldSelf":null}: compilation failed: '
        "ERROR: <input>:1:5: undefined field 'b'\n | self.b > 0\n | ....^",
        "compileRule in pkg/apiserver/schema/cel/compilation.go, via ValidateCustomResourceDefinitionOpenAPISchema",
    ),
    (
        "rule-unknown-method",
        crd(
            {"type": "object", "properties": {"a": S}, "x-kubernetes-validations": [{"rule": "self.a.startswth('x')"}]}
        ),
        # a misspelled library function: cel-go's checker reports it at the call's "(" (parser.VisitMemberCall)
        f'{V}.properties[spec].x-kubernetes-validations[0].rule: Invalid value: {{"Rule":"self.a.startswth(\'x\')",'
        '"Message":"","MessageExpression":"","Reason":null,"FieldPath":"","OptionalOldSelf":null}: compilation failed: '
        "ERROR: <input>:1:17: undeclared reference to 'startswth' (in container '')\n | self.a.startswth('x')\n"
        " | ................^",
        "compileRule in pkg/apiserver/schema/cel/compilation.go (cel-go checker.checkCall: undeclaredReference)",
    ),
    (
        "rule-in-wrong-element-type",
        crd(
            {
                "type": "object",
                "properties": {"n": INT, "tags": {"type": "array", "items": S}},
                "x-kubernetes-validations": [{"rule": "self.n in self.tags"}],
            }
        ),
        f'{V}.properties[spec].x-kubernetes-validations[0].rule: Invalid value: {{"Rule":"self.n in self.tags",'
        '"Message":"","MessageExpression":"","Reason":null,"FieldPath":"","OptionalOldSelf":null}: compilation failed: '
        "ERROR: <input>:1:8: found no matching overload for '@in' applied to '(int, list(string))'\n"
        " | self.n in self.tags\n | .......^",
        "compileRule in pkg/apiserver/schema/cel/compilation.go (cel-go's @in overloads: (A, list(A)), (A, map(A, B)))",
    ),
    (
        "rule-not-bool",
        crd({"type": "object", "properties": {"a": INT}, "x-kubernetes-validations": [{"rule": "self.a + 1"}]}),
        f'{V}.properties[spec].x-kubernetes-validations[0].rule: Invalid value: {{"Rule":"self.a + 1","Message":"",'
        '"MessageExpression":"","Reason":null,"FieldPath":"","OptionalOldSelf":null}: cel expression must evaluate to a bool',
        "compileRule in pkg/apiserver/schema/cel/compilation.go",
    ),
    (
        "rule-old-self-in-atomic-list",
        crd(
            {
                "type": "object",
                "properties": {
                    "l": {
                        "type": "array",
                        "items": {"type": "string", "x-kubernetes-validations": [{"rule": "self == oldSelf"}]},
                    }
                },
            }
        ),
        f'{V}.properties[spec].properties[l].items.x-kubernetes-validations[0].rule: Invalid value: "self == oldSelf": '
        f"oldSelf cannot be used on the uncorrelatable portion of the schema within {V}.properties[spec].properties[l]",
        "ValidateCustomResourceDefinitionOpenAPISchema (withForbidOldSelfValidations) in "
        "pkg/apis/apiextensions/validation/validation.go",
    ),
    (
        "status-root-restricted",
        crd(
            root={"type": "object", "properties": {"spec": {"type": "object"}}, "anyOf": [{"required": ["spec"]}]},
            subresources={"status": {}},
        ),
        f"{V}: Invalid value: only [Description Type Format Title Maximum ExclusiveMaximum Minimum ExclusiveMinimum "
        "MaxLength MinLength Pattern MaxItems MinItems UniqueItems MultipleOf Required Items Properties ExternalDocs "
        "Example XPreserveUnknownFields XValidations] fields are allowed at the root of the schema if the status "
        "subresource is enabled",
        "validateCustomResourceDefinitionValidation in pkg/apis/apiextensions/validation/validation.go",
    ),
    (
        "scale-spec-path-outside-spec",
        crd(subresources={"scale": {"specReplicasPath": ".status.replicas", "statusReplicasPath": ".status.replicas"}}),
        'spec.subresources.scale.specReplicasPath: Invalid value: ".status.replicas": should be a json path under .spec',
        "ValidateCustomResourceDefinitionSubresources in pkg/apis/apiextensions/validation/validation.go",
    ),
    (
        "scale-status-path-not-simple",
        crd(subresources={"scale": {"specReplicasPath": ".spec.replicas", "statusReplicasPath": "status.replicas"}}),
        'spec.subresources.scale.statusReplicasPath: Invalid value: "status.replicas": must be a simple json path '
        "starting with .",
        "validateSimpleJSONPath in pkg/apis/apiextensions/validation/validation.go",
    ),
    (
        "printer-column-type",
        crd(columns=[{"name": "A", "type": "float", "jsonPath": ".spec.a"}]),
        'spec.additionalPrinterColumns[0].type: Invalid value: "float": must be one of boolean,date,integer,number,string',
        "ValidateCustomResourceColumnDefinition in pkg/apis/apiextensions/validation/validation.go",
    ),
    (
        "printer-column-path",
        crd(columns=[{"name": "A", "type": "string", "jsonPath": "spec.a"}]),
        'spec.additionalPrinterColumns[0].JSONPath: Invalid value: "spec.a": must be a simple json path starting with .',
        "ValidateCustomResourceColumnDefinition / validateSimpleJSONPath in pkg/apis/apiextensions/validation/validation.go",
    ),
]


@pytest.mark.parametrize(("doc", "expected", "upstream"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_the_emulator_refuses_what_the_upstream_function_refuses(
    kube: Api, doc: dict, expected: str, upstream: str
) -> None:
    assert upstream and COMMIT  # the upstream function this case ports, read at COMMIT
    assert expected in refused(kube, doc)


def test_the_full_message_is_the_one_kubectl_printed_for_our_old_crd(kube: Api) -> None:
    """The report of the issue, verbatim: our CRD as it was, with a description on root metadata."""
    doc = pdcrd.build_crd()
    doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["metadata"]["description"] = (
        "Standard object metadata."
    )
    rsp = kube.post(doc)
    assert rsp.status_code == 422
    assert rsp.json()["message"] == (
        'CustomResourceDefinition.apiextensions.k8s.io "pdinferenceservices.pdserve.dev" is invalid: '
        f"{V}.properties[metadata]: Forbidden: must not specify anything other than name and generateName, but "
        "metadata is implicitly specified"
    )


@pytest.mark.parametrize(
    "schema",
    [
        # validateStructuralMetadataInvariants: restrictions of name/generateName are allowed
        {
            "type": "object",
            "properties": {"metadata": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}}}},
        },
        # isIntOrStringAnyOfPattern / isIntOrStringAllOfPattern: the two exceptions
        {
            "type": "object",
            "properties": {
                "spec": {
                    "type": "object",
                    "properties": {
                        "x": {"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}]}
                    },
                }
            },
        },
        {
            "type": "object",
            "properties": {
                "spec": {
                    "type": "object",
                    "properties": {
                        "x": {
                            "x-kubernetes-int-or-string": True,
                            "allOf": [{"anyOf": [{"type": "integer"}, {"type": "string"}]}, {"pattern": "^[0-9]+%?$"}],
                        }
                    },
                }
            },
        },
        # transition rules on a correlatable node, with fieldPath and reason
        {
            "type": "object",
            "properties": {
                "spec": {
                    "type": "object",
                    "properties": {"a": INT},
                    "x-kubernetes-validations": [
                        {
                            "rule": "self.a >= oldSelf.a",
                            "message": "a may only grow",
                            "fieldPath": ".a",
                            "reason": "FieldValueForbidden",
                        }
                    ],
                }
            },
        },
    ],
    ids=["metadata-name-restriction", "int-or-string-anyof", "int-or-string-allof", "transition-rule"],
)
def test_what_upstream_admits_is_admitted(kube: Api, schema: dict) -> None:
    accepted(kube, crd(root=schema))
