"""Services: the decode group headless Service, the router Service, the endpoint picker's."""

from __future__ import annotations

from typing import Any

from pdserve_common import pod_env as E
from pdserve_operator import spec as s
from pdserve_operator.reconcile.children.meta import (
    Owner,
    epp_service_name,
    headless_name,
    object_meta,
    router_service_name,
    selector_labels,
)


def headless_service(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(owner, headless_name(owner.name), "decode"),
        "spec": {
            "clusterIP": "None",
            # Members of a group must find each other before any of them is ready.
            "publishNotReadyAddresses": True,
            "selector": selector_labels(owner.name, "decode"),
            "ports": [
                {"name": "grpc", "port": E.GRPC_PORT, "targetPort": "grpc", "protocol": "TCP"},
                {"name": "http", "port": E.HTTP_PORT, "targetPort": "http", "protocol": "TCP"},
            ],
        },
    }


def router_service(owner: Owner, spec: s.PDInferenceServiceSpec) -> dict[str, Any]:
    svc = spec.router.service
    port: dict[str, Any] = {"name": "http", "port": svc.port, "targetPort": "http", "protocol": "TCP"}
    if svc.node_port is not None:
        port["nodePort"] = svc.node_port
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(owner, router_service_name(owner.name), "router"),
        "spec": {"type": svc.type, "selector": selector_labels(owner.name, "router"), "ports": [port]},
    }


def epp_service(owner: Owner, port: int) -> dict[str, Any]:
    """The routers' endpoint-picker port as a ClusterIP Service: what the pool's endpointPickerRef names."""
    ext_proc = {"name": "grpc-ext-proc", "port": port, "targetPort": port, "protocol": "TCP", "appProtocol": "http2"}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(owner, epp_service_name(owner.name), "router"),
        "spec": {"type": "ClusterIP", "selector": selector_labels(owner.name, "router"), "ports": [ext_proc]},
    }
