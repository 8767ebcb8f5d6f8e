"""Spec → the Kubernetes objects a PDInferenceService owns. Pure: no I/O, no clock, no randomness.

`render(owner, spec, token, defaults)` returns every child as a plain dict, in the order they
should be applied (Secret and ConfigMap before the pods that mount them). The reconciler applies
them idempotently and compares them with what is live (`drift.py`), so everything rendered here
must be stable for equal inputs and must not contain fields the API server drops (empty strings,
false booleans, empty lists): those would read as drift forever.

Decode layer sharding: a decode *group* is `layerShards` pods. The StatefulSet runs
`replicas × layerShards` pods; each pod derives (group, member) from its ordinal
(`pdserve_common.pod_env.group_member`), so the operator only has to pass the shard count.
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from pdserve_common import credentials as C
from pdserve_common import pod_env as E
from pdserve_operator import spec as s
from pdserve_operator.spec import scaling_adapter as sa

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "pdserve-operator"
APP = "pdserve"
ANNOTATION_SPEC_HASH = "pdserve.dev/config-hash"
TOKEN_KEY = C.TOKEN_KEY
CONFIG_KEY = "service.json"
CONFIG_DIR = "/etc/pdserve"
MODELS_DIR = "/models"
PREFIX_DISK_DIR = "/var/cache/pdserve/prefix"  # the prefill's emptyDir for the prefix cache's disk tier
WORKER_UID = 1000
# Labels of the operator's own pods (the Helm chart sets them): a NetworkPolicy peer.
OPERATOR_POD_LABELS = {LABEL_NAME: "pdserve-operator"}

ROLES = ("prefill", "decode", "router")


@dataclass(frozen=True)
class Owner:
    """The PDInferenceService children belong to (what ownerReferences need)."""

    name: str
    namespace: str
    uid: str

    @property
    def key(self) -> str:
        """The broker's service key."""
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class Defaults:
    """Operator-wide settings that the spec may leave unset."""

    image: str
    broker_address: str
    image_pull_policy: str = "IfNotPresent"
    # A NetworkPolicy per service (see `network_policy`). On by default: real HIXL admits any
    # peer that reaches its port, so the policy is what keeps other pods off the KV plane
    # (a cluster without a policy-enforcing CNI ignores it; one with a default-deny needs it).
    network_policy: bool = True
    operator_namespace: str = "pdserve-system"  # where the operator pods run (a policy peer)
    # The operator's broker speaks (mutual) TLS: workers must dial it with TLS and present their
    # service's certificate (spec.tls), issued by the same CA as the broker's.
    broker_tls: bool = False


# ---------------------------------------------------------------------------------------------
# Names and labels


def secret_name(name: str) -> str:
    return f"{name}-broker-token"


def config_name(name: str) -> str:
    return f"{name}-config"


def workload_name(name: str, role: str) -> str:
    return f"{name}-{role}"


def headless_name(name: str) -> str:
    return f"{name}-decode-headless"


def router_service_name(name: str) -> str:
    """The router Service carries the resource's own name: it is the service users call."""
    return name


def selector_labels(name: str, role: str | None = None) -> dict[str, str]:
    labels = {LABEL_NAME: APP, LABEL_INSTANCE: name}
    if role is not None:
        labels[LABEL_COMPONENT] = role
    return labels


def labels(name: str, role: str | None = None) -> dict[str, str]:
    return {**selector_labels(name, role), LABEL_MANAGED_BY: MANAGED_BY}


def selector_string(name: str, role: str) -> str:
    """A label selector in the string form the scale subresource reports."""
    return ",".join(f"{k}={v}" for k, v in selector_labels(name, role).items())


def endpoint(owner: Owner, spec: s.PDInferenceServiceSpec) -> str:
    scheme = "https" if spec.tls is not None else "http"
    return f"{scheme}://{router_service_name(owner.name)}.{owner.namespace}.svc:{spec.router.service.port}/v1"


def tls_server_name(owner: Owner, spec: s.PDInferenceServiceSpec) -> str:
    """The name peers check the service's certificate under: spec.tls.serverName, else the
    router Service's DNS name (which the certificate needs for HTTPS clients anyway)."""
    assert spec.tls is not None
    return spec.tls.server_name or f"{router_service_name(owner.name)}.{owner.namespace}.svc"


def owner_reference(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": s.API_VERSION,
        "kind": s.KIND,
        "name": owner.name,
        "uid": owner.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _meta(owner: Owner, name: str, role: str | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": labels(owner.name, role),
        "ownerReferences": [owner_reference(owner)],
        **extra,
    }


# ---------------------------------------------------------------------------------------------
# Config shared by the pods


def service_config(spec: s.PDInferenceServiceSpec) -> dict[str, Any]:
    """What pods read from the ConfigMap: the spec without replica counts or autoscaling.

    Both are left out so that scaling does not change the config hash and roll every pod of
    every role.
    """
    wire = spec.wire()
    for role in ROLES:
        wire.get(role, {}).pop("replicas", None)
    wire.pop("autoscaling", None)  # who scales a role is no pod's business: changing it rolls nothing
    return wire


def config_hash(spec: s.PDInferenceServiceSpec) -> str:
    blob = json.dumps(service_config(spec), sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _quantity(value: int | str) -> str:
    """Quantities as the API server returns them (strings), so comparisons are like with like."""
    return str(value)


def _resources(role: str, spec: s.PDInferenceServiceSpec, overrides: s.PodOverrides) -> dict[str, Any]:
    requests = {k: _quantity(v) for k, v in overrides.resources.requests.items()}
    limits = {k: _quantity(v) for k, v in overrides.resources.limits.items()}
    device = spec.device
    if role in ("prefill", "decode") and device.type != "cpu" and device.resource_name and device.count:
        # Extended resources must be requested with requests == limits; spec.device wins. A
        # tensor-parallel pod runs one rank per device.count of them.
        ranks = spec.prefill.tensor_parallel_size if role == "prefill" else spec.decode.tensor_parallel_size
        requests[device.resource_name] = limits[device.resource_name] = _quantity(device.count * ranks)
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _val(name: str, value: object) -> dict[str, Any]:
    text = value if isinstance(value, str) else json.dumps(value)
    return {"name": name, "value": text}


def _field(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}}


def _env(owner: Owner, role: str, spec: s.PDInferenceServiceSpec, defaults: Defaults) -> list[dict[str, Any]]:
    """The worker's environment: what every pod reads, what its role reads, then the user's
    own variables (never one of ours: they are the contract with the worker)."""
    env = [_val(E.ROLE, role), *_credentials_env(owner, role), *_common_env(owner, spec, defaults)]
    env += {"router": _router_env, "prefill": _prefill_env, "decode": _decode_env}[role](owner, spec)
    overrides: s.PodOverrides = getattr(spec, role)
    ours = {e["name"] for e in env}
    # The operator's variables are the contract with the worker: user env cannot replace them.
    env += [
        {"name": e.name, "value": e.value} if e.value else {"name": e.name}
        for e in overrides.env
        if e.name not in ours and not e.name.startswith("PDSERVE_")
    ]
    return env


def _from_secret(owner: Owner, name: str, key: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret_name(owner.name), "key": key}}}


def _credentials_env(owner: Owner, role: str) -> list[dict[str, Any]]:
    """A pod's part of the service's Secret (pdserve_common/credentials.py, issue #29): its
    role's token, never the service token; keys where it moves KV; whom its server admits."""
    return [_from_secret(owner, name, key) for name, key in C.pod_keys(role).items()]


def _common_env(owner: Owner, spec: s.PDInferenceServiceSpec, defaults: Defaults) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        _val(E.SERVICE, owner.key),
        _field(E.NAMESPACE, "metadata.namespace"),
        _field(E.POD_NAME, "metadata.name"),
        _field(E.POD_IP, "status.podIP"),
        _val(E.BROKER_ADDRESS, defaults.broker_address),
        _val(E.HTTP_PORT_ENV, E.HTTP_PORT),
        _val(E.PROBE_PORT_ENV, E.PROBE_PORT),
        _val(E.GRPC_PORT_ENV, E.GRPC_PORT),
        _val(E.CONFIG_FILE, f"{CONFIG_DIR}/{CONFIG_KEY}"),
        _val(E.MODEL_NAME, spec.model.name),
        _val(E.MODEL_SOURCE, _model_source_in_pod(spec.model.source)),
        _val(E.MODEL_DTYPE, spec.model.dtype),
        _val(E.MAX_LENGTH, spec.model.max_length),
        _val(E.DEVICE, spec.device.type),
        _val(E.DEVICE_COUNT, spec.device.count if spec.device.type != "cpu" else 0),
        _val(E.TRANSFER_BACKEND, spec.transfer.backend),
        _val(E.QUEUE_DEPTH, spec.transfer.queue_depth),
        _val(E.CONNECT_TIMEOUT_MS, spec.transfer.connect_timeout_ms),
        _val(E.TRANSFER_TIMEOUT_MS, spec.transfer.transfer_timeout_ms),
        _val(E.ENGINE_OPTIONS, json.dumps(spec.transfer.engine_options, sort_keys=True)),
        _val("HOME", "/tmp"),  # the root filesystem is read-only; caches go to the emptyDir
    ]
    if spec.tls is not None:
        env += [
            _val(E.TLS_CERT, f"{E.TLS_DIR}/{E.TLS_CERT_KEY}"),
            _val(E.TLS_KEY, f"{E.TLS_DIR}/{E.TLS_KEY_KEY}"),
            _val(E.TLS_CA, f"{E.TLS_DIR}/{E.TLS_CA_KEY}"),
            _val(E.TLS_SERVER_NAME, tls_server_name(owner, spec)),
        ]
    if spec.observability.tracing is not None:
        env += [
            _val(E.TRACING_ENDPOINT, spec.observability.tracing.endpoint),
            _val(E.TRACING_SAMPLE_RATIO, spec.observability.tracing.sample_ratio),
        ]
    if spec.tls is not None or defaults.broker_tls:
        # Explicit either way: a broker with TLS and a service without spec.tls is a clear start error.
        env.append(_val(E.BROKER_TLS, defaults.broker_tls))
    return env


def _router_env(owner: Owner, spec: s.PDInferenceServiceSpec) -> list[dict[str, Any]]:
    a = spec.router.admission
    env = [
        _val(E.ADMISSION_QUEUE, a.queue_size),
        _val(E.ADMISSION_PER_TENANT, a.per_tenant),
        _val(E.ADMISSION_DEADLINE_SECONDS, a.deadline_seconds),
        # Each router enforces its share of every tenant's limits (docs/admission.md).
        _val(E.ROUTER_REPLICAS, max(spec.router.replicas, 1)),
    ]
    if spec.router.auth is not None:
        env.append(_val(E.API_KEYS_FILE, f"{E.API_KEYS_DIR}/{E.API_KEYS_KEY}"))
    if spec.router.endpoint_picker_port is not None:  # (gateway/ext_proc.py, docs/gateway.md)
        env.append(_val(E.EPP_PORT_ENV, spec.router.endpoint_picker_port))
    return env


def _prefill_env(owner: Owner, spec: s.PDInferenceServiceSpec) -> list[dict[str, Any]]:
    env = [_val(E.LAYERS_PER_CHUNK, spec.prefill.layers_per_chunk)]
    if spec.prefill.tensor_parallel_size > 1:  # rank 0 (the container's process) starts the others
        env.append(_val(E.TENSOR_PARALLEL, spec.prefill.tensor_parallel_size))
    if spec.prefill.prefix_cache_tokens is not None:  # unset: the worker sizes it from its memory limit
        env.append(_val(E.PREFIX_CACHE_TOKENS, spec.prefill.prefix_cache_tokens))
    if spec.prefill.prefix_disk_gib is not None:
        env.append(_val(E.PREFIX_DISK_DIR, PREFIX_DISK_DIR))
        # 95% of the volume: the kubelet evicts a pod whose emptyDir passes its sizeLimit.
        env.append(_val(E.PREFIX_DISK_BYTES, int(spec.prefill.prefix_disk_gib * 2**30 * 0.95)))
    return env


def _decode_env(owner: Owner, spec: s.PDInferenceServiceSpec) -> list[dict[str, Any]]:
    d = spec.decode
    env = [
        *([_val(E.TENSOR_PARALLEL, d.tensor_parallel_size)] if d.tensor_parallel_size > 1 else []),
        _val(E.SLOTS, d.slots),
        _val(E.KV_BLOCK_TOKENS, d.kv_block_tokens),
        # Unset: the decode sizes its pool itself, slots x maxLength capped by its memory.
        *([_val(E.KV_TOKENS, d.kv_tokens)] if d.kv_block_tokens and d.kv_tokens is not None else []),
        _val(E.READINESS_MODE, d.readiness),
        _val(E.WARMUP, d.warmup),
        _val(E.LAYER_SHARDS, d.layer_shards),
        _val(E.DECODE_SERVICE, headless_name(owner.name)),
        _val(E.DRAIN_TIMEOUT_SECONDS, d.drain_timeout_seconds),
        *(_lws_env(owner, spec) if d.group_scheduling == "leaderWorkerSet" else []),
    ]
    if d.readiness == "poll":
        env.append(_val(E.POLL_INTERVAL_MICROS, d.poll_interval_micros or 100))
    return env


def kv_tokens_per_group(spec: s.PDInferenceServiceSpec) -> int:
    """KV tokens one decode group holds: kvTokens, else slots x model.maxLength (also what a slot
    pool holds)."""
    d = spec.decode
    if d.kv_block_tokens and d.kv_tokens is not None:
        return d.kv_tokens
    return d.slots * spec.model.max_length


def _model_source_in_pod(source: str) -> str:
    """pvc://claim/sub → the path where the claim is mounted; other sources pass through."""
    if source.startswith("pvc://"):
        _, _, sub = source.removeprefix("pvc://").partition("/")
        return f"{MODELS_DIR}/{sub}".rstrip("/")
    return source


def _pvc_claim(source: str) -> str | None:
    if not source.startswith("pvc://"):
        return None
    return source.removeprefix("pvc://").partition("/")[0]


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    """On the `probe` port (pod_env.PROBE_PORT: plain HTTP, /healthz and /readyz only), which no
    NetworkPolicy rule opens to pods: a flood of the serving port cannot fail it (#58 A2)."""
    return {
        "httpGet": {"path": path, "port": "probe"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 2,
    }


def _container(
    owner: Owner, role: str, spec: s.PDInferenceServiceSpec, defaults: Defaults, mounts: list[dict[str, Any]]
) -> dict[str, Any]:
    """The worker container: image, environment, ports, probes, a locked-down security context;
    a decode's transfer port and preStop drain."""
    container: dict[str, Any] = {
        "name": "worker",
        "image": spec.image or defaults.image,
        "imagePullPolicy": defaults.image_pull_policy,
        "command": ["pdserve"],
        "args": ["worker", "--role", role],
        "env": _env(owner, role, spec, defaults),
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
        claim = _pvc_claim(spec.model.source)
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


# ---------------------------------------------------------------------------------------------
# The children


def secret(owner: Owner, token: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(owner, secret_name(owner.name)),
        "type": "Opaque",
        "data": {key: base64.b64encode(value.encode()).decode() for key, value in C.secret_data(token).items()},
    }


def token_of(secret_obj: dict[str, Any] | None) -> str | None:
    """The broker token kept in a live Secret, if it holds a usable one."""
    raw = ((secret_obj or {}).get("data") or {}).get(TOKEN_KEY)
    if not raw:
        return None
    try:
        token = base64.b64decode(raw, validate=True).decode()
    except (ValueError, UnicodeDecodeError):
        return None
    return token or None


def config_map(owner: Owner, spec: s.PDInferenceServiceSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(owner, config_name(owner.name)),
        "data": {CONFIG_KEY: json.dumps(service_config(spec), sort_keys=True, indent=2)},
    }


def initial_replicas(spec: s.PDInferenceServiceSpec, role: str) -> int:
    """The role's count as rendered: the spec's, or for an autoscaled role the count its
    workload is created with (its floor; with driver external, the spec's as written). Once
    the workload exists, an autoscaled role's count is never written by the operator's apply
    (`autoscaled_workloads`)."""
    replicas: int = getattr(spec, role).replicas
    if not s.autoscaled(spec, role):
        return replicas
    assert spec.autoscaling is not None
    return replicas if getattr(spec.autoscaling, role).driver == "external" else s.effective_min(spec, role)


def autoscaled_workloads(name: str, spec: s.PDInferenceServiceSpec) -> set[tuple[str, str]]:
    """(kind, name) of the workloads whose spec.replicas belongs to an autoscaler, not to us."""
    kinds = {"prefill": "Deployment", "decode": decode_kind(spec)[1]}
    return {(kinds[role], workload_name(name, role)) for role in kinds if s.autoscaled(spec, role)}


def hpa_name(name: str, role: str) -> str:
    return workload_name(name, role)


def _metric_spec(metric: s.HPAMetric) -> dict[str, Any]:
    t = metric.target
    target: dict[str, Any] = {"type": t.type}
    if t.average_utilization is not None:
        target["averageUtilization"] = t.average_utilization
    if t.average_value is not None:
        target["averageValue"] = _quantity(t.average_value)
    if t.value is not None:
        target["value"] = _quantity(t.value)
    if metric.type == "Resource":
        return {"type": "Resource", "resource": {"name": metric.name, "target": target}}
    ident: dict[str, Any] = {"name": metric.name}
    if metric.selector:
        ident["selector"] = {"matchLabels": dict(metric.selector)}
    key = "pods" if metric.type == "Pods" else "external"
    return {"type": metric.type, key: {"metric": ident, "target": target}}


def horizontal_pod_autoscaler(owner: Owner, role: str, spec: s.PDInferenceServiceSpec) -> dict[str, Any]:
    """An autoscaling/v2 HPA on the role's workload, for driver hpa. Its windows are the spec's."""
    a = spec.autoscaling
    assert a is not None
    r: s.RoleAutoscaling = getattr(a, role)
    assert r.metric is not None
    api, kind = ("apps/v1", "Deployment") if role == "prefill" else decode_kind(spec)
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _meta(owner, hpa_name(owner.name, role), role),
        "spec": {
            "scaleTargetRef": {"apiVersion": api, "kind": kind, "name": workload_name(owner.name, role)},
            "minReplicas": s.effective_min(spec, role),
            "maxReplicas": r.max_replicas,
            "metrics": [_metric_spec(r.metric)],
            "behavior": {
                "scaleUp": {"stabilizationWindowSeconds": a.scale_up_window_seconds},
                "scaleDown": {"stabilizationWindowSeconds": a.scale_down_window_seconds},
            },
        },
    }


def hpa_roles(spec: s.PDInferenceServiceSpec) -> list[str]:
    a = spec.autoscaling
    return [
        r for r in ("prefill", "decode") if a is not None and getattr(a, r).enabled and getattr(a, r).driver == "hpa"
    ]


def deployment(owner: Owner, role: str, spec: s.PDInferenceServiceSpec, defaults: Defaults) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(owner, workload_name(owner.name, role), role),
        "spec": {
            "replicas": initial_replicas(spec, role),
            "selector": {"matchLabels": selector_labels(owner.name, role)},
            "template": pod_template(owner, role, spec, defaults),
        },
    }


def decode_statefulset(owner: Owner, spec: s.PDInferenceServiceSpec, defaults: Defaults) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(owner, workload_name(owner.name, "decode"), "decode"),
        "spec": {
            "replicas": decode_pods(spec),
            "serviceName": headless_name(owner.name),
            # Members of a group start together; ordered start would serialise model loads.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector_labels(owner.name, "decode")},
            "template": pod_template(owner, "decode", spec, defaults),
            "updateStrategy": {"type": "RollingUpdate"},
        },
    }


# LeaderWorkerSet (sigs.k8s.io/lws, api/leaderworkerset/v1): its API, and the labels its
# controller puts on every pod of a group (the leader's worker-index is 0).
LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_GROUP_INDEX = "leaderworkerset.sigs.k8s.io/group-index"
LWS_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"


def decode_leader_worker_set(owner: Owner, spec: s.PDInferenceServiceSpec, defaults: Defaults) -> dict[str, Any]:
    """The decode groups as one LeaderWorkerSet: a group of layerShards pods is created,
    scheduled, restarted and rolled as a unit (spec.decode.groupScheduling, docs/gang-scheduling.md).

    One template for leader and workers: a pod's place comes from LWS's labels (`_lws_env`).
    A member that restarts takes its whole group with it (RecreateGroupOnPodRestart): the
    others hold layers of requests the restarted one lost, so serving on without it is not
    possible. Rolling updates replace one group at a time and never add a surplus group (each
    holds a full model's worth of devices)."""
    name = workload_name(owner.name, "decode")
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": "LeaderWorkerSet",
        "metadata": _meta(owner, name, "decode"),
        "spec": {
            "replicas": initial_replicas(spec, "decode"),
            "leaderWorkerTemplate": {
                "size": spec.decode.layer_shards,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "workerTemplate": pod_template(owner, "decode", spec, defaults),
            },
            "startupPolicy": "LeaderCreated",  # members start together: ordered start would serialise model loads
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0},
            },
            "networkConfig": {"subdomainPolicy": "Shared"},
        },
    }


def _lws_env(owner: Owner, spec: s.PDInferenceServiceSpec) -> list[dict[str, Any]]:
    """A LeaderWorkerSet pod's place and its group's members: indices from LWS's labels, peers
    by the DNS names LWS gives its pods under its headless Service (named like the LWS, shared
    subdomain). The kubelet expands `$(PDSERVE_GROUP_INDEX)`, defined just before."""
    lws = workload_name(owner.name, "decode")
    group = f"$({E.GROUP_INDEX})"
    members = [f"{lws}-{group}"] + [f"{lws}-{group}-{m}" for m in range(1, spec.decode.layer_shards)]
    return [
        _field(E.GROUP_INDEX, f"metadata.labels['{LWS_GROUP_INDEX}']"),
        _field(E.SHARD_INDEX, f"metadata.labels['{LWS_WORKER_INDEX}']"),
        _val(E.GROUP_PEERS, ",".join(f"{pod}.{lws}:{E.GRPC_PORT}" for pod in members)),
    ]


def decode_kind(spec: s.PDInferenceServiceSpec) -> tuple[str, str]:
    """(apiVersion, kind) of the decode workload (decode_groups.py says what differs)."""
    if spec.decode.group_scheduling == "leaderWorkerSet":
        return LWS_API_VERSION, "LeaderWorkerSet"
    return "apps/v1", "StatefulSet"


def decode_workload(owner: Owner, spec: s.PDInferenceServiceSpec, defaults: Defaults) -> dict[str, Any]:
    if spec.decode.group_scheduling == "leaderWorkerSet":
        return decode_leader_worker_set(owner, spec, defaults)
    return decode_statefulset(owner, spec, defaults)


def decode_pods(spec: s.PDInferenceServiceSpec) -> int:
    return initial_replicas(spec, "decode") * spec.decode.layer_shards


def headless_service(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(owner, headless_name(owner.name), "decode"),
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
        "metadata": _meta(owner, router_service_name(owner.name), "router"),
        "spec": {"type": svc.type, "selector": selector_labels(owner.name, "router"), "ports": [port]},
    }


def disruption_budget(owner: Owner, role: str) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(owner, workload_name(owner.name, role), role),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(owner.name, role)}},
    }


INFERENCE_POOL_API = "inference.networking.k8s.io/v1"


def epp_service_name(name: str) -> str:
    return f"{name}-epp"


def epp_service(owner: Owner, port: int) -> dict[str, Any]:
    """The routers' endpoint-picker port as a ClusterIP Service: what the pool's endpointPickerRef names."""
    ext_proc = {"name": "grpc-ext-proc", "port": port, "targetPort": port, "protocol": "TCP", "appProtocol": "http2"}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(owner, epp_service_name(owner.name), "router"),
        "spec": {"type": "ClusterIP", "selector": selector_labels(owner.name, "router"), "ports": [ext_proc]},
    }


def inference_pool(owner: Owner, spec: s.PDInferenceServiceSpec) -> dict[str, Any]:
    """The InferencePool of the service's routers, their pickers as its endpoint picker.

    Routers, not decode pods: a decode serves no HTTP, and the pairing state (broker loads,
    prefix history, admission) lives in the routers (docs/gateway.md says why)."""
    assert spec.router.endpoint_picker_port is not None  # RouterSpec's rule
    return {
        "apiVersion": INFERENCE_POOL_API,
        "kind": "InferencePool",
        "metadata": _meta(owner, owner.name, "router"),
        "spec": {
            "selector": {"matchLabels": selector_labels(owner.name, "router")},
            "targetPorts": [{"number": E.HTTP_PORT}],
            "endpointPickerRef": {
                "name": epp_service_name(owner.name),
                "port": {"number": spec.router.endpoint_picker_port},
                "failureMode": spec.router.inference_pool.failure_mode,
            },
        },
    }


def gateway_children(owner: Owner, spec: s.PDInferenceServiceSpec) -> list[dict[str, Any]]:
    if not spec.router.inference_pool.enabled or spec.router.endpoint_picker_port is None:
        return []
    return [epp_service(owner, spec.router.endpoint_picker_port), inference_pool(owner, spec)]


def adapter_name(name: str, role: str) -> str:
    return f"{name}-{role}"


def scaling_adapter(owner: Owner, role: str, replicas: int) -> dict[str, Any]:
    """The role's PDScalingAdapter: a /scale handle on spec.<role>.replicas (scaling_adapters.py)."""
    return {
        "apiVersion": s.API_VERSION,
        "kind": sa.ADAPTER_KIND,
        "metadata": _meta(owner, adapter_name(owner.name, role), role),
        "spec": {"replicas": replicas, "serviceName": owner.name, "role": role},
    }


def network_policy_name(name: str) -> str:
    return f"{name}-workers"


def network_policy(owner: Owner, defaults: Defaults, epp_port: int | None = None) -> dict[str, Any]:
    """Only this service's pods (and the operator) reach its pods' gRPC and transfer ports.

    Prefill pushes KV into decode memory and routers drive both over gRPC; a pod of another
    service, or anything else in the cluster, has no business on those ports. The HTTP port
    stays open: routers serve the API on it, and Prometheus scrapes arrive there; so does a
    router's endpoint-picker port when the spec names one (the gateway dials it from its own
    namespace: docs/gateway.md). No rule names the probe port: Kubernetes always admits the
    kubelet's traffic from the pod's node, and nothing else needs it.
    """
    public = [{"port": E.HTTP_PORT, "protocol": "TCP"}]
    if epp_port is not None:
        public.append({"port": epp_port, "protocol": "TCP"})
    peers = selector_labels(owner.name)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(owner, network_policy_name(owner.name)),
        "spec": {
            "podSelector": {"matchLabels": peers},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [
                        {"podSelector": {"matchLabels": peers}},
                        {
                            "namespaceSelector": {
                                "matchLabels": {"kubernetes.io/metadata.name": defaults.operator_namespace}
                            },
                            "podSelector": {"matchLabels": dict(OPERATOR_POD_LABELS)},
                        },
                    ],
                    "ports": [
                        {"port": E.GRPC_PORT, "protocol": "TCP"},
                        {"port": E.TRANSFER_PORT, "protocol": "TCP"},
                    ],
                },
                {"ports": public},
            ],
        },
    }


def render(owner: Owner, spec: s.PDInferenceServiceSpec, token: str, defaults: Defaults) -> list[dict[str, Any]]:
    """Every child, in apply order (what pods mount exists before the pods)."""
    if not token:
        raise ValueError(f"empty broker token for {owner.key}")
    policy = [network_policy(owner, defaults, spec.router.endpoint_picker_port)] if defaults.network_policy else []
    return [
        *policy,  # before the pods, so no pod of the service ever runs unprotected
        secret(owner, token),
        config_map(owner, spec),
        headless_service(owner),
        router_service(owner, spec),
        deployment(owner, "prefill", spec, defaults),
        decode_workload(owner, spec, defaults),
        deployment(owner, "router", spec, defaults),
        *gateway_children(owner, spec),  # after the routers they select
        *(disruption_budget(owner, role) for role in ROLES),
        *(horizontal_pod_autoscaler(owner, role, spec) for role in hpa_roles(spec)),
    ]
