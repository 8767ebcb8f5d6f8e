"""The Helm chart and the generated manifests: lint, real Kubernetes schemas, one source.

helm comes from `scripts/install_tools.sh` (run by `scripts/setup.sh`), into .tools/bin.
"""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]

import chart_tools  # noqa: E402
from chart_tools import CHART, by_kind, render  # noqa: E402
from kube_emulator import validate_crd  # noqa: E402
from kube_emulator.schema import admit  # noqa: E402
from pdserve_common import pod_env  # noqa: E402
from pdserve_operator import spec as s  # noqa: E402

# Every option that changes what is rendered, at once.
FULL = [
    "--set",
    "watchNamespaces={team-a,team-b}",
    "--set",
    "networkPolicy.enabled=true",
    "--set",
    "serviceMonitor.enabled=true",
    "--set",
    "serviceMonitor.labels.release=prom",
    "--set",
    "imagePullSecrets[0].name=regcred",
    "--set",
    "podAnnotations.a=b",
    "--set",
    "broker.tls.secretName=pdserve-broker-tls",
    "--set",
    "dashboards.enabled=true",
    "--set",
    "prometheusRule.enabled=true",
    "--set",
    "inferencePool.enabled=true",
    "--set",
    "leaderWorkerSet.enabled=true",
]
CUSTOM_KINDS = {"ClusterKopfPeering", "KopfPeering", "ServiceMonitor", "PodMonitor", "PrometheusRule"}
KUBERNETES_VERSION = "1.30.0"  # oldest minor the chart targets that the validator knows well


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([chart_tools.helm(), *args], capture_output=True, text=True, timeout=60)


def crds() -> dict[str, dict[str, Any]]:
    out = {}
    for path in sorted((CHART / "crds").glob("*.yaml")):
        for doc in chart_tools.docs(path.read_text()):
            out[doc["spec"]["names"]["kind"]] = doc
    return out


@pytest.mark.parametrize("values", [[], FULL], ids=["defaults", "everything-on"])
def test_helm_lint_strict(values: list[str]) -> None:
    out = helm("lint", "--strict", str(CHART), *values)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 chart(s) failed" in out.stdout


def test_values_schema_rejects_typos_and_unsafe_values() -> None:
    out = helm(
        "lint",
        "--strict",
        str(CHART),
        "--set",
        "replicaCount=2",
        "--set",
        "networkPolcy.enabled=true",
        "--set",
        "image.tag=latest",
        "--set",
        "watchNamespaces={Team_A}",
    )
    assert out.returncode != 0
    for fragment in ("replicaCount", "networkPolcy", "image.tag", "watchNamespaces.0"):
        assert fragment in out.stdout + out.stderr, out.stdout + out.stderr


@pytest.mark.parametrize("values", [[], FULL], ids=["defaults", "everything-on"])
def test_rendered_builtin_kinds_pass_kubernetes_validate_strict(values: list[str]) -> None:
    objects = render(*values)
    builtin = [o for o in objects if o["kind"] not in CUSTOM_KINDS]
    assert {o["kind"] for o in builtin} >= {
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Service",
        "Deployment",
    }
    for obj in builtin:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)  # raises naming the field


def test_kubernetes_validate_is_strict_here() -> None:
    """The check above would be empty if strict mode let unknown fields through."""
    deployment = copy.deepcopy(by_kind(render(), "Deployment")[0])
    deployment["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_rendered_custom_resources_validate_against_their_crds() -> None:
    known = crds()
    for obj in render(*FULL) + render():
        if obj["kind"] in ("ClusterKopfPeering", "KopfPeering"):
            schema = known[obj["kind"]]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
            jsonschema.Draft4Validator(schema).validate(obj)
            assert ("namespace" in obj["metadata"]) == (known[obj["kind"]]["spec"]["scope"] == "Namespaced")


def test_chart_crds_are_structural_and_the_same_bytes_as_the_manifests() -> None:
    chart_crd = CHART / "crds" / "pdinferenceservices.pdserve.dev.yaml"
    assert chart_crd.read_bytes() == (ROOT / "manifests" / "crd.yaml").read_bytes()
    assert (CHART / "crds" / "kopf-peering.yaml").read_bytes() == (
        ROOT / "manifests" / "kopf-peering.yaml"
    ).read_bytes()
    for kind, crd in crds().items():  # every CRD the chart ships passes the API server's CRD admission
        assert [str(e) for e in validate_crd(crd)] == [], kind


def test_generated_files_are_up_to_date() -> None:
    """manifests/operator.yaml (helm template), the CRD copies and docs/configuration.md."""
    chart_tools.helm()
    stale = [
        str(p.relative_to(ROOT))
        for p, text in chart_tools.generate.expected().items()
        if not p.exists() or p.read_text() != text
    ]
    assert not stale, f"stale generated files {stale}: run `python scripts/generate.py`"


def test_operator_manifest_is_the_chart_plus_its_namespace() -> None:
    manifest = chart_tools.docs((ROOT / "manifests" / "operator.yaml").read_text())
    assert manifest[0] == {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": "pdserve-system", "labels": {"app.kubernetes.io/part-of": "pdserve"}},
    }
    assert manifest[1:] == render()
    for obj in manifest[1:]:
        if obj["kind"] not in ("ClusterRole", "ClusterRoleBinding", "ClusterKopfPeering"):
            assert obj["metadata"]["namespace"] == "pdserve-system", obj["kind"]


@pytest.mark.parametrize("sample", sorted((ROOT / "manifests" / "samples").glob("*.yaml")), ids=lambda p: p.name)
def test_samples_pass_the_crd_schema_unchanged_and_the_operator(sample: Path) -> None:
    doc = yaml.safe_load(sample.read_text())
    schema = crds()[s.KIND]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    stored, errors = admit(copy.deepcopy(doc), schema)
    assert errors == []

    # Nothing pruned: every field the sample sets is one the schema knows.
    def subset(want: Any, have: Any) -> bool:
        if isinstance(want, dict):
            return isinstance(have, dict) and all(k in have and subset(v, have[k]) for k, v in want.items())
        return want == have

    assert subset(doc, stored)
    s.parse_spec(stored["spec"])  # the operator's own validation (built-in model depth and the like)


def test_ascend_sample_is_a_7b_model_from_a_claim_on_hixl() -> None:
    doc = yaml.safe_load((ROOT / "manifests" / "samples" / "qwen7b-ascend.yaml").read_text())
    spec = s.parse_spec(doc["spec"])
    assert spec.model.source.startswith("pvc://") and "7b" in spec.model.source.lower()
    assert (spec.device.type, spec.device.resource_name, spec.transfer.backend) == (
        "npu",
        "huawei.com/Ascend910",
        "hixl",
    )


def test_operator_network_policy_opens_the_broker_port_only_to_pdserve_pods() -> None:
    [policy] = by_kind(render(), "NetworkPolicy")  # on by default (real HIXL does not authenticate)
    broker_rule, health_rule = policy["spec"]["ingress"]
    assert broker_rule["ports"] == [{"port": 50070, "protocol": "TCP"}]
    assert broker_rule["from"][0]["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/name": "pdserve",
        "app.kubernetes.io/managed-by": "pdserve-operator",
    }
    assert "from" not in health_rule and health_rule["ports"][0]["port"] == 8080
    assert by_kind(render("--set", "networkPolicy.enabled=false"), "NetworkPolicy") == []
    env = {
        e["name"]: e.get("value")
        for e in by_kind(render(), "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["PDSERVE_OPERATOR_NETWORK_POLICY"] == "true"  # and the operator renders one per service


def test_service_monitor_scrapes_the_routers_metrics_port() -> None:
    [monitor, _operator] = by_kind(render(*FULL), "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "router"
    assert monitor["spec"]["endpoints"][0]["port"] == "http" and monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    assert monitor["metadata"]["labels"]["release"] == "prom"


def test_pod_monitor_scrapes_every_prefill_and_decode_pod() -> None:
    """Prefill pods have no Service: a PodMonitor selects the workers the operator labels."""
    from pdserve_common import pod_env as E
    from pdserve_operator.reconcile.children.meta import LABEL_COMPONENT, ROLES, Defaults, Owner, labels
    from pdserve_operator.reconcile.children.pod import pod_template

    [monitor] = by_kind(render(*FULL), "PodMonitor")
    assert by_kind(render(), "PodMonitor") == []  # off unless serviceMonitor.enabled
    sel = monitor["spec"]["selector"]
    assert sel["matchExpressions"] == [{"key": LABEL_COMPONENT, "operator": "In", "values": ["prefill", "decode"]}]
    owner = Owner("svc", "team-a", "uid-1")
    pod_labels = {role: labels(owner.name, role) for role in ROLES}
    matches = {
        role: all(lbl.get(k) == v for k, v in sel["matchLabels"].items())
        and lbl.get(LABEL_COMPONENT) in sel["matchExpressions"][0]["values"]
        for role, lbl in pod_labels.items()
    }
    assert matches == {"prefill": True, "decode": True, "router": False}  # routers: the ServiceMonitor
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["port"] == "http"
    template = pod_template(owner, "prefill", s.parse_spec({}), Defaults(image="i", broker_address="b:1"))
    ports = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
    assert ports["http"] == E.HTTP_PORT  # the port worker_app serves /metrics on
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}


def test_deployment_runs_non_root_read_only_with_probes_and_resources() -> None:
    pod = by_kind(render(), "Deployment")[0]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert {"livenessProbe", "readinessProbe", "startupProbe", "resources"} <= set(container)
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/tmp"}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["PDSERVE_OPERATOR_BROKER_ADDRESS"] == "pdserve-operator.pdserve-system.svc:50070"
    assert by_kind(render(), "Service")[0]["spec"]["ports"][0]["port"] == 50070


def test_worker_ports_of_the_pod_contract_are_the_ones_the_policies_name() -> None:
    from pdserve_operator.reconcile.children.meta import Defaults, Owner
    from pdserve_operator.reconcile.children.policy import network_policy

    policy = network_policy(Owner("svc", "ns", "uid"), Defaults(image="i", broker_address="b:1", network_policy=True))
    ports = {p["port"] for p in policy["spec"]["ingress"][0]["ports"]}
    assert ports == {pod_env.GRPC_PORT, pod_env.TRANSFER_PORT}


def test_broker_tls_mounts_the_secret_and_configures_the_operator() -> None:
    from pdserve_operator.runtime import OperatorConfig

    pod = by_kind(render("--set", "broker.tls.secretName=broker-cert"), "Deployment")[0]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["broker-tls"]["secret"]["secretName"] == "broker-cert"
    mount = next(m for m in container["volumeMounts"] if m["name"] == "broker-tls")
    assert mount["readOnly"] is True
    env = {e["name"]: e.get("value") for e in container["env"] if "value" in e}
    config = OperatorConfig(
        **{
            k.removeprefix("PDSERVE_OPERATOR_").lower(): v
            for k, v in env.items()
            if k.startswith("PDSERVE_OPERATOR_TLS_")
        }
    )
    tls = config.broker_tls()
    assert tls is not None and str(tls.ca_file).startswith(mount["mountPath"])
    assert {str(tls.cert_file), str(tls.key_file)} == {f"{mount['mountPath']}/tls.crt", f"{mount['mountPath']}/tls.key"}
    # Off by default: no TLS variables, no volume.
    plain = by_kind(render(), "Deployment")[0]["spec"]["template"]["spec"]
    assert "broker-tls" not in {v["name"] for v in plain["volumes"]}


def test_inference_pool_grant_only_when_asked() -> None:
    """The operator writes InferencePools (spec.router.inferencePool) only where the chart grants it."""

    def pool_rules(*args: str) -> list[dict[str, Any]]:
        [role] = by_kind(render(*args), "ClusterRole")
        return [r for r in role["rules"] if {"inferencepools", "inferenceobjectives"} & set(r["resources"])]

    def objective_env(*args: str) -> str:
        [deployment] = by_kind(render(*args), "Deployment")
        env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
        return next(e["value"] for e in env if e["name"] == "PDSERVE_OPERATOR_OBJECTIVE_API_VERSION")

    pool = {
        "apiGroups": ["inference.networking.k8s.io"],
        "resources": ["inferencepools"],
        "verbs": ["get", "create", "patch"],
    }
    assert pool_rules() == []
    # InferenceObjectives in the group the chart names (and only that one), the operator told the same.
    for api_version in ("llm-d.ai/v1alpha2", "inference.networking.x-k8s.io/v1alpha2"):
        args = ("--set", "inferencePool.enabled=true", "--set", f"inferencePool.objectiveApiVersion={api_version}")
        objectives = {"apiGroups": [api_version.split("/")[0]], "resources": ["inferenceobjectives"]}
        assert pool_rules(*args) == [pool, {**objectives, "verbs": ["get", "create", "patch"]}]
        assert objective_env(*args) == api_version
    assert objective_env() == "llm-d.ai/v1alpha2"
    with pytest.raises(Exception, match="objectiveApiVersion"):  # the values schema names the two
        render("--set", "inferencePool.objectiveApiVersion=inference.networking.k8s.io/v1")


def test_leader_worker_set_grant_only_when_asked() -> None:
    """The operator runs decode groups as LeaderWorkerSets (spec.decode.groupScheduling) only where
    the chart grants it: the LWS itself (watched, so its status reaches the service at once), its
    /scale, and removing the StatefulSet it replaces; the operator is told to watch exactly then."""

    def lws_rules(*args: str) -> list[dict[str, Any]]:
        [role] = by_kind(render(*args), "ClusterRole")
        return [r for r in role["rules"] if "leaderworkerset.x-k8s.io" in r["apiGroups"] or r["verbs"] == ["delete"]]

    def watch_env(*args: str) -> str:
        [deployment] = by_kind(render(*args), "Deployment")
        env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
        return next(e["value"] for e in env if e["name"] == "PDSERVE_OPERATOR_WATCH_LEADER_WORKER_SETS")

    assert lws_rules() == [] and watch_env() == "false"
    assert watch_env("--set", "leaderWorkerSet.enabled=true") == "true"
    assert lws_rules("--set", "leaderWorkerSet.enabled=true") == [
        {
            "apiGroups": ["leaderworkerset.x-k8s.io"],
            "resources": ["leaderworkersets"],
            "verbs": ["get", "list", "watch", "create", "patch", "delete"],
        },
        {"apiGroups": ["leaderworkerset.x-k8s.io"], "resources": ["leaderworkersets/scale"], "verbs": ["patch"]},
        {"apiGroups": ["apps"], "resources": ["statefulsets"], "verbs": ["delete"]},
    ]


def test_disaggregated_set_grant_only_when_asked() -> None:
    """spec.workload DisaggregatedSet only where the chart grants it: the set itself, and removing
    the prefill Deployment and decode StatefulSet it replaces (and it, on a switch back)."""

    def ds_rules(*args: str) -> list[dict[str, Any]]:
        [role] = by_kind(render(*args), "ClusterRole")
        return [r for r in role["rules"] if "disaggregatedset.x-k8s.io" in r["apiGroups"] or r["verbs"] == ["delete"]]

    assert ds_rules() == []
    assert ds_rules("--set", "disaggregatedSet.enabled=true") == [
        {
            "apiGroups": ["disaggregatedset.x-k8s.io"],
            "resources": ["disaggregatedsets"],
            "verbs": ["get", "create", "patch", "delete"],
        },
        {"apiGroups": ["apps"], "resources": ["deployments", "statefulsets"], "verbs": ["delete"]},
    ]


def test_the_peering_lifetime_reaches_kopf_from_the_chart() -> None:
    """benchmarks/operator_failover.py: an operator that died uncleanly is replaced after about the
    peering lifetime (58 s at kopf's 60, 13 s at 15), so the chart's value must reach kopf."""
    from pdserve_operator.runner import kopf_settings
    from pdserve_operator.runtime import OperatorConfig

    def lifetime(*args: str) -> int:
        container = by_kind(render(*args), "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in container["env"]}
        config = OperatorConfig(**{"peering_lifetime_seconds": env["PDSERVE_OPERATOR_PEERING_LIFETIME_SECONDS"]})
        return int(kopf_settings(config).peering.lifetime)

    assert lifetime() == 15
    assert lifetime("--set", "peering.lifetimeSeconds=40") == 40
