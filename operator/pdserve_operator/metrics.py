"""The operator's Prometheus metrics: reconcile outcomes and every service's replicas by role.

The alert rules the chart ships (charts/pdserve/templates/prometheusrule.yaml) need two things
no router can tell: whether reconciles fail, and whether a service has no ready prefill or
decode at all (then its routers may be down too, or report nothing). The operator already
computes both for the status, so it publishes them here, in a registry of its own (several
operators in one test process never collide), served on `metricsPort` by `serve()`.

The service's namespace is the label `pdis_namespace`, not `namespace`: Prometheus gives every
scraped series a `namespace` target label (the operator's own), which would rename ours.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.exposition import generate_latest

from pdserve_operator import spec as s

_PREFIX = "pdserve_operator"
ROLES = ("prefill", "decode", "router")
RESULTS = ("ok", "invalid", "error")


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.reconciles = Counter(
            f"{_PREFIX}_reconciles",
            "Reconciles of a PDInferenceService, by result: ok, invalid (the spec was "
            "refused; status says why), error (an API call failed; kopf retries).",
            ["result"],
            registry=r,
        )
        labels = ["pdis_namespace", "pdis", "role"]
        self.desired = Gauge(
            f"{_PREFIX}_replicas_desired",
            "Pods (router, prefill) or decode groups the spec asks for.",
            labels,
            registry=r,
        )
        self.ready = Gauge(
            f"{_PREFIX}_replicas_ready", "Ready pods or complete ready decode groups.", labels, registry=r
        )
        self.slots_total = Gauge(
            f"{_PREFIX}_kv_slots_total",
            "KV slots of all ready decode groups of a service.",
            ["pdis_namespace", "pdis"],
            registry=r,
        )
        for result in RESULTS:  # present from the start, so that rate() sees the first error
            self.reconciles.labels(result=result)

    def observe_reconcile(self, result: str) -> None:
        if result not in RESULTS:
            raise ValueError(f"reconcile result must be one of {RESULTS}, got {result!r}")
        self.reconciles.labels(result=result).inc()

    def observe_status(self, namespace: str, name: str, status: s.PDInferenceServiceStatus) -> None:
        for role in ROLES:
            counts: s.RoleStatus = getattr(status, role)
            self.desired.labels(pdis_namespace=namespace, pdis=name, role=role).set(counts.desired)
            self.ready.labels(pdis_namespace=namespace, pdis=name, role=role).set(counts.ready)
        self.slots_total.labels(pdis_namespace=namespace, pdis=name).set(status.slots.total)

    def forget(self, namespace: str, name: str) -> None:
        """A deleted service's series go with it (an alert must not fire for what is gone)."""
        for role in ROLES:
            for gauge in (self.desired, self.ready):
                try:
                    gauge.remove(namespace, name, role)
                except KeyError:
                    pass
        try:
            self.slots_total.remove(namespace, name)
        except KeyError:
            pass

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def serve(self, host: str, port: int) -> tuple[Any, threading.Thread]:
        """`/metrics` on host:port in a daemon thread; returns (server, thread) to shut it down."""
        return start_http_server(port, addr=host, registry=self.registry)
