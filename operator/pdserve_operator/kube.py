"""What the reconciler asks of the Kubernetes API (`KubeClient`), and the client that does it.

`KubeClient` is the protocol: exactly the calls one reconcile makes. `RestKubeClient` is the
production implementation, a small REST client for plain-dict objects on the official client's
transport: the official client brings authentication (kubeconfig, in-cluster service account
with token refresh, exec plugins) and a connection pool; its typed models do not help here
(children are dicts rendered by `reconcile/children/`) and deserializing them is slow, so requests go
through its `ApiClient` by path and bodies stay JSON. The reconciler's unit tests drive a
recording fake of the protocol (tests/support/kube_fake.py), checked against this client on the
API emulator. Calls are blocking: async code runs them with `asyncio.to_thread`.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import kubernetes

from pdserve_operator import events as ev
from pdserve_operator import spec as s
from pdserve_operator.spec.scaling_adapter import ADAPTER_KIND, ADAPTER_PLURAL

if TYPE_CHECKING:
    import kopf


@dataclass(frozen=True)
class Kind:
    api_version: str
    kind: str
    plural: str
    namespaced: bool = True

    def path(self, namespace: str | None, name: str | None = None, sub: str | None = None) -> str:
        base = f"/api/{self.api_version}" if "/" not in self.api_version else f"/apis/{self.api_version}"
        if self.namespaced and namespace is not None:  # (None: a list across every namespace)
            base += f"/namespaces/{namespace}"
        base += f"/{self.plural}"
        if name is not None:
            base += f"/{name}"
        if sub is not None:
            base += f"/{sub}"
        return base


KINDS: dict[str, Kind] = {
    k.kind: k
    for k in (
        Kind("v1", "Secret", "secrets"),
        Kind("v1", "ConfigMap", "configmaps"),
        Kind("v1", "Service", "services"),
        Kind("v1", "Pod", "pods"),
        Kind("v1", "Event", "events"),
        Kind("apps/v1", "Deployment", "deployments"),
        Kind("apps/v1", "StatefulSet", "statefulsets"),
        Kind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets"),
        Kind("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies"),
        Kind("autoscaling/v2", "HorizontalPodAutoscaler", "horizontalpodautoscalers"),
        Kind(s.API_VERSION, s.KIND, s.PLURAL),
        Kind(s.API_VERSION, ADAPTER_KIND, ADAPTER_PLURAL),
        Kind("inference.networking.k8s.io/v1", "InferencePool", "inferencepools"),
        Kind("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "leaderworkersets"),
        Kind("authentication.k8s.io/v1", "TokenReview", "tokenreviews", namespaced=False),
        Kind("llm-d.ai/v1alpha2", "InferenceObjective", "inferenceobjectives"),
        Kind("disaggregatedset.x-k8s.io/v1", "DisaggregatedSet", "disaggregatedsets"),
    )
}
PDIS = KINDS[s.KIND]


def kind_of(obj: dict[str, Any]) -> Kind:
    """The Kind of a rendered object, in its own apiVersion (an InferenceObjective's group is a
    setting: llm-d.ai, or inference.networking.x-k8s.io on older installs)."""
    kind = KINDS[obj["kind"]]
    api_version = obj.get("apiVersion", kind.api_version)
    return kind if api_version == kind.api_version else dataclasses.replace(kind, api_version=api_version)


class KubeError(Exception):
    """A non-2xx answer of the API server."""

    def __init__(self, status: int, reason: str, message: str, method: str, path: str) -> None:
        super().__init__(f"{method} {path}: {status} {reason}: {message}")
        self.status, self.reason, self.message = status, reason, message


class KubeClient(Protocol):
    """The Kubernetes calls of one reconcile. Errors are `KubeError`s (a 404 on get is None)."""

    def get(self, kind: Kind, namespace: str | None, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""

    def list(self, kind: Kind, namespace: str | None, label_selector: str | None = None) -> list[dict[str, Any]]:
        """The objects of a kind in a namespace, those matching the equality selector when given."""

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        """The object as stored; 409 when one of that name exists."""

    def merge_patch(
        self, kind: Kind, namespace: str | None, name: str, patch: dict[str, Any], sub: str | None = None
    ) -> dict[str, Any]:
        """A JSON merge patch (RFC 7386) of the object, or of its subresource `sub` ("status")."""

    def post_event(self, involved: dict[str, Any], type_: ev.EventType, reason: str, message: str) -> None:
        """A Kubernetes Event about `involved` (an object as the API returned it)."""

    def delete(self, kind: Kind, namespace: str | None, name: str) -> None:
        """Delete the object (gone already is fine)."""


class RestKubeClient:
    """`KubeClient` over the API server's REST interface (plus what the runner and peering use)."""

    def __init__(self, api_client: kubernetes.client.ApiClient) -> None:
        self.api = api_client

    @classmethod
    def from_environment(cls, kubeconfig: str | None = None) -> RestKubeClient:
        """In-cluster credentials when running in a pod, else the kubeconfig (read now, not at import)."""
        config = kubernetes.client.Configuration()
        try:
            kubernetes.config.load_incluster_config(client_configuration=config)
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config(config_file=kubeconfig, client_configuration=config)
        config.connection_pool_maxsize = 32  # handlers run in a thread pool; do not discard connections
        return cls(kubernetes.client.ApiClient(configuration=config))

    def connection_info(self) -> kopf.ConnectionInfo:
        """The same endpoint and credentials, in the form kopf's login handlers return."""
        import kopf

        c = self.api.configuration
        if c.refresh_api_key_hook is not None:
            c.refresh_api_key_hook(c)  # in-cluster tokens rotate
        token = None
        for value in (c.api_key or {}).values():
            token = str(value).removeprefix("Bearer ").strip() or None
        return kopf.ConnectionInfo(
            server=c.host,
            scheme="Bearer" if token else None,
            token=token,
            ca_path=c.ssl_ca_cert,
            insecure=not c.verify_ssl,
            certificate_path=c.cert_file,
            private_key_path=c.key_file,
            username=c.username or None,
            password=c.password or None,
        )

    def close(self) -> None:
        self.api.close()

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        query: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        req = self.api.param_serialize(
            method=method,
            resource_path=path,
            query_params=list((query or {}).items()) or None,
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        resp = self.api.call_api(*req)
        raw = resp.read()
        data: dict[str, Any] = json.loads(raw) if raw else {}
        if not 200 <= resp.status < 300:
            raise KubeError(resp.status, str(data.get("reason", "")), str(data.get("message", raw[:300])), method, path)
        return data

    def get(self, kind: Kind, namespace: str | None, name: str, sub: str | None = None) -> dict[str, Any] | None:
        try:
            return self.request("GET", kind.path(namespace, name, sub))
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, kind: Kind, namespace: str | None, label_selector: str | None = None) -> list[dict[str, Any]]:
        query = {"labelSelector": label_selector} if label_selector else None
        return list(self.request("GET", kind.path(namespace), query=query).get("items", []))

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        kind = kind_of(obj)
        return self.request("POST", kind.path(obj["metadata"].get("namespace")), body=obj)

    def merge_patch(
        self, kind: Kind, namespace: str | None, name: str, patch: dict[str, Any], sub: str | None = None
    ) -> dict[str, Any]:
        return self.request(
            "PATCH", kind.path(namespace, name, sub), body=patch, content_type="application/merge-patch+json"
        )

    def post_event(self, involved: dict[str, Any], type_: ev.EventType, reason: str, message: str) -> None:
        event = ev.body(involved, type_, reason, message, datetime.datetime.now(datetime.UTC))
        self.create(event)

    def delete(self, kind: Kind, namespace: str | None, name: str) -> None:
        try:
            self.request("DELETE", kind.path(namespace, name))
        except KubeError as exc:
            if exc.status != 404:
                raise
