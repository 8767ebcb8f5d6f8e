"""Operator settings and the objects the kopf handlers share (passed to kopf as its `memo`)."""

from __future__ import annotations

import hashlib
import logging
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from pdserve_common.auth import TLSConfig
from pdserve_operator.broker.view import BrokerView, NullBrokerView
from pdserve_operator.kube import RestKubeClient
from pdserve_operator.metrics import OperatorMetrics
from pdserve_operator.reconcile.children.meta import VLLM_IMAGES, Defaults
from pdserve_operator.reconcile.reconciler import Reconciler

log = logging.getLogger(__name__)


class OperatorConfig(BaseSettings):
    """From flags of `pdserve operator` or PDSERVE_OPERATOR_* variables (the Deployment's env)."""

    model_config = SettingsConfigDict(env_prefix="PDSERVE_OPERATOR_", extra="ignore")

    namespaces: list[str] = Field(default_factory=list, description="Namespaces to watch; empty means all.")
    image: str = Field("pdserve:0.1.0", description="Worker image when a resource sets none.")
    image_pull_policy: str = Field("IfNotPresent", description="imagePullPolicy of the worker containers.")
    vllm_image_cpu: str = Field(
        VLLM_IMAGES["cpu"],
        description="Prefill/decode image with engine vllm on device cpu (vllm-cpu), unless vllmImage.",
    )
    vllm_image_cuda: str = Field(
        VLLM_IMAGES["cuda"],
        description="Prefill/decode image with engine vllm on device cuda (vllm), unless vllmImage.",
    )
    vllm_image_npu: str = Field(
        VLLM_IMAGES["npu"],
        description="Prefill/decode image with engine vllm on device npu (vllm-ascend), unless vllmImage.",
    )
    broker_host: str = Field("0.0.0.0", description="Address the gRPC broker binds.")
    broker_port: int = Field(50070, description="Port the gRPC broker listens on.")
    broker_address: str = Field(
        "pdserve-operator.pdserve-system.svc:50070", description="How pods reach the broker (host:port)."
    )
    standalone: bool = Field(False, description="No peering: only for a single operator replica.")
    peering: str = Field("pdserve", description="kopf peering name shared by the operator replicas.")
    priority: int | None = Field(None, description="Peering priority; derived from the pod name when unset.")
    replicas: int | None = Field(
        None,
        ge=1,
        description="How many operator replicas run (the chart sets it). With 1, a missing peering object "
        "means standalone with a warning; otherwise (or unknown) the operator waits for it.",
    )
    peering_lifetime_seconds: int = Field(
        15,
        ge=5,
        le=3600,
        description="How long a replica's peering record counts as alive without a refresh (kopf's lifetime; its "
        "default is 60): after an unclean death (SIGKILL, OOM) neither a restarted operator nor a standby acts "
        "before the dead record is this old (benchmarks/operator_failover.py: 58 s at 60, 13 s at 15).",
    )
    peering_report_seconds: float = Field(
        30.0, gt=0, description="While the peering object is missing, say so this often."
    )
    resync_seconds: float = Field(30.0, gt=0, description="Reconcile each resource at least this often.")
    liveness: str | None = Field(None, description="kopf liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    metrics_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="Port of the operator's Prometheus /metrics (reconciles, replicas by role); 0: not served.",
    )
    kubeconfig: str | None = Field(None, description="kubeconfig outside a cluster (in a pod: the service account).")
    network_policy: bool = Field(
        True,
        description="Give each service a NetworkPolicy: gRPC/transfer ports open only within the service "
        "(on by default: real HIXL does not authenticate KV-transfer peers).",
    )
    pod_namespace: str = Field(
        "pdserve-system", description="The operator's own namespace (downward API): the NetworkPolicy's operator peer."
    )
    watch_leader_worker_sets: bool = Field(
        False,
        description="Watch the LeaderWorkerSets of decode groups (groupScheduling leaderWorkerSet), so a group's "
        "readiness shows at once, not at the next resync; needs list/watch on them (the chart's "
        "leaderWorkerSet.enabled sets both).",
    )
    objective_api_version: Literal["llm-d.ai/v1alpha2", "inference.networking.x-k8s.io/v1alpha2"] = Field(
        "llm-d.ai/v1alpha2",
        description="apiVersion of the InferenceObjectives rendered for spec.router.inferencePool.objectives: "
        "llm-d-router's (current), or the Inference Extension's up to v1.5 (the chart's "
        "inferencePool.objectiveApiVersion).",
    )
    tls_cert: str | None = Field(None, description="The broker's TLS certificate (PEM); with key and ca: mutual TLS.")
    tls_key: str | None = Field(None, description="The broker's TLS private key (PEM).")
    tls_ca: str | None = Field(None, description="CA that workers' client certificates must chain to (PEM).")

    def broker_tls(self) -> TLSConfig | None:
        """The broker's TLS, when configured: all three files or none."""
        files = {"tls_cert": self.tls_cert, "tls_key": self.tls_key, "tls_ca": self.tls_ca}
        if not any(files.values()):
            return None
        missing = [name for name, value in files.items() if not value]
        if missing:
            raise ValueError(f"broker TLS needs a certificate, its key and the CA; missing {', '.join(missing)}")
        return TLSConfig(Path(self.tls_cert), Path(self.tls_key), Path(self.tls_ca))  # type: ignore[arg-type]


def derived_priority(identity: str | None = None) -> int:
    """A stable, practically unique peering priority per replica.

    kopf pauses every operator that sees a live peer of higher priority, so distinct priorities
    make exactly one replica active: that is the leader election (a dead leader's peering record
    expires and the next highest resumes). Equal priorities pause both (seen with the e2e peering
    test's two replicas set equal: nothing was reconciled), hence the hash.
    """
    name = identity or socket.gethostname()
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big") % 1_000_000 + 1


@dataclass
class Runtime:
    """What every handler needs; built once per operator process."""

    config: OperatorConfig
    kube: RestKubeClient
    broker: BrokerView
    reconciler: Reconciler
    broker_server: Any = None
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    last_sync: dict[tuple[str, str], float] = field(default_factory=dict)

    def resync_due(self, namespace: str, name: str) -> bool:
        now = time.monotonic()
        last = self.last_sync.get((namespace, name))
        if last is not None and now - last < self.config.resync_seconds:
            return False
        self.last_sync[(namespace, name)] = now
        return True

    def close(self) -> None:
        if self.broker_server is not None:
            self.broker_server.stop(5)
        self.kube.close()


def build_runtime(
    config: OperatorConfig,
    broker: BrokerView | None = None,
    broker_server: Any = None,
    kube: RestKubeClient | None = None,
) -> Runtime:
    kube = kube or RestKubeClient.from_environment(config.kubeconfig)
    broker = broker or NullBrokerView()
    defaults = Defaults(
        image=config.image,
        vllm_images={"cpu": config.vllm_image_cpu, "cuda": config.vllm_image_cuda, "npu": config.vllm_image_npu},
        broker_address=config.broker_address,
        image_pull_policy=config.image_pull_policy,
        network_policy=config.network_policy,
        operator_namespace=config.pod_namespace,
        broker_tls=config.broker_tls() is not None,
        objective_api_version=config.objective_api_version,
    )
    metrics = OperatorMetrics()
    return Runtime(
        config=config,
        kube=kube,
        broker=broker,
        broker_server=broker_server,
        metrics=metrics,
        reconciler=Reconciler(kube, broker, defaults, metrics=metrics),
    )
