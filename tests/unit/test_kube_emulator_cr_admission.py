"""Custom-resource admission in the emulator follows the API server's order and rules.

Upstream: kubernetes/apiextensions-apiserver at 1aa2717a552ee6ca1e2a18f1f8ffccde981db923:
`pkg/apiserver/customresource_handler.go` (unstructuredSchemaCoercer.apply: prune, then
PruneNonNullableNullsWithoutDefaults; unstructuredDefaulter: Default), `pkg/registry/customresource/
strategy.go` and `status_strategy.go` (PrepareForCreate/PrepareForUpdate, Validate/ValidateUpdate,
hasBlockingErr), `validator.go` (ValidateScaleSpec/Status), `pkg/apiserver/schema/cel/validation.go`
(transition rules, ratcheting of unchanged values), `pkg/apiserver/validation/ratcheting.go`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from kube_emulator import EmulatorThread  # noqa: E402

CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
GADGETS = "/apis/example.com/v1/namespaces/default/gadgets"


def gadget_crd(size_maximum: int | None = None) -> dict[str, Any]:
    size: dict[str, Any] = {"type": "integer"}
    if size_maximum is not None:
        size["maximum"] = size_maximum
        size["x-kubernetes-validations"] = [{"rule": f"self <= {size_maximum}", "message": "size is too big"}]
    schema = {
        "type": "object",
        "properties": {
            "spec": {
                "type": "object",
                "properties": {
                    "replicas": {"type": "integer", "minimum": 0, "default": 1},
                    "mode": {"type": "string", "enum": ["a", "b"], "default": "a"},
                    "size": size,
                    "tags": {"type": "array", "x-kubernetes-list-type": "set", "items": {"type": "string"}},
                    "nullableThing": {"type": "string", "nullable": True},
                    "notNullable": {"type": "string"},
                    "withDefault": {"type": "string", "default": "d"},
                    "code": {"type": "string", "pattern": "^[a-z]+$"},
                    "digits": {"type": "string", "pattern": "^\\d+$"},
                },
                "x-kubernetes-validations": [
                    {"rule": "self.replicas >= oldSelf.replicas", "message": "replicas may not shrink"},
                    {
                        "rule": "self.mode == 'a' || self.replicas <= 3",
                        "message": "mode b allows at most 3 replicas",
                        "fieldPath": ".replicas",
                    },
                ],
            },
            "status": {"type": "object", "properties": {"ready": {"type": "integer", "minimum": 0}}},
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "gadgets.example.com"},
        "spec": {
            "group": "example.com",
            "scope": "Namespaced",
            "names": {"plural": "gadgets", "singular": "gadget", "kind": "Gadget"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema},
                    "subresources": {
                        "status": {},
                        "scale": {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.ready"},
                    },
                }
            ],
        },
    }


@pytest.fixture(scope="module")
def api() -> Iterator[httpx.Client]:
    with EmulatorThread() as emu:
        with httpx.Client(base_url=emu.url, headers={"Authorization": "Bearer admin"}, timeout=30) as client:
            assert client.post(CRDS, json=gadget_crd()).status_code == 201
            yield client


def gadget(name: str, spec: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"apiVersion": "example.com/v1", "kind": "Gadget", "metadata": {"name": name}, "spec": spec, **extra}


def causes(rsp: httpx.Response) -> list[str]:
    assert rsp.status_code == 422, rsp.text
    return [f"{c['field']}: {c['message']}" for c in rsp.json()["details"]["causes"]]


def test_unknown_fields_are_pruned_and_nulls_dropped_or_defaulted(api: httpx.Client) -> None:
    """prune (pruning/algorithm.go), PruneNonNullableNullsWithoutDefaults, Default."""
    made = api.post(
        GADGETS,
        json=gadget("p", {"bogus": 1, "notNullable": None, "nullableThing": None, "withDefault": None}, extra={"x": 1}),
    )
    assert made.status_code == 201, made.text
    body = made.json()
    assert "extra" not in body and "bogus" not in body["spec"]
    assert "notNullable" not in body["spec"]  # a null without default: dropped
    assert body["spec"]["nullableThing"] is None  # nullable: kept
    assert body["spec"]["withDefault"] == "d"  # a null with a default: defaulted
    assert body["spec"]["replicas"] == 1 and body["spec"]["mode"] == "a"
    assert "status" not in api.post(GADGETS, json=gadget("p2", {}, status={"ready": 1})).json()  # PrepareForCreate


def test_defaults_apply_before_validation_and_blocking_errors_skip_cel(api: httpx.Client) -> None:
    """Validate runs on the defaulted object; CEL runs unless a blocking error (hasBlockingErr)."""
    assert api.post(GADGETS, json=gadget("d1", {"replicas": 5})).status_code == 201  # mode defaults to a
    assert causes(api.post(GADGETS, json=gadget("d2", {"mode": "b", "replicas": 5}))) == [
        "spec.replicas: Invalid value: mode b allows at most 3 replicas"
    ]  # fieldPath, value omitted (object node)
    # a minimum violation is not blocking: CEL still runs and reports too
    assert causes(api.post(GADGETS, json=gadget("d3", {"mode": "b", "replicas": -1}))) == [
        "spec.replicas: Invalid value: -1: spec.replicas in body should be greater than or equal to 0",
        ".spec.replicas: Invalid value: -1: should be a non-negative integer",
    ]  # ValidateScaleSpec
    # an enum miss is blocking: no CEL, one note instead
    assert causes(api.post(GADGETS, json=gadget("d4", {"mode": "c", "replicas": 9}))) == [
        'spec.mode: Unsupported value: "c": supported values: "a", "b"',
        "<nil>: Invalid value: null: some validation rules were not checked because the object was invalid; correct "
        "the existing errors to complete validation",
    ]
    assert causes(api.post(GADGETS, json=gadget("d5", {"replicas": "many"}))) == [
        'spec.replicas: Invalid value: "string": spec.replicas in body must be of type integer: "string"',
        ".spec.replicas: Invalid value: 0: .spec.replicas accessor error: many is of the type string, expected int64",
        "<nil>: Invalid value: null: some validation rules were not checked because the object was invalid; correct "
        "the existing errors to complete validation",
    ]
    assert causes(api.post(GADGETS, json=gadget("d6", {"tags": ["x", "y", "x"]}))) == [
        'spec.tags[2]: Duplicate value: "x"'
    ]  # listtype.ValidateListSetsAndMaps


def test_transition_rules_see_old_self_on_update_only(api: httpx.Client) -> None:
    made = api.post(GADGETS, json=gadget("t", {"replicas": 5})).json()  # oldSelf rule skipped on create
    url = f"{GADGETS}/t"
    made["spec"]["replicas"] = 4
    assert causes(api.put(url, json=made)) == ["spec: Invalid value: replicas may not shrink"]
    made["spec"]["replicas"] = 6
    assert api.put(url, json=made).status_code == 200


def test_status_writes_ignore_spec_and_spec_writes_ignore_status(api: httpx.Client) -> None:
    made = api.post(GADGETS, json=gadget("s", {"replicas": 2})).json()
    url = f"{GADGETS}/s"
    merge = {"Content-Type": "application/merge-patch+json"}
    got = api.patch(f"{url}/status", headers=merge, json={"spec": {"replicas": 9}, "status": {"ready": 2}}).json()
    assert got["status"] == {"ready": 2} and got["spec"]["replicas"] == 2
    assert got["metadata"]["generation"] == made["metadata"]["generation"]  # a status write is no new generation
    got = api.patch(url, headers=merge, json={"spec": {"replicas": 3}, "status": {"ready": 0}}).json()
    assert got["status"] == {"ready": 2} and got["spec"]["replicas"] == 3
    assert got["metadata"]["generation"] == made["metadata"]["generation"] + 1
    assert causes(api.patch(f"{url}/status", headers=merge, json={"status": {"ready": -1}})) == [
        "status.ready: Invalid value: -1: ready in body should be greater than or equal to 0",
        ".status.ready: Invalid value: -1: should be a non-negative integer",
    ]


def test_ratcheting_keeps_unchanged_invalid_values_and_refuses_new_ones(api: httpx.Client) -> None:
    """A stored value that a tightened schema refuses survives updates that leave it alone
    (CRDValidationRatcheting, on by default since Kubernetes 1.30); changing it is checked."""
    assert api.post(GADGETS, json=gadget("r", {"size": 10})).status_code == 201
    crd = api.get(f"{CRDS}/gadgets.example.com").json()
    tightened = gadget_crd(size_maximum=5)
    crd["spec"]["versions"] = tightened["spec"]["versions"]
    assert api.put(f"{CRDS}/gadgets.example.com", json=crd).status_code == 200
    url = f"{GADGETS}/r"
    merge = {"Content-Type": "application/merge-patch+json"}
    assert api.patch(url, headers=merge, json={"spec": {"tags": ["new"]}}).status_code == 200
    assert causes(api.patch(url, headers=merge, json={"spec": {"size": 9}})) == [
        "spec.size: Invalid value: 9: spec.size in body should be less than or equal to 5",
        "spec.size: Invalid value: 9: size is too big",
    ]
    assert causes(api.post(GADGETS, json=gadget("r2", {"size": 10}))) == [
        "spec.size: Invalid value: 10: spec.size in body should be less than or equal to 5",
        "spec.size: Invalid value: 10: size is too big",
    ]
    crd = api.get(f"{CRDS}/gadgets.example.com").json()
    crd["spec"]["versions"] = gadget_crd()["spec"]["versions"]
    restored = api.put(f"{CRDS}/gadgets.example.com", json=crd)
    assert restored.status_code == 200, restored.text


def test_patterns_match_as_go_regexp_does(api: httpx.Client) -> None:
    """kube-openapi `validate.Pattern` (pkg/validation/validate/values.go) matches with Go's regexp
    (RE2): `$` is the end of the text (Python's `re` also matches before a final newline) and `\\d`
    is ASCII only (Python's also takes other scripts' digits)."""
    assert api.post(GADGETS, json=gadget("re1", {"code": "abc", "digits": "123"})).status_code == 201
    assert causes(api.post(GADGETS, json=gadget("re2", {"code": "abc\n"}))) == [
        "spec.code: Invalid value: \"abc\\n\": spec.code in body should match '^[a-z]+$'"
    ]
    assert causes(api.post(GADGETS, json=gadget("re3", {"digits": "\u0661\u0662"}))) == [
        "spec.digits: Invalid value: \"\u0661\u0662\": spec.digits in body should match '^\\d+$'"
    ]
