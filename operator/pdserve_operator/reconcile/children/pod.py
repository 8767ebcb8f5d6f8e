"""The pod template of one role: the worker container, its probes, volumes and security context."""

from __future__ import annotations

from typing import Any

from pdserve_common import pod_env as E
from pdserve_operator import spec as s
from pdserve_operator.reconcile.children.config_map import ANNOTATION_SPEC_HASH, CONFIG_DIR, config_hash
from pdserve_operator.reconcile.children.env import MODELS_DIR, PREFIX_DISK_DIR, container_env, pvc_claim
from pdserve_operator.reconcile.children.meta import Defaults, Owner, config_name, labels, quantity

WORKER_UID = 1000


def _resources(role: str, spec: s.PDInferenceServiceSpec, overrides: s.PodOverrides) -> dict[str, Any]:
    requests = {k: quantity(v) for k, v in overrides.resources.requests.items()}
    limits = {k: quantity(v) for k, v in overrides.resources.limits.items()}
    device = spec.device
    if role in ("prefill", "decode") and device.type != "cpu" and device.resource_name and device.count:
        # Extended resources must be requested with requests == limits; spec.device wins. A
        # tensor-parallel pod runs one rank per device.count of them.
        ranks = spec.prefill.tensor_parallel_size if role == "prefill" else spec.decode.tensor_parallel_size
        requests[device.resource_name] = limits[device.resource_name] = quantity(device.count * ranks)
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    """On the `probe` port (pod_env.PROBE_PORT: plain HTTP, /healthz and /readyz only), which no
    NetworkPolicy rule opens to pods: a flood of the serving port cannot fail it (#58 A2)."""
    return {
        "httpGet": {"path": path, "port": "probe"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 2,
    }


def worker_image(role: str, spec: s.PDInferenceServiceSpec, defaults: Defaults) -> str:
    """The router runs spec.image (else the operator's); prefill and decode run their engine's
    image: with vllm, spec.vllmImage, else the operator's vLLM image for the device type."""
    if role in ("prefill", "decode") and spec.engine == "vllm":
        return spec.vllm_image or defaults.vllm_images[spec.device.type]
    return spec.image or defaults.image


def _container(
    owner: Owner, role: str, spec: s.PDInferenceServiceSpec, defaults: Defaults, mounts: list[dict[str, Any]]
) -> dict[str, Any]:
    """The worker container: image, environment, ports, probes, a locked-down security context;
    a decode's transfer port and preStop drain."""
    container: dict[str, Any] = {
        "name": "worker",
        "image": worker_image(role, spec, defaults),
        "imagePullPolicy": defaults.image_pull_policy,
        "command": ["pdserve"],
        "args": ["worker", "--role", role],
        "env": container_env(owner, role, spec, defaults),
        "ports": [
            {"name": "http", "containerPort": E.HTTP_PORT, "protocol": "TCP"},
            {"name": "probe", "containerPort": E.PROBE_PORT, "protocol": "TCP"},
            {"name": "grpc", "containerPort": E.GRPC_PORT, "protocol": "TCP"},
        ],
        "readinessProbe": _probe("/readyz", 5, 3),
        "livenessProbe": _probe("/healthz", 10, 6),
        # Loading a model can take minutes; liveness starts counting only after this succeeds.
        "startupProbe": _probe("/healthz", 5, 120),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": mounts,
    }
    resources = _resources(role, spec, getattr(spec, role))
    if resources:
        container["resources"] = resources
    if role == "decode":
        container["ports"].append({"name": "transfer", "containerPort": E.TRANSFER_PORT, "protocol": "TCP"})
        # Contract (pod_env.py): `pdserve drain` calls GET /drain on the admin port, which listens
        # on 127.0.0.1 only, and returns once the pod's slots are drained or timed out.
        container["lifecycle"] = {"preStop": {"exec": {"command": ["pdserve", "drain"]}}}
    return container


def _storage(
    owner: Owner, role: str, spec: s.PDInferenceServiceSpec
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The worker's volume mounts and the pod's volumes."""
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": config_name(owner.name)}},
        {"name": "tmp", "emptyDir": {}},
    ]
    # Which member this pod is, for the broker (#58 A4): a token bound to this pod, for the
    # broker's audience only, rotated by the kubelet (broker/token_review.py checks it).
    mounts.append({"name": "identity", "mountPath": E.IDENTITY_DIR, "readOnly": True})
    token = {"audience": E.BROKER_AUDIENCE, "expirationSeconds": 3600, "path": "token"}
    volumes.append(
        {"name": "identity", "projected": {"defaultMode": 0o440, "sources": [{"serviceAccountToken": token}]}}
    )
    if spec.tls is not None:
        mounts.append({"name": "tls", "mountPath": E.TLS_DIR, "readOnly": True})
        volumes.append({"name": "tls", "secret": {"secretName": spec.tls.secret_name, "defaultMode": 0o440}})
    if role == "router" and spec.router.auth is not None:
        # A directory mount, not subPath: the kubelet swaps the files on a Secret update, and the
        # router re-reads them (a subPath mount would never change).
        mounts.append({"name": "api-keys", "mountPath": E.API_KEYS_DIR, "readOnly": True})
        volumes.append(
            {
                "name": "api-keys",
                "secret": {
                    "secretName": spec.router.auth.secret_name,
                    "defaultMode": 0o440,
                    "items": [{"key": E.API_KEYS_KEY, "path": E.API_KEYS_KEY}],
                },
            }
        )
    if role in ("prefill", "decode"):
        # The host transfer engine keeps KV pools in shared memory; the container default is 64 MiB.
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
        if role == "prefill" and spec.prefill.prefix_disk_gib is not None:
            mounts.append({"name": "prefix-disk", "mountPath": PREFIX_DISK_DIR})
            volumes.append({"name": "prefix-disk", "emptyDir": {"sizeLimit": f"{spec.prefill.prefix_disk_gib}Gi"}})
        claim = pvc_claim(spec.model.source)
        if claim is not None:
            mounts.append({"name": "model", "mountPath": MODELS_DIR, "readOnly": True})
            volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
    return mounts, volumes


def pod_template(owner: Owner, role: str, spec: s.PDInferenceServiceSpec, defaults: Defaults) -> dict[str, Any]:
    """The pod of one role: the worker container (`_container`) and the pod's own settings."""
    overrides: s.PodOverrides = getattr(spec, role)
    mounts, volumes = _storage(owner, role, spec)
    container = _container(owner, role, spec, defaults, mounts)
    grace = spec.decode.drain_timeout_seconds + 15 if role == "decode" else 30
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": grace,
        "automountServiceAccountToken": False,  # workers talk to the broker, never to the API
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": WORKER_UID,
            "runAsGroup": WORKER_UID,
            "fsGroup": WORKER_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    if overrides.node_selector:
        pod_spec["nodeSelector"] = dict(overrides.node_selector)
    if overrides.tolerations:
        pod_spec["tolerations"] = [t.wire() for t in overrides.tolerations]
    return {
        "metadata": {
            "labels": labels(owner.name, role),
            "annotations": {ANNOTATION_SPEC_HASH: config_hash(spec)},
        },
        "spec": pod_spec,
    }
