"""Spec models, their CEL twins, and the generated CRD (structural, complete, in sync with manifests)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]

from kube_emulator import validate_crd  # noqa: E402
from kube_emulator.schema import _program, admit  # noqa: E402
from pdserve_operator import crd  # noqa: E402
from pdserve_operator import spec as s  # noqa: E402


def schema() -> dict[str, Any]:
    return crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_manifest_is_the_output_of_pdserve_crd() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pdserve_worker.cli.main", "crd"], capture_output=True, text=True, check=True
    )
    assert out.stdout == (ROOT / "manifests" / "crd.yaml").read_text(), "regenerate: pdserve crd > manifests/crd.yaml"
    assert list(yaml.safe_load_all(out.stdout)) == [crd.build_crd(), crd.build_adapter_crd()]


def test_crd_passes_the_api_servers_crd_admission() -> None:
    """Every rule ported from apiextensions-apiserver (tests/kube_emulator/crd_validation.py),
    for both CRDs of manifests/crd.yaml (PDInferenceService and the per-role PDScalingAdapter)."""
    assert [str(e) for e in validate_crd(crd.build_crd())] == []
    assert [str(e) for e in validate_crd(crd.build_adapter_crd())] == []
    docs = list(yaml.safe_load_all((ROOT / "manifests" / "crd.yaml").read_text()))
    assert [d["metadata"]["name"] for d in docs] == ["pdinferenceservices.pdserve.dev", "pdscalingadapters.pdserve.dev"]
    assert [str(e) for d in docs for e in validate_crd(d)] == []


def test_the_adapter_crd_is_a_scale_target_every_field_described() -> None:
    version = crd.build_adapter_crd()["spec"]["versions"][0]
    assert version["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        },
    }
    root = version["schema"]["openAPIV3Schema"]
    missing = [p for p, sub in _walk(root) if not sub.get("description") and p != ".metadata"]
    assert missing == []
    assert root["properties"]["spec"]["required"] == ["replicas", "serviceName", "role"]


def _walk(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = []
    for name, sub in (node.get("properties") or {}).items():
        out.append((f"{path}.{name}", sub))
        out += _walk(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        out += _walk(node["items"], f"{path}[]")
    return out


def test_every_field_is_described_for_kubectl_explain() -> None:
    # Root metadata is the exception: the API server refuses any description there.
    missing = [p for p, sub in _walk(schema()) if not sub.get("description") and p != ".metadata"]
    assert missing == []
    assert schema()["properties"]["metadata"] == {"type": "object"}


def test_crd_shape_scale_printer_columns_and_names() -> None:
    doc = crd.build_crd()
    version = doc["spec"]["versions"][0]
    assert (
        doc["spec"]["names"]["shortNames"] == ["pdis"] and doc["metadata"]["name"] == "pdinferenceservices.pdserve.dev"
    )
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.decode.replicas",
        "statusReplicasPath": ".status.decode.replicas",
        "labelSelectorPath": ".status.decode.selector",
    }
    assert "status" in version["subresources"]
    cols = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert cols["Prefill"] == ".status.prefill.summary" and cols["Decode"] == ".status.decode.summary"
    assert cols["Slots"] == ".status.slots.summary" and cols["Phase"] == ".status.phase"
    spec = schema()["properties"]["spec"]["properties"]
    assert spec["decode"]["properties"]["readiness"]["enum"] == ["interrupt", "poll", "spin"]
    assert spec["decode"]["properties"]["replicas"]["minimum"] == 0
    assert spec["transfer"]["properties"]["backend"]["enum"] == ["hixl", "cpu", "auto"]


def test_schema_defaults_equal_the_model_defaults() -> None:
    """What the API server stores for an empty spec is what pydantic fills in."""
    stored, errors = admit(
        {"apiVersion": s.API_VERSION, "kind": s.KIND, "metadata": {"name": "x"}, "spec": {}}, schema()
    )
    assert errors == []
    assert s.parse_spec(stored["spec"]).wire() == s.PDInferenceServiceSpec().wire()
    assert stored["spec"]["decode"]["slots"] == 8 and stored["spec"]["transfer"]["backend"] == "auto"


def _rules_with_models() -> list[tuple[type[s.Model], s.Rule]]:
    models = [s.DeviceSpec, s.DecodeSpec, s.PrefillSpec, s.RouterServiceSpec, s.RouterSpec, s.PDInferenceServiceSpec]
    return [(m, r) for m in models for r in m.rules]


device = st.fixed_dictionaries(
    {"type": st.sampled_from(["npu", "cuda", "cpu"])},
    optional={"resourceName": st.just("huawei.com/Ascend910"), "count": st.integers(0, 3)},
)
decode = st.fixed_dictionaries(
    {"readiness": st.sampled_from(["interrupt", "poll", "spin"])},
    optional={
        "pollIntervalMicros": st.integers(1, 500),
        "tensorParallelSize": st.sampled_from([1, 3]),
        "layerShards": st.sampled_from([1, 2]),
        "kvBlockTokens": st.sampled_from([0, 16]),
    },
)
prefill = st.fixed_dictionaries(
    {"tensorParallelSize": st.sampled_from([1, 3])},
    optional={"prefixCacheTokens": st.sampled_from([0, 4096]), "prefixDiskGib": st.integers(1, 4)},
)
router = st.fixed_dictionaries({}, optional={"endpointPickerPort": st.sampled_from([9002, 8080, 8081, 50051, 50052])})
service = st.fixed_dictionaries(
    {"type": st.sampled_from(["ClusterIP", "NodePort", "LoadBalancer"])},
    optional={"nodePort": st.integers(30000, 32767)},
)
# Whole specs whose nested parts are valid, so that only the spec-level rule can fail.
spec_doc = st.fixed_dictionaries(
    {
        "device": st.sampled_from(
            [
                {"type": "cpu"},
                {"type": "npu", "resourceName": "huawei.com/Ascend910"},
                {"type": "cuda", "resourceName": "nvidia.com/gpu"},
            ]
        ),
        "transfer": st.fixed_dictionaries({"backend": st.sampled_from(["hixl", "cpu", "auto"])}),
    },
    optional={
        "engine": st.sampled_from(["native", "vllm"]),
        "vllmImage": st.just("reg/pdserve:1-vllm-cpu"),
        "decode": st.sampled_from([{}, {"layerShards": 2}, {"tensorParallelSize": 3}]),
        "prefill": st.sampled_from([{}, {"tensorParallelSize": 3}]),
    },
)
_SCHEMAS = {
    m: crd.model_schema(m)
    for m in (s.DeviceSpec, s.DecodeSpec, s.PrefillSpec, s.RouterServiceSpec, s.RouterSpec, s.PDInferenceServiceSpec)
}


@settings(max_examples=60, deadline=None)
@given(dev=device, dec=decode, pre=prefill, svc=service, rtr=router, whole=spec_doc)
def test_cel_rules_and_python_rules_agree(dev: dict, dec: dict, pre: dict, svc: dict, rtr: dict, whole: dict) -> None:
    """Each Rule's CEL (API server) and predicate (operator) accept exactly the same objects."""
    samples = {
        s.DeviceSpec: dev,
        s.DecodeSpec: dec,
        s.PrefillSpec: pre,
        s.RouterServiceSpec: svc,
        s.RouterSpec: rtr,
        s.PDInferenceServiceSpec: whole,
    }
    for model, rule in _rules_with_models():
        doc = samples[model]
        # What the API server evaluates: the stored (defaulted) form.
        sub_schema = _SCHEMAS[model]
        stored, _ = admit(
            {"metadata": {}, **doc},
            {**sub_schema, "properties": {**sub_schema["properties"], "metadata": {"type": "object"}}},
        )
        stored.pop("metadata")
        cel_ok = bool(_program(rule.cel).evaluate({"self": celpy.json_to_cel(stored)}))
        try:
            model.model_validate(doc)
            py_ok = True
        except s.ValidationError as exc:
            py_ok = rule.message not in str(exc)
        assert cel_ok == py_ok, (model.__name__, rule.cel, doc)


@pytest.mark.parametrize(
    ("doc", "fragment"),
    [
        ({"decode": {"layerShards": 31}}, "decode.layerShards"),
        ({"prefill": {"layersPerChunk": 40}}, "prefill.layersPerChunk"),
        ({"prefill": {"tensorParallelSize": 2}}, "sizes that work: [1, 3, 9]"),
        ({"prefill": {"tensorParallelSize": 3, "prefixCacheTokens": 512}}, "prefix cache is off in a tensor-parallel"),
        ({"decode": {"tensorParallelSize": 2}}, "decode.tensorParallelSize: 2 does not split"),
        ({"router": {"endpointPickerPort": 50051}}, "the pods' own ports"),
        ({"decode": {"tensorParallelSize": 3, "layerShards": 2}}, "tensor-parallel or layer-sharded"),
        ({"decode": {"tensorParallelSize": 3, "kvBlockTokens": 0}}, "needs a paged KV pool"),
        ({"model": {"source": "builtin:llama9000"}}, "unknown built-in model"),
        ({"device": {"type": "cuda"}}, "spec.device: resourceName is required"),
        ({"decode": {"pollIntervalMicros": 10}}, "pollIntervalMicros is only meaningful"),
        ({"decode": {"kvBlockTokens": 0, "kvTokens": 4096}}, "kvTokens is only meaningful"),
        ({"prefill": {"resources": {"limits": {"cpu": "two"}}}}, "not a Kubernetes quantity"),
        ({"decode": {"bogus": 1}}, "spec.decode.bogus"),
    ],
)
def test_invalid_specs_name_the_field(doc: dict, fragment: str) -> None:
    with pytest.raises(s.ValidationError) as err:
        s.parse_spec(doc)
    assert fragment in s.describe(err.value)


def test_a_path_source_and_a_pvc_source_are_valid_without_model_knowledge() -> None:
    assert (
        s.parse_spec({"model": {"source": "pvc://models/llama"}, "decode": {"layerShards": 64}}).model.builtin is None
    )
    assert s.parse_spec({"model": {"source": "/opt/models/x"}}).model.source == "/opt/models/x"


def test_scale_paths_and_printer_columns_point_at_fields_of_the_right_type() -> None:
    """Our own check, stricter than CRD admission (upstream only wants simple JSON paths under
    .spec/.status, ValidateCustomResourceDefinitionSubresources / ValidateCustomResourceColumnDefinition):
    a scale path to a missing or non-integer field fails only at `kubectl scale` time, a printer
    column to a missing field prints an empty column forever."""
    from kube_emulator.celcheck import valid_field_path

    version = crd.build_crd()["spec"]["versions"][0]
    sch = version["schema"]["openAPIV3Schema"]
    scale = version["subresources"]["scale"]
    for key, want in (
        ("specReplicasPath", "integer"),
        ("statusReplicasPath", "integer"),
        ("labelSelectorPath", "string"),
    ):
        _, node = valid_field_path(scale[key], sch, allow_array_notation=False)
        assert node.get("type") == want, (key, node)
    for col in version["additionalPrinterColumns"]:
        if col["jsonPath"].startswith(".metadata."):
            assert col["jsonPath"] == ".metadata.creationTimestamp" and col["type"] == "date"
            continue
        _, node = valid_field_path(col["jsonPath"], sch, allow_array_notation=False)
        assert (
            node.get("type")
            == {"string": "string", "integer": "integer", "number": "number", "boolean": "boolean"}[col["type"]]
        ), col
