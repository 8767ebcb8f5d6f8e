"""The resource types the emulator serves: a few built-ins plus whatever CRDs register."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Scale:
    """Where a resource keeps what the scale subresource shows (JSON paths like `.spec.replicas`)."""

    spec_path: str
    status_path: str
    selector_path: str | None = None
    selector_from_match_labels: bool = False  # apps/v1: the selector is spec.selector.matchLabels


@dataclass(frozen=True)
class ResourceType:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    status: bool = False
    scale: Scale | None = None
    schema: dict[str, Any] | None = None  # openAPIV3Schema of a custom resource
    scale_spec: dict[str, Any] | None = None  # a CRD's subresources.scale as written
    printer_columns: tuple[dict[str, Any], ...] = ()
    custom: bool = False
    generation_paths: tuple[str, ...] = ("spec",)  # top-level keys whose change bumps generation
    verbs: tuple[str, ...] = field(
        default=("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")
    )

    @property
    def key(self) -> tuple[str, str]:
        return (self.group, self.plural)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def singular(self) -> str:
        return self.kind.lower()


_APPS_SCALE = Scale(".spec.replicas", ".status.replicas", selector_from_match_labels=True)

BUILTINS: tuple[ResourceType, ...] = (
    ResourceType("", "v1", "namespaces", "Namespace", namespaced=False, short_names=("ns",), status=True),
    ResourceType("", "v1", "pods", "Pod", short_names=("po",), categories=("all",), status=True),
    ResourceType("", "v1", "services", "Service", short_names=("svc",), categories=("all",), status=True),
    ResourceType("", "v1", "configmaps", "ConfigMap", short_names=("cm",), generation_paths=()),
    ResourceType("", "v1", "secrets", "Secret", generation_paths=()),
    ResourceType("", "v1", "events", "Event", short_names=("ev",), generation_paths=()),
    ResourceType("", "v1", "serviceaccounts", "ServiceAccount", short_names=("sa",), generation_paths=()),
    ResourceType(
        "apps",
        "v1",
        "deployments",
        "Deployment",
        short_names=("deploy",),
        categories=("all",),
        status=True,
        scale=_APPS_SCALE,
    ),
    ResourceType(
        "apps",
        "v1",
        "statefulsets",
        "StatefulSet",
        short_names=("sts",),
        categories=("all",),
        status=True,
        scale=_APPS_SCALE,
    ),
    ResourceType("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", short_names=("pdb",), status=True),
    ResourceType("events.k8s.io", "v1", "events", "Event", short_names=("ev",), generation_paths=()),
    ResourceType("coordination.k8s.io", "v1", "leases", "Lease", generation_paths=()),
    ResourceType("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", short_names=("netpol",)),
    ResourceType(
        "autoscaling",
        "v2",
        "horizontalpodautoscalers",
        "HorizontalPodAutoscaler",
        short_names=("hpa",),
        categories=("all",),
        status=True,
    ),
    ResourceType(
        "rbac.authorization.k8s.io", "v1", "clusterroles", "ClusterRole", namespaced=False, generation_paths=()
    ),
    ResourceType(
        "rbac.authorization.k8s.io",
        "v1",
        "clusterrolebindings",
        "ClusterRoleBinding",
        namespaced=False,
        generation_paths=(),
    ),
    ResourceType("rbac.authorization.k8s.io", "v1", "roles", "Role", generation_paths=()),
    ResourceType("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding", generation_paths=()),
    ResourceType(
        "apiextensions.k8s.io",
        "v1",
        "customresourcedefinitions",
        "CustomResourceDefinition",
        namespaced=False,
        short_names=("crd", "crds"),
        status=True,
    ),
)


def from_crd(crd: dict[str, Any]) -> list[ResourceType]:
    """One ResourceType per served version of a CRD."""
    spec = crd["spec"]
    names = spec["names"]
    out = []
    for version in spec.get("versions", []):
        if not version.get("served", True):
            continue
        sub = version.get("subresources") or {}
        scale = None
        if "scale" in sub:
            sc = sub["scale"]
            scale = Scale(sc["specReplicasPath"], sc["statusReplicasPath"], sc.get("labelSelectorPath"))
        schema = (version.get("schema") or {}).get("openAPIV3Schema")
        # With a status subresource, only spec (all but metadata/status) changes bump generation.
        out.append(
            ResourceType(
                group=spec["group"],
                version=version["name"],
                plural=names["plural"],
                kind=names["kind"],
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                short_names=tuple(names.get("shortNames") or ()),
                categories=tuple(names.get("categories") or ()),
                status="status" in sub,
                scale=scale,
                schema=schema,
                scale_spec=sub.get("scale"),
                printer_columns=tuple(version.get("additionalPrinterColumns") or ()),
                custom=True,
                generation_paths=("*",),
            )
        )
    return out
