"""Every InferencePool, LeaderWorkerSet, DisaggregatedSet and InferenceObjective pdserve renders,
created through the API emulator with the upstream CRD files installed as they ship (issue #57).

The files, cited by repository, commit and path (support/upstream_crds.py, tests/upstream_crds/):
- kubernetes-sigs/gateway-api-inference-extension@84436a96
  config/crd/bases/inference.networking.k8s.io_inferencepools.yaml (InferencePool v1);
- kubernetes-sigs/lws@060ab4da config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml and
  config/crd/bases/disaggregatedset.x-k8s.io_disaggregatedsets.yaml;
- llm-d/llm-d-router@ebab6879 config/crd/bases/llm-d.ai_inferenceobjectives.yaml (InferenceObjective
  llm-d.ai/v1alpha2, the chart's default) and kubernetes-sigs/gateway-api-inference-extension@df9f8909
  (v1.5.0) config/crd/bases/inference.networking.x-k8s.io_inferenceobjectives.yaml (the older group),
  each object validated against the file of its own group.

`created_whole` is the render check: a create with `fieldValidation=Strict` (a field the schema
does not declare is a 400, k8s.io/apiserver create.go), then every field rendered must still be in
what was stored (defaults may add; pruning may take nothing away), and a second create under
`Ignore` must store the same. The tests at the end prove the check bites: a field the upstream
schema does not hold is refused under Strict and caught as pruned under Ignore, and the schema's
enums and CEL rules refuse what upstream refuses.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kube_emulator import EmulatorThread
from pdserve_operator import spec as s
from pdserve_operator.kube import kind_of
from pdserve_operator.reconcile import drift
from pdserve_operator.reconcile.children import render
from pdserve_operator.reconcile.children.meta import Defaults, Owner
from support import upstream_crds as up
from support.kube_fake import DEFAULTS

ROOT = Path(__file__).resolve().parents[2]
NS = "team"
CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
POOL_API, LWS_API, DS_API = (
    "inference.networking.k8s.io/v1",
    "leaderworkerset.x-k8s.io/v1",
    "disaggregatedset.x-k8s.io/v1",
)
OBJECTIVE_APIS = ("llm-d.ai/v1alpha2", "inference.networking.x-k8s.io/v1alpha2")
UPSTREAM_KINDS = {"InferencePool", "LeaderWorkerSet", "InferenceObjective", "DisaggregatedSet"}
POOL = {"endpointPickerPort": 9002, "inferencePool": {"enabled": True}}
OBJECTIVES = [{"name": "interactive", "priority": 10}, {"name": "batch", "priority": -5}, {"name": "default"}]
CPU = {"type": "Resource", "name": "cpu", "target": {"type": "Utilization", "averageUtilization": 70}}

# Specs that between them render every variant of the upstream kinds: the pool with each failure
# mode, the decode groups as an LWS (with and without autoscaling, TLS, sharding), and the samples.
SPECS: dict[str, dict[str, Any]] = {
    "pool": {"router": POOL},
    "pool-fail-close": {"router": {**POOL, "inferencePool": {"enabled": True, "failureMode": "FailClose"}}},
    "objectives": {"router": {**POOL, "inferencePool": {"enabled": True, "objectives": OBJECTIVES}}},
    "lws": {"decode": {"replicas": 3, "layerShards": 4, "groupScheduling": "leaderWorkerSet"}},
    "lws-one-shard": {"decode": {"replicas": 1, "groupScheduling": "leaderWorkerSet"}, "router": POOL},
    "lws-by-workload": {"workload": "LeaderWorkerSet", "decode": {"replicas": 2, "layerShards": 2}},
    "lws-autoscaled": {
        "decode": {"layerShards": 2, "groupScheduling": "leaderWorkerSet"},
        "autoscaling": {"decode": {"enabled": True, "driver": "hpa", "maxReplicas": 4, "metric": CPU}},
        "router": POOL,
    },
    "ds": {"workload": "DisaggregatedSet"},
    "ds-autoscaled": {
        "workload": "DisaggregatedSet",
        "decode": {"layerShards": 2},
        "autoscaling": {"decode": {"enabled": True, "driver": "hpa", "maxReplicas": 4, "metric": CPU}},
    },
    "ds-slices-placed-sharded": {
        "workload": "DisaggregatedSet",
        "disaggregatedSet": {"slices": 2, "placement": "ExclusiveTopology", "topologyKey": "example.com/rack"},
        "prefill": {"replicas": 4},
        "decode": {"replicas": 2, "layerShards": 4},
        "router": POOL,
    },
}


class Api:
    def __init__(self, url: str) -> None:
        self.client = httpx.Client(base_url=url, headers={"Authorization": "Bearer admin"}, timeout=60)

    def create(self, obj: dict[str, Any], validation: str = "Strict") -> httpx.Response:
        path = kind_of(obj).path(NS)
        return self.client.post(path, json=obj, params={"fieldValidation": validation})

    def delete(self, obj: dict[str, Any]) -> None:
        self.client.delete(kind_of(obj).path(NS, obj["metadata"]["name"]))


@pytest.fixture(scope="module")
def kube() -> Iterator[Api]:
    with EmulatorThread() as emu:
        api = Api(emu.url)
        api.client.post("/api/v1/namespaces", json={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
        installs = [(POOL_API, "InferencePool"), (LWS_API, "LeaderWorkerSet"), (DS_API, "DisaggregatedSet")]
        installs.append((DS_API, "DisaggregatedSetRoleScaler"))
        for api_version, kind in [*installs, *((a, "InferenceObjective") for a in OBJECTIVE_APIS)]:
            answer = api.client.post(CRDS, json=up.crd(api_version, kind))  # the file as it ships
            assert answer.status_code == 201, (up.FILES[(api_version, kind)].cite(), answer.text[:2000])
        yield api
        api.client.close()


def missing(rendered: Any, stored: Any, path: str = "") -> list[str]:
    """The paths of what `rendered` holds and `stored` lacks or holds otherwise."""
    if isinstance(rendered, dict):
        if not isinstance(stored, dict):
            return [path or "."]
        return [p for k, v in rendered.items() for p in missing(v, stored.get(k, _ABSENT), f"{path}.{k}")]
    if isinstance(rendered, list):
        if not isinstance(stored, list) or len(stored) != len(rendered):
            return [path]
        return [p for i, (a, b) in enumerate(zip(rendered, stored, strict=True)) for p in missing(a, b, f"{path}[{i}]")]
    return [] if rendered == stored else [path]


_ABSENT = object()


def created_whole(kube: Api, obj: dict[str, Any]) -> dict[str, Any]:
    """Create `obj` through the emulator (Strict, then Ignore) and return what was stored; fail if
    the upstream schema refused, or pruned, any of it."""
    body = copy.deepcopy(obj)
    body["metadata"].pop("ownerReferences", None)  # the owner does not exist in this emulator
    cite = up.FILES[(obj["apiVersion"], obj["kind"])].cite()
    answer = kube.create(body)
    assert answer.status_code == 201, (cite, answer.text[:3000])
    stored = answer.json()
    kube.delete(body)
    again = kube.create(body, validation="Ignore")
    assert again.status_code == 201, (cite, again.text[:3000])
    kube.delete(body)
    gone = missing(body, stored) + missing(body, again.json())
    assert not gone, f"pruned by {cite}: {gone}"
    return stored


def rendered_upstream() -> list[tuple[str, dict[str, Any]]]:
    """(case, object) for every upstream-kind object the specs and the sample manifests render."""
    specs = dict(SPECS)
    for sample in sorted((ROOT / "manifests" / "samples").glob("*.yaml")):
        for doc in yaml.safe_load_all(sample.read_text()):
            if doc and doc.get("kind") == s.KIND:
                spec = copy.deepcopy(doc["spec"])  # each sample with the upstream kinds it can have
                if spec.get("workload", "Deployments") == "Deployments":
                    spec.setdefault("decode", {})["groupScheduling"] = "leaderWorkerSet"
                spec["router"] = {**POOL, **spec.get("router", {})}
                specs[sample.stem] = spec
    out = []
    for case, spec in specs.items():
        for obj in render(Owner("chat", NS, "u-1"), s.parse_spec(spec), "t", DEFAULTS):
            if obj["kind"] in UPSTREAM_KINDS:
                out.append((f"{case}:{obj['kind']}:{obj['metadata']['name']}", obj))
    older = Defaults(image="img:1", broker_address="broker:50070", objective_api_version=OBJECTIVE_APIS[1])
    for obj in render(Owner("chat", NS, "u-1"), s.parse_spec(SPECS["objectives"]), "t", older):
        if obj["kind"] == "InferenceObjective":
            out.append((f"objectives-older-group:{obj['metadata']['name']}", obj))
    return out


RENDERED = rendered_upstream()


def test_the_specs_render_every_upstream_kind() -> None:
    assert {obj["kind"] for _, obj in RENDERED} == UPSTREAM_KINDS
    assert {obj["apiVersion"] for _, obj in RENDERED} == {POOL_API, LWS_API, DS_API, *OBJECTIVE_APIS}
    assert len(RENDERED) >= 2 * len(SPECS)


@pytest.mark.parametrize(("case", "obj"), RENDERED, ids=[c for c, _ in RENDERED])
def test_what_pdserve_renders_is_stored_whole_under_the_upstream_schema(kube: Api, case: str, obj: dict) -> None:
    stored = created_whole(kube, obj)
    sent = {**obj, "metadata": {k: v for k, v in obj["metadata"].items() if k != "ownerReferences"}}
    assert drift.content_drift(sent, stored) == []  # what the API server stored reads as no drift
    if obj["kind"] == "InferencePool":  # the upstream defaults arrive, ours are kept
        ref = stored["spec"]["endpointPickerRef"]
        assert ref["kind"] == "Service" and ref["group"] == "" and stored["spec"]["appProtocol"] == "http"
        assert ref["failureMode"] == obj["spec"]["endpointPickerRef"]["failureMode"]
    elif obj["kind"] == "InferenceObjective":  # it names the pool rendered beside it
        assert stored["spec"]["poolRef"] == {
            "group": "inference.networking.k8s.io",
            "kind": "InferencePool",
            "name": "chat",
        }
        assert stored["spec"]["priority"] == obj["spec"]["priority"]  # 0 too: written, not left to the reader
    elif obj["kind"] == "DisaggregatedSet":
        roles = {r["name"]: r for r in stored["spec"]["roles"]}
        assert set(roles) == {"prefill", "decode"} and stored["spec"]["slices"] == obj["spec"]["slices"]
        modes = {name: r["scaling"]["mode"] for name, r in roles.items()}
        assert modes == {r["name"]: r["scaling"]["mode"] for r in obj["spec"]["roles"]}
        assert modes["prefill"] == "Static" and modes["decode"] in ("Static", "External")
        decode = roles["decode"]["spec"]["leaderWorkerTemplate"]
        assert decode["workerTemplate"]["spec"]["containers"][0]["name"]  # typed pod template
    else:
        template = stored["spec"]["leaderWorkerTemplate"]
        assert template["size"] == obj["spec"]["leaderWorkerTemplate"]["size"]
        assert template["workerTemplate"]["spec"]["containers"][0]["name"]  # the pod template was typed, not opaque


# ---------------------------------------------------------------- the check bites


def _pool() -> dict[str, Any]:
    return copy.deepcopy(next(obj for _, obj in RENDERED if obj["kind"] == "InferencePool"))


def _lws() -> dict[str, Any]:
    return copy.deepcopy(next(obj for _, obj in RENDERED if obj["kind"] == "LeaderWorkerSet"))


def test_a_field_the_upstream_schema_lacks_is_refused_and_the_render_check_catches_it(kube: Api) -> None:
    pool = _pool()
    pool["spec"]["endpointPickerRef"]["timeout"] = "5s"  # not in InferencePool v1
    pool["metadata"].pop("ownerReferences")
    strict = kube.create(pool)
    assert strict.status_code == 400, strict.text
    assert strict.json()["message"] == 'strict decoding error: unknown field "spec.endpointPickerRef.timeout"'
    warned = kube.create(pool, validation="Warn")  # the default: stored pruned, with a Warning header
    assert warned.status_code == 201
    assert warned.headers.get("Warning") == '299 - "unknown field \\"spec.endpointPickerRef.timeout\\""'
    assert "timeout" not in warned.json()["spec"]["endpointPickerRef"]
    kube.delete(pool)
    with pytest.raises(AssertionError, match="unknown field"):
        created_whole(kube, pool)
    # Under Ignore the API server stores it pruned without a word; the comparison still sees it.
    ignored = kube.create(pool, validation="Ignore")
    assert ignored.status_code == 201 and "Warning" not in ignored.headers
    assert missing(pool, ignored.json()) == [".spec.endpointPickerRef.timeout"]
    kube.delete(pool)


def test_a_misplaced_pod_field_in_the_lws_template_is_caught(kube: Api) -> None:
    lws = _lws()
    container = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    container["gpus"] = 1  # not a Container field
    with pytest.raises(AssertionError, match=r"workerTemplate.spec.containers\[0\].gpus"):
        created_whole(kube, lws)


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        # enum (openapi), upstream `FailureMode` +kubebuilder:validation:Enum
        (lambda p: p["spec"]["endpointPickerRef"].update(failureMode="Sometimes"), "Unsupported value"),
        # CEL x-kubernetes-validations of targetPorts
        (lambda p: p["spec"].update(targetPorts=[{"number": 8000}, {"number": 8000}]), "port number must be unique"),
        # CEL of endpointPickerRef: a Service needs a port
        (lambda p: p["spec"]["endpointPickerRef"].pop("port"), "port is required when kind is 'Service'"),
        # minimum/maximum
        (lambda p: p["spec"]["endpointPickerRef"]["port"].update(number=70000), "less than or equal to 65535"),
        (lambda p: p["spec"].update(targetPorts=[]), "should have at least 1 items"),
    ],
    ids=["enum", "cel-unique-ports", "cel-port-required", "maximum", "min-items"],
)
def test_the_upstream_pool_schema_refuses_what_upstream_refuses(kube: Api, edit: Any, says: str) -> None:
    pool = _pool()
    pool["metadata"].pop("ownerReferences")
    edit(pool)
    answer = kube.create(pool)
    assert answer.status_code == 422, answer.text
    assert says in answer.json()["message"], answer.json()["message"]


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda o: o["spec"]["leaderWorkerTemplate"].update(restartPolicy="Always"), "Unsupported value"),
        (lambda o: o["spec"].update(startupPolicy="LeaderFirst"), "Unsupported value"),
        (lambda o: o["spec"].update(networkConfig={}), "subdomainPolicy: Required value"),
        (
            lambda o: o["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"].update(containers="x"),
            "must be of type array",
        ),
    ],
    ids=["restart-policy", "startup-policy", "network-config", "pod-template-typed"],
)
def test_the_upstream_lws_schema_refuses_what_upstream_refuses(kube: Api, edit: Any, says: str) -> None:
    lws = _lws()
    lws["metadata"].pop("ownerReferences")
    edit(lws)
    answer = kube.create(lws)
    assert answer.status_code == 422, answer.text
    assert says in answer.json()["message"], answer.json()["message"]


def test_an_unknown_field_validation_directive_is_refused(kube: Api) -> None:
    pool = _pool()
    pool["metadata"].pop("ownerReferences")
    answer = kube.create(pool, validation="Loose")
    assert answer.status_code == 422 and '"Loose"' in answer.json()["message"], answer.text


def test_unknown_field_paths_are_the_ones_pruning_records() -> None:
    """`PruneWithOptions` with TrackUnknownFieldPaths (apiextensions-apiserver at 1aa2717a,
    pkg/apiserver/schema/pruning/algorithm.go; paths joined as schema/options.go joins them)."""
    from kube_emulator.schema import unknown_fields

    item = {"type": "object", "properties": {"a": {"type": "string"}}}
    schema = {
        "type": "object",
        "properties": {
            "spec": {
                "type": "object",
                "properties": {
                    "list": {"type": "array", "items": item},
                    "open": {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "properties": {"t": item}},
                    "map": {"type": "object", "additionalProperties": item},
                    "embedded": {"type": "object", "x-kubernetes-embedded-resource": True, "properties": {}},
                },
            }
        },
    }
    obj = {
        "apiVersion": "x/v1",
        "kind": "K",
        "metadata": {"name": "n", "labels": {"a": "b"}, "anything": 1},  # ObjectMeta's strict decoding
        "extra": 1,
        "spec": {
            "list": [{"a": "x"}, {"a": "y", "b": 1}],
            "open": {"kept": {"deep": 1}, "t": {"a": "x", "z": 2}},  # preserved, but typed below is pruned
            "map": {"k": {"a": "x", "q": 1}},
            "embedded": {"apiVersion": "v1", "kind": "Pod", "metadata": {}, "spec": {}},
        },
    }
    assert unknown_fields(obj, schema) == [
        "metadata.anything",
        "extra",
        "spec.embedded.spec",
        "spec.list[1].b",
        "spec.map.k.q",
        "spec.open.t.z",
    ]


@pytest.mark.parametrize("api_version", OBJECTIVE_APIS)
@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda o: o["spec"]["poolRef"].update(name=""), "should be at least 1 chars long"),
        (lambda o: o["spec"]["poolRef"].update(kind="Inference Pool"), "should match"),
        (lambda o: o["spec"].pop("poolRef"), "spec.poolRef: Required value"),
        (lambda o: o["spec"].update(priority="high"), "must be of type integer"),
    ],
    ids=["pool-name", "pool-kind", "pool-ref", "priority"],
)
def test_the_upstream_objective_schemas_refuse_what_upstream_refuses(
    kube: Api, api_version: str, edit: Any, says: str
) -> None:
    objective = copy.deepcopy(next(o for _, o in RENDERED if o["apiVersion"] == api_version))
    objective["metadata"].pop("ownerReferences")
    edit(objective)
    answer = kube.create(objective)
    assert answer.status_code == 422, answer.text
    assert says in answer.json()["message"], answer.json()["message"]


def _ds() -> dict[str, Any]:
    ds = copy.deepcopy(next(obj for _, obj in RENDERED if obj["kind"] == "DisaggregatedSet"))
    ds["metadata"].pop("ownerReferences")
    return ds


def _role(ds: dict[str, Any], name: str) -> dict[str, Any]:
    return next(r for r in ds["spec"]["roles"] if r["name"] == name)


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        # the spec's CEL rule (pdserve's own rule refuses it first: spec/disaggregated.py)
        (lambda d: _role(d, "prefill")["spec"].update(replicas=0), "replicas must be zero for all non-External roles"),
        (lambda d: d["spec"].update(roles=d["spec"]["roles"][:1]), "should have at least 2 items"),
        (lambda d: d["spec"].update(roles=[d["spec"]["roles"][0]] * 2), "Duplicate value"),
        (lambda d: d["spec"].update(slices=0), "should be greater than or equal to 1"),
        (lambda d: d["spec"].update(placementPolicy={"type": "SameRack"}), "Unsupported value"),
        (lambda d: _role(d, "decode").update(scaling={"mode": "Auto"}), "Unsupported value"),
    ],
    ids=["cel-zero-together", "min-roles", "role-names-unique", "slices", "placement", "scaling-mode"],
)
def test_the_upstream_ds_schema_refuses_what_upstream_refuses(kube: Api, edit: Any, says: str) -> None:
    ds = _ds()
    edit(ds)
    answer = kube.create(ds)
    assert answer.status_code == 422, answer.text
    assert says in answer.json()["message"], answer.json()["message"]


def test_the_hpa_of_an_external_role_targets_a_scale_subresource_of_the_upstream_role_scaler(kube: Api) -> None:
    """lws config/crd/bases/disaggregatedset.x-k8s.io_disaggregatedsetrolescalers.yaml: the kind
    the HPA names has a /scale (specReplicasPath .spec.replicas); the scaler is made by the set's
    controller (played here), the HPA writes its /scale."""
    spec = s.parse_spec(SPECS["ds-autoscaled"])
    kids = {o["kind"]: o for o in render(Owner("chat", NS, "u-1"), spec, "t", DEFAULTS)}
    ref = kids["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"]) in up.FILES
    scaler = {"apiVersion": ref["apiVersion"], "kind": ref["kind"], "metadata": {"name": ref["name"]}}
    scaler["spec"] = {"replicas": 1}
    path = f"/apis/{ref['apiVersion']}/namespaces/{NS}/disaggregatedsetrolescalers"
    assert kube.client.post(path, json=scaler, params={"fieldValidation": "Strict"}).status_code == 201
    scaled = kube.client.patch(
        f"{path}/{ref['name']}/scale",
        json={"spec": {"replicas": 3}},
        headers={"Content-Type": "application/merge-patch+json"},
    )
    assert scaled.status_code == 200, scaled.text
    assert kube.client.get(f"{path}/{ref['name']}").json()["spec"]["replicas"] == 3
    kube.client.delete(f"{path}/{ref['name']}")
