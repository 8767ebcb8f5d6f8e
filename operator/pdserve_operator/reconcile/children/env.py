"""The worker container's environment: what every pod reads, what its role reads, then the user's."""

from __future__ import annotations

import json
from typing import Any

from pdserve_common import credentials as C
from pdserve_common import pod_env as E
from pdserve_operator import spec as s
from pdserve_operator.reconcile.children.config_map import CONFIG_DIR, CONFIG_KEY
from pdserve_operator.reconcile.children.meta import (
    LWS_GROUP_INDEX,
    LWS_NAME,
    LWS_WORKER_INDEX,
    Defaults,
    Owner,
    decode_in_lws_groups,
    headless_name,
    secret_name,
    tls_server_name,
    workload_name,
)

MODELS_DIR = "/models"
LWS_NAME_ENV = "PDSERVE_LWS_NAME"  # only for $(VAR) expansion in the group's peers; the worker ignores it


PREFIX_DISK_DIR = "/var/cache/pdserve/prefix"  # the prefill's emptyDir for the prefix cache's disk tier


def _val(name: str, value: object) -> dict[str, Any]:
    text = value if isinstance(value, str) else json.dumps(value)
    return {"name": name, "value": text}


def _field(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}}


def container_env(owner: Owner, role: str, spec: s.PDInferenceServiceSpec, defaults: Defaults) -> list[dict[str, Any]]:
    """The worker's environment: what every pod reads, what its role reads, then the user's
    own variables (never one of ours: they are the contract with the worker)."""
    env = [_val(E.ROLE, role), *_credentials_env(owner, role), *_common_env(owner, spec, defaults)]
    if role in ("prefill", "decode"):  # the model engine (engines/registry.py); the router loads none
        env.append(_val(E.ENGINE, spec.engine))
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
        _val(E.MEMBER_CREDENTIAL_FILE, f"{E.IDENTITY_DIR}/token"),  # (pod.py mounts it)
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
        _val(E.DISAGGREGATION, spec.router.disaggregation),  # (router/disaggregation.py)
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
        *(_lws_env(owner, spec) if decode_in_lws_groups(spec) else []),
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


def pvc_claim(source: str) -> str | None:
    if not source.startswith("pvc://"):
        return None
    return source.removeprefix("pvc://").partition("/")[0]


def _lws_env(owner: Owner, spec: s.PDInferenceServiceSpec) -> list[dict[str, Any]]:
    """A LeaderWorkerSet pod's place and its group's members: indices from LWS's labels, peers
    by the DNS names LWS gives its pods under its headless Service (named like the LWS, shared
    subdomain). The kubelet expands `$(PDSERVE_GROUP_INDEX)`, defined just before."""
    lws = workload_name(owner.name, "decode")
    named = []
    if spec.workload == "DisaggregatedSet":  # its LWS names carry slice and revision: read the pod's label
        named, lws = [_field(LWS_NAME_ENV, f"metadata.labels['{LWS_NAME}']")], f"$({LWS_NAME_ENV})"
    group = f"$({E.GROUP_INDEX})"
    members = [f"{lws}-{group}"] + [f"{lws}-{group}-{m}" for m in range(1, spec.decode.layer_shards)]
    return [
        *named,
        _field(E.GROUP_INDEX, f"metadata.labels['{LWS_GROUP_INDEX}']"),
        _field(E.SHARD_INDEX, f"metadata.labels['{LWS_WORKER_INDEX}']"),
        _val(E.GROUP_PEERS, ",".join(f"{pod}.{lws}:{E.GRPC_PORT}" for pod in members)),
    ]
