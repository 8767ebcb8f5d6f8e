"""The test RBAC authorizer: request attributes as the API server derives them, rule matching."""

from __future__ import annotations

import pytest

from kube_emulator.rbac import Authorizer, RequestAttributes, ServiceAccount, request_attributes


@pytest.mark.parametrize(
    ("method", "path", "query", "want"),
    [
        ("GET", "/api/v1/namespaces/ns/pods", {}, RequestAttributes("list", "", "pods", "", "ns")),
        ("GET", "/api/v1/pods", {"watch": "true"}, RequestAttributes("watch", "", "pods")),
        (
            "GET",
            "/apis/apps/v1/namespaces/ns/deployments/d",
            {},
            RequestAttributes("get", "apps", "deployments", "", "ns", "d"),
        ),
        (
            "PATCH",
            "/apis/pdserve.dev/v1alpha1/namespaces/ns/pdinferenceservices/x/status",
            {},
            RequestAttributes("patch", "pdserve.dev", "pdinferenceservices", "status", "ns", "x"),
        ),
        ("POST", "/api/v1/namespaces/ns/events", {}, RequestAttributes("create", "", "events", "", "ns")),
        (
            "DELETE",
            "/api/v1/namespaces/ns/configmaps",
            {},
            RequestAttributes("deletecollection", "", "configmaps", "", "ns"),
        ),
        (
            "PUT",
            "/api/v1/namespaces/ns/finalize",
            {},
            RequestAttributes("update", "", "namespaces", "finalize", "ns", "ns"),
        ),
        ("GET", "/api/v1/namespaces/ns", {}, RequestAttributes("get", "", "namespaces", "", "ns", "ns")),
        ("GET", "/api/v1/namespaces", {"watch": "1"}, RequestAttributes("watch", "", "namespaces")),
        (
            "PATCH",
            "/apis/kopf.dev/v1/clusterkopfpeerings/p",
            {},
            RequestAttributes("patch", "kopf.dev", "clusterkopfpeerings", "", "", "p"),
        ),
        ("GET", "/apis/apps/v1", {}, RequestAttributes("get", path="/apis/apps/v1")),
        ("GET", "/version", {}, RequestAttributes("get", path="/version")),
    ],
)
def test_request_attributes(method: str, path: str, query: dict[str, str], want: RequestAttributes) -> None:
    assert request_attributes(method, path, query) == want


SA = ServiceAccount("ops", "op")


def objects(binding_kind: str = "ClusterRoleBinding", role_kind: str = "ClusterRole", ns: str = "") -> list[dict]:
    role = {
        "kind": role_kind,
        "metadata": {"name": "r", **({"namespace": ns} if ns else {})},
        "rules": [
            {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list"]},
            {"apiGroups": ["pdserve.dev"], "resources": ["pdinferenceservices/status"], "verbs": ["patch"]},
            {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["get"], "resourceNames": ["only"]},
        ],
    }
    binding = {
        "kind": binding_kind,
        "metadata": {"name": "b", **({"namespace": ns} if ns else {})},
        "roleRef": {"kind": role_kind, "name": "r"},
        "subjects": [{"kind": "ServiceAccount", "name": "op", "namespace": "ops"}],
    }
    return [role, binding]


def test_cluster_binding_allows_in_every_namespace_and_nothing_more() -> None:
    auth = Authorizer(objects())
    assert auth.allowed(SA, request_attributes("GET", "/api/v1/namespaces/a/configmaps/x"))
    assert auth.allowed(SA, request_attributes("GET", "/api/v1/configmaps"))
    assert not auth.allowed(SA, request_attributes("GET", "/api/v1/configmaps", {"watch": "true"}))
    assert not auth.allowed(SA, request_attributes("GET", "/api/v1/namespaces/a/secrets/x"))
    # A subresource needs its own grant, and the grant does not cover the main resource.
    assert auth.allowed(
        SA, request_attributes("PATCH", "/apis/pdserve.dev/v1/namespaces/a/pdinferenceservices/x/status")
    )
    assert not auth.allowed(SA, request_attributes("PATCH", "/apis/pdserve.dev/v1/namespaces/a/pdinferenceservices/x"))
    assert auth.allowed(SA, request_attributes("GET", "/apis/apps/v1/namespaces/a/deployments/only"))
    assert not auth.allowed(SA, request_attributes("GET", "/apis/apps/v1/namespaces/a/deployments/other"))
    assert not auth.allowed(SA, request_attributes("GET", "/apis/apps/v1/namespaces/a/deployments"))  # list has no name
    assert not auth.allowed(ServiceAccount("other", "op"), request_attributes("GET", "/api/v1/configmaps"))


def test_role_binding_allows_only_in_its_namespace() -> None:
    auth = Authorizer(objects("RoleBinding", "Role", ns="team"))
    assert auth.allowed(SA, request_attributes("GET", "/api/v1/namespaces/team/configmaps/x"))
    assert not auth.allowed(SA, request_attributes("GET", "/api/v1/namespaces/other/configmaps/x"))
    assert not auth.allowed(SA, request_attributes("GET", "/api/v1/configmaps"))


def test_discovery_is_allowed_to_everyone_and_a_missing_role_grants_nothing() -> None:
    auth = Authorizer([objects()[1]])  # the binding without its role
    assert auth.allowed(SA, request_attributes("GET", "/apis"))
    assert auth.allowed(SA, request_attributes("GET", "/apis/apps/v1"))
    assert not auth.allowed(SA, request_attributes("GET", "/api/v1/namespaces/a/configmaps/x"))


def test_grants_enumerate_every_triple() -> None:
    rules = Authorizer(objects("RoleBinding", "Role", ns="team")).rules_for(SA)
    grants = {g for r in rules for g in r.grants()}
    assert ("team", "", "configmaps", "list") in grants and ("team", "apps", "deployments", "get") in grants
    assert len(grants) == 4
