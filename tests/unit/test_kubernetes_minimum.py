"""The README's minimum Kubernetes version is the newest first release among the API fields
that the CRD, the chart and the operator's children use.

Every field found is looked up in FIRST_RELEASE (a new field without a row fails the test), and
every row cites where its first release is recorded upstream.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]

from chart_tools import render  # noqa: E402
from pdserve_operator import crd  # noqa: E402
from pdserve_operator import spec as s  # noqa: E402
from pdserve_operator.reconcile import children  # noqa: E402
from pdserve_operator.reconcile.children.meta import Defaults, Owner  # noqa: E402

KEP95 = "kubernetes/enhancements keps/sig-api-machinery/95-custom-resource-definitions (CRDs GA as apiextensions.k8s.io/v1 in v1.16)"
KEP2876 = "kubernetes/enhancements keps/sig-api-machinery/2876-crd-validation-expression-language (alpha v1.23, beta on by default v1.25, GA v1.29)"

# feature -> (first release that serves it by default, upstream source)
FIRST_RELEASE: dict[str, tuple[tuple[int, int], str]] = {
    "api:apiextensions.k8s.io/v1": ((1, 16), KEP95),
    "api:v1": ((1, 0), "core/v1: Kubernetes v1.0"),
    "api:apps/v1": ((1, 9), "apps/v1 Deployment/StatefulSet GA in v1.9 (kubernetes/kubernetes CHANGELOG-1.9)"),
    "api:rbac.authorization.k8s.io/v1": ((1, 8), "RBAC GA in v1.8 (kubernetes/kubernetes CHANGELOG-1.8)"),
    "api:networking.k8s.io/v1": ((1, 7), "NetworkPolicy GA in v1.7 (kubernetes/kubernetes CHANGELOG-1.7)"),
    "api:policy/v1": (
        (1, 21),
        "PodDisruptionBudget policy/v1 in v1.21 (kubernetes/enhancements keps/sig-apps/85-Graduate-PDB-to-Stable)",
    ),
    "api:kopf.dev/v1": (
        (1, 16),
        "a CRD of ours (manifests/kopf-peering.yaml): needs apiextensions.k8s.io/v1, " + KEP95,
    ),
    "schema:default": (
        (1, 17),
        "CRD defaulting GA in v1.17 (kubernetes/enhancements keps/sig-api-machinery/575-crd-defaulting)",
    ),
    "schema:x-kubernetes-int-or-string": ((1, 16), KEP95 + "; JSONSchemaProps.XIntOrString in apiextensions/v1"),
    "schema:x-kubernetes-preserve-unknown-fields": ((1, 16), KEP95 + "; JSONSchemaProps.XPreserveUnknownFields"),
    "schema:x-kubernetes-list-type": ((1, 16), KEP95 + "; JSONSchemaProps.XListType"),
    "schema:x-kubernetes-list-map-keys": ((1, 16), KEP95 + "; JSONSchemaProps.XListMapKeys"),
    "schema:x-kubernetes-validations": ((1, 25), KEP2876),
    "rule:rule": ((1, 25), KEP2876),
    "rule:message": ((1, 25), KEP2876),
    "rule:fieldPath": (
        (1, 28),
        "kubernetes/kubernetes#118041 '[KEP-2876] Add reason and fieldPath into CRD validation "
        "rules', released in v1.28 (kubernetes/enhancements#4159: GA held from 1.28 to 1.29 "
        "because fieldPath and reason were added)",
    ),
    "rule:reason": ((1, 28), "kubernetes/kubernetes#118041, released in v1.28 (see rule:fieldPath)"),
    "crd:subresources.status": ((1, 16), KEP95),
    "crd:subresources.scale": ((1, 16), KEP95),
    "crd:additionalPrinterColumns": ((1, 16), KEP95),
    "pod:seccompProfile": ((1, 19), "seccomp GA in v1.19 (kubernetes/enhancements keps/sig-node/135-seccomp)"),
    "pod:startupProbe": (
        (1, 20),
        "startupProbe GA in v1.20, beta on by default since v1.18 (kubernetes/enhancements "
        "keps/sig-node/950-liveness-probe-holdoff)",
    ),
}
# Third-party APIs: not a Kubernetes release but an add-on (the chart renders them only when enabled).
ADD_ONS = {"api:monitoring.coreos.com/v1": "prometheus-operator ServiceMonitor, serviceMonitor.enabled=true only"}


def _schema_features(node: Any, found: set[str]) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "default":
                found.add("schema:default")
            elif key.startswith("x-kubernetes-"):
                found.add(f"schema:{key}")
                if key == "x-kubernetes-validations":
                    found.update(f"rule:{k}" for rule in value for k in rule)
            if key != "default":
                _schema_features(value, found)
    elif isinstance(node, list):
        for item in node:
            _schema_features(item, found)


def _object_features(obj: dict[str, Any], found: set[str]) -> None:
    found.add(f"api:{obj['apiVersion']}")
    if obj["kind"] == "CustomResourceDefinition":
        for version in obj["spec"]["versions"]:
            _schema_features(version["schema"]["openAPIV3Schema"], found)
            found.update(f"crd:subresources.{k}" for k in version.get("subresources") or {})
            if version.get("additionalPrinterColumns"):
                found.add("crd:additionalPrinterColumns")
    text = yaml.safe_dump(obj)
    for field in ("seccompProfile", "startupProbe"):
        if f"{field}:" in text:
            found.add(f"pod:{field}")


def used_features() -> set[str]:
    found: set[str] = set()
    docs = [crd.build_crd(), crd.build_adapter_crd()]
    docs += list(yaml.safe_load_all((ROOT / "manifests" / "kopf-peering.yaml").read_text()))
    docs += render("--set", "serviceMonitor.enabled=true", "--set", "networkPolicy.enabled=true")
    sample = yaml.safe_load((ROOT / "manifests" / "samples" / "smollm2-cpu.yaml").read_text())
    owner = Owner(name="x", namespace="default", uid="u")
    docs += children.render(
        owner, s.parse_spec(sample["spec"]), "token", Defaults(image="i", broker_address="b:1", network_policy=True)
    )
    for doc in docs:
        _object_features(doc, found)
    return found


def readme_minimum() -> tuple[int, int]:
    match = re.search(r"Needs Kubernetes ≥ (\d+)\.(\d+)", (ROOT / "README.md").read_text())
    assert match, "README must state `Needs Kubernetes ≥ X.Y`"
    return int(match.group(1)), int(match.group(2))


def test_readme_minimum_is_the_newest_first_release_of_what_we_use() -> None:
    used = used_features() - set(ADD_ONS)
    unknown = sorted(used - set(FIRST_RELEASE))
    assert not unknown, f"add a FIRST_RELEASE row (with its upstream source) for {unknown}"
    needed = max(FIRST_RELEASE[f][0] for f in used)
    newest = sorted(f for f in used if FIRST_RELEASE[f][0] == needed)
    assert readme_minimum() == needed, f"README minimum must be {needed} (set by {newest})"
    assert "rule:fieldPath" in used  # what sets it today, as the issue found


def test_every_row_cites_an_upstream_source() -> None:
    for feature, (release, source) in FIRST_RELEASE.items():
        assert release >= (1, 0) and len(source) > 20, feature
