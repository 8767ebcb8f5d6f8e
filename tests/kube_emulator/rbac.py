"""Kubernetes RBAC, enough to ask "may this service account make this request?" offline.

The emulator authorizes nothing (every request is served), so RBAC is checked after the fact:
the emulator's audit log says which requests an identity made, `request_attributes` turns each
into the attributes the API server authorizes (verb, API group, resource, subresource,
namespace, name), and `Authorizer` evaluates RBAC objects (for instance a rendered Helm chart)
the way kube-apiserver's RBAC authorizer does: a request is allowed when any rule of any role
bound to the subject matches it. The rules follow `k8s.io/apiserver/pkg/endpoints/request`
(RequestInfo) and `plugin/pkg/auth/authorizer/rbac` (rule matching); hand-written because no
Python package implements the authorizer.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

_VERBS_BY_METHOD = {
    "POST": "create",
    "GET": "get",
    "HEAD": "get",
    "PUT": "update",
    "PATCH": "patch",
    "DELETE": "delete",
}
# Subresources of a namespace itself (`/api/v1/namespaces/NAME/status`), not namespaced resources.
_NAMESPACE_SUBRESOURCES = {"status", "finalize"}

# The discovery part of the API server's default `system:discovery` and
# `system:public-info-viewer` roles, bound to every authenticated user: what kubectl, kopf and
# client libraries read before any resource.
DEFAULT_NON_RESOURCE_URLS = (
    "/api",
    "/api/*",
    "/apis",
    "/apis/*",
    "/healthz",
    "/livez",
    "/readyz",
    "/version",
    "/version/",
    "/openapi",
    "/openapi/*",
)


@dataclass(frozen=True)
class RequestAttributes:
    """What RBAC authorizes about one request (`path` set only for non-resource requests)."""

    verb: str
    group: str = ""
    resource: str = ""
    subresource: str = ""
    namespace: str = ""
    name: str = ""
    path: str = ""

    @property
    def is_resource(self) -> bool:
        return not self.path

    @property
    def resource_key(self) -> str:
        """`resource` or `resource/subresource`, as RBAC rules name them."""
        return f"{self.resource}/{self.subresource}" if self.subresource else self.resource

    def __str__(self) -> str:
        if not self.is_resource:
            return f"{self.verb} {self.path}"
        where = f" in {self.namespace}" if self.namespace else " (cluster)"
        return f"{self.verb} {self.group or 'core'}/{self.resource_key}{where}"


def request_attributes(method: str, path: str, query: Mapping[str, str] | None = None) -> RequestAttributes:
    """The API server's RequestInfo of an HTTP request."""
    query = query or {}
    parts = [p for p in path.split("/") if p]
    verb = _VERBS_BY_METHOD.get(method.upper(), method.lower())
    if len(parts) >= 2 and parts[0] == "api":
        group, rest = "", parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis":
        group, rest = parts[1], parts[3:]
    else:
        rest = []
    if not rest:  # /api, /api/v1, /apis/GROUP/VERSION, /version ...: the verb is the HTTP method
        return RequestAttributes(verb=method.lower(), path=path)
    namespace = ""
    if rest[0] == "namespaces" and len(rest) > 1:
        namespace = rest[1]
        if len(rest) > 2 and rest[2] not in _NAMESPACE_SUBRESOURCES:
            rest = rest[2:]
    resource = rest[0]
    name = rest[1] if len(rest) > 1 else ""
    subresource = rest[2] if len(rest) > 2 else ""
    if resource == "namespaces" and name:
        namespace = name  # a namespace is authorized inside itself (RequestInfo does the same)
    if verb == "get" and not name:
        verb = "list"
    if verb in ("get", "list") and query.get("watch") in ("true", "1"):
        verb = "watch"
    if verb == "delete" and not name:
        verb = "deletecollection"
    return RequestAttributes(verb, group, resource, subresource, namespace, name)


@dataclass(frozen=True)
class Rule:
    """One PolicyRule of a Role or ClusterRole, plus where it applies ("" = every namespace)."""

    verbs: tuple[str, ...]
    api_groups: tuple[str, ...] = ()
    resources: tuple[str, ...] = ()
    resource_names: tuple[str, ...] = ()
    non_resource_urls: tuple[str, ...] = ()
    namespace: str = ""  # set for rules reached through a RoleBinding
    source: str = ""  # "ClusterRole/NAME" or "Role/NS/NAME", for messages

    @classmethod
    def from_policy(cls, rule: Mapping[str, Any], namespace: str = "", source: str = "") -> Rule:
        return cls(
            verbs=tuple(rule.get("verbs") or ()),
            api_groups=tuple(rule.get("apiGroups") or ()),
            resources=tuple(rule.get("resources") or ()),
            resource_names=tuple(rule.get("resourceNames") or ()),
            non_resource_urls=tuple(rule.get("nonResourceURLs") or ()),
            namespace=namespace,
            source=source,
        )

    def matches(self, req: RequestAttributes) -> bool:
        if not ("*" in self.verbs or req.verb in self.verbs):
            return False
        if not req.is_resource:
            return any(
                u == req.path or u == "*" or u.endswith("*") and req.path.startswith(u[:-1])
                for u in self.non_resource_urls
            )
        if self.namespace and req.namespace != self.namespace:
            return False
        if not ("*" in self.api_groups or req.group in self.api_groups):
            return False
        key = req.resource_key
        wildcard_sub = f"*/{req.subresource}" if req.subresource else None
        if not any(r in ("*", key) or r == wildcard_sub for r in self.resources):
            return False
        return not self.resource_names or req.name in self.resource_names

    def grants(self) -> Iterator[tuple[str, str, str, str]]:
        """Each (namespace, group, resource, verb) this rule grants (non-resource rules: none)."""
        for group in self.api_groups:
            for resource in self.resources:
                for verb in self.verbs:
                    yield self.namespace, group, resource, verb


@dataclass(frozen=True)
class ServiceAccount:
    namespace: str
    name: str

    @property
    def username(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.name}"

    @property
    def groups(self) -> tuple[str, ...]:
        return ("system:serviceaccounts", f"system:serviceaccounts:{self.namespace}", "system:authenticated")

    def is_subject(self, subject: Mapping[str, Any], binding_namespace: str) -> bool:
        kind = subject.get("kind")
        if kind == "ServiceAccount":
            return (
                subject.get("name") == self.name and (subject.get("namespace") or binding_namespace) == self.namespace
            )
        if kind == "User":
            return subject.get("name") == self.username
        if kind == "Group":
            return subject.get("name") in self.groups
        return False


class Authorizer:
    """RBAC over a set of Role/ClusterRole/RoleBinding/ClusterRoleBinding objects."""

    def __init__(self, objects: Iterable[Mapping[str, Any]]) -> None:
        self.cluster_roles: dict[str, Mapping[str, Any]] = {}
        self.roles: dict[tuple[str, str], Mapping[str, Any]] = {}
        self.bindings: list[Mapping[str, Any]] = []
        for obj in objects:
            kind, meta = obj.get("kind"), obj.get("metadata") or {}
            if kind == "ClusterRole":
                self.cluster_roles[meta["name"]] = obj
            elif kind == "Role":
                self.roles[(meta.get("namespace", ""), meta["name"])] = obj
            elif kind in ("RoleBinding", "ClusterRoleBinding"):
                self.bindings.append(obj)

    def rules_for(self, account: ServiceAccount) -> list[Rule]:
        """Every rule that applies to the account, plus the default discovery access."""
        rules = [Rule(verbs=("get",), non_resource_urls=DEFAULT_NON_RESOURCE_URLS, source="system:discovery")]
        for binding in self.bindings:
            meta = binding.get("metadata") or {}
            ns = meta.get("namespace", "") if binding["kind"] == "RoleBinding" else ""
            if not any(account.is_subject(s, ns) for s in binding.get("subjects") or []):
                continue
            ref = binding["roleRef"]
            if ref["kind"] == "ClusterRole":
                role, source = self.cluster_roles.get(ref["name"]), f"ClusterRole/{ref['name']}"
            else:
                role, source = self.roles.get((ns, ref["name"])), f"Role/{ns}/{ref['name']}"
            if role is None:
                continue  # a binding to a missing role grants nothing, as in the API server
            rules += [Rule.from_policy(r, ns, source) for r in role.get("rules") or []]
        return rules

    def allowed(self, account: ServiceAccount, req: RequestAttributes) -> bool:
        return any(rule.matches(req) for rule in self.rules_for(account))
