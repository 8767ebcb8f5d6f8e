"""The contract between the operator and a worker pod: environment variable names and ports.

The operator (`pdserve_operator.children`) renders these variables into every pod it creates;
`pdserve worker` reads them back through `settings.WorkerSettings`, whose fields name these
constants as their aliases. Keeping both ends on one module means a renamed variable breaks a
test instead of a deployment.

Pod-facing endpoints a worker must serve (the operator points probes and hooks at them):

- HTTP on `HTTP_PORT` (named `http`): `GET /healthz` (liveness: the process is alive),
  `GET /readyz` (readiness: model loaded, registered with the broker, not draining).
  The router also serves the OpenAI API on this port.
- gRPC on `GRPC_PORT` (named `grpc`): the worker service of `proto/pdserve/v1/worker.proto`.
- Decode only, the transfer engine's listener on `TRANSFER_PORT` (named `transfer`): the
  engine id a decode pod registers with the broker is `POD_IP:TRANSFER_PORT` (HIXL's control
  channel; the host engine's TCP path). Prefill engines are clients and listen on nothing.
- Decode only, `GET /drain` on the admin port `ADMIN_PORT`, which listens on 127.0.0.1 only
  and needs the service's token (`Authorization: Bearer`): the pod's preStop hook runs
  `pdserve drain`, which calls it from inside the pod. It stops new slot reservations at once
  (so `/readyz` fails), waits until every reserved slot has finished or
  `PDSERVE_DRAIN_TIMEOUT_SECONDS` passed, deregisters from the broker and answers 200; from
  then on `/healthz` answers 503, so a worker drained by anything but its own stop is
  restarted by its liveness probe. Idempotent; a second call waits too.

Decode layer sharding: a StatefulSet with `layerShards > 1` runs `groups × shards` pods. A pod
finds its place from its ordinal (the suffix of its name): `group = ordinal // shards`,
`member = ordinal % shards`; member m of a group serves `pdserve_common.kv_layout.shard_layers(...)[m]`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

HTTP_PORT = 8080
GRPC_PORT = 50051
TRANSFER_PORT = 50052
ADMIN_PORT = 8081  # loopback only: /drain, for the pod's own preStop hook

ROLE = "PDSERVE_ROLE"
SERVICE = "PDSERVE_SERVICE"  # "namespace/name" of the PDInferenceService: the broker's service key
NAMESPACE = "PDSERVE_NAMESPACE"
POD_NAME = "PDSERVE_POD_NAME"
POD_IP = "PDSERVE_POD_IP"
BROKER_ADDRESS = "PDSERVE_BROKER_ADDRESS"  # host:port of the operator's gRPC broker
BROKER_TOKEN = "PDSERVE_BROKER_TOKEN"  # from the service's Secret; every broker call carries it
HTTP_PORT_ENV = "PDSERVE_HTTP_PORT"
ADMIN_PORT_ENV = "PDSERVE_ADMIN_PORT"
GRPC_PORT_ENV = "PDSERVE_GRPC_PORT"
CONFIG_FILE = "PDSERVE_CONFIG_FILE"  # the rendered spec as JSON (ConfigMap), for humans and tools

MODEL_NAME = "PDSERVE_MODEL_NAME"
MODEL_SOURCE = "PDSERVE_MODEL_SOURCE"  # builtin:NAME, or a path inside the pod
MODEL_DTYPE = "PDSERVE_MODEL_DTYPE"
MAX_LENGTH = "PDSERVE_MAX_LENGTH"
DEVICE = "PDSERVE_DEVICE"  # npu | cuda | cpu
DEVICE_COUNT = "PDSERVE_DEVICE_COUNT"

TRANSFER_BACKEND = "PDSERVE_TRANSFER_BACKEND"  # hixl | cpu | auto
QUEUE_DEPTH = "PDSERVE_QUEUE_DEPTH"
CONNECT_TIMEOUT_MS = "PDSERVE_CONNECT_TIMEOUT_MS"
TRANSFER_TIMEOUT_MS = "PDSERVE_TRANSFER_TIMEOUT_MS"
ENGINE_OPTIONS = "PDSERVE_ENGINE_OPTIONS"  # JSON object of strings, passed to the engine's initialize

LAYERS_PER_CHUNK = "PDSERVE_LAYERS_PER_CHUNK"  # prefill
SLOTS = "PDSERVE_SLOTS"  # decode
KV_BLOCK_TOKENS = "PDSERVE_KV_BLOCK_TOKENS"  # decode: tokens per KV block (0: max-length slots)
KV_TOKENS = "PDSERVE_KV_TOKENS"  # decode: KV pool size in tokens (0: slots x max length)
PREFIX_CACHE_TOKENS = "PDSERVE_PREFIX_CACHE_TOKENS"  # prefill: prefix cache size in tokens (0: off)
READINESS_MODE = "PDSERVE_READINESS_MODE"  # decode: interrupt | poll | spin
POLL_INTERVAL_MICROS = "PDSERVE_POLL_INTERVAL_MICROS"  # decode, only with poll
WARMUP = "PDSERVE_WARMUP"  # decode: "true" | "false"
LAYER_SHARDS = "PDSERVE_LAYER_SHARDS"  # decode: pods per group
DECODE_SERVICE = "PDSERVE_DECODE_SERVICE"  # decode: the headless Service giving pods stable DNS
DRAIN_TIMEOUT_SECONDS = "PDSERVE_DRAIN_TIMEOUT_SECONDS"  # decode: how long /drain may wait

# TLS (spec.tls): the Secret's files, mounted at TLS_DIR. With them every gRPC server of the pod
# speaks TLS only and requires a client certificate of the same CA; the router serves HTTPS.
TLS_CERT = "PDSERVE_TLS_CERT"  # PEM certificate chain (tls.crt), server and client
TLS_KEY = "PDSERVE_TLS_KEY"  # PEM private key (tls.key)
TLS_CA = "PDSERVE_TLS_CA"  # PEM CA (ca.crt) that peers' certificates must chain to
TLS_SERVER_NAME = "PDSERVE_TLS_SERVER_NAME"  # the name worker certificates carry (peers are dialled by IP)
BROKER_TLS = "PDSERVE_BROKER_TLS"  # "true": the broker speaks TLS (verified with TLS_CA)
TLS_DIR = "/etc/pdserve/tls"
# Tracing (spec.observability.tracing; common/pdserve_common/tracing.py): off when unset.
TRACING_ENDPOINT = "PDSERVE_TRACING_ENDPOINT"  # OTLP/gRPC collector endpoint
TRACING_SAMPLE_RATIO = "PDSERVE_TRACING_SAMPLE_RATIO"  # 0..1, decided at the router
TRACE_FILE = "PDSERVE_TRACE_FILE"  # JSON lines, one span a line (pdserve local --trace-file)
TLS_CERT_KEY, TLS_KEY_KEY, TLS_CA_KEY = "tls.crt", "tls.key", "ca.crt"  # cert-manager's Secret keys

# Router admission (spec.router.auth, spec.router.admission): docs/admission.md.
API_KEYS_FILE = "PDSERVE_API_KEYS_FILE"  # keys file (the Secret's keys.yaml); unset: no authentication
API_KEYS_DIR = "/etc/pdserve/api-keys"
API_KEYS_KEY = "keys.yaml"  # the key of the auth Secret that holds the keys file
ADMISSION_QUEUE = "PDSERVE_ADMISSION_QUEUE"  # requests that may wait for a KV reservation (0: none, 429 at once)
ADMISSION_PER_TENANT = "PDSERVE_ADMISSION_PER_TENANT"  # of which one tenant may hold
ADMISSION_DEADLINE_SECONDS = "PDSERVE_ADMISSION_DEADLINE_SECONDS"  # longest wait for admission
ROUTER_REPLICAS = "PDSERVE_ROUTER_REPLICAS"  # routers sharing each tenant's limits (each enforces 1/N)

_ORDINAL = re.compile(r"-(\d+)$")


def ordinal_of(pod_name: str) -> int:
    """The StatefulSet ordinal at the end of a pod name (`svc-decode-7` → 7)."""
    match = _ORDINAL.search(pod_name)
    if match is None:
        raise ValueError(f"pod name {pod_name!r} has no StatefulSet ordinal suffix")
    return int(match.group(1))


def group_member(ordinal: int, shards: int) -> tuple[int, int]:
    """(group, member) of a decode pod: consecutive ordinals fill one group before the next."""
    if shards < 1:
        raise ValueError(f"layer shards must be >= 1, got {shards}")
    if ordinal < 0:
        raise ValueError(f"ordinal must be >= 0, got {ordinal}")
    return divmod(ordinal, shards)


class PodEnv(BaseModel):
    """What a worker pod was told by the operator, parsed and checked."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    role: Literal["prefill", "decode", "router"]
    service: str = Field(pattern=r"^[a-z0-9-]+/[a-z0-9-]+$")
    broker_address: str
    broker_token: str = Field(min_length=1, repr=False)
    pod_name: str = ""
    pod_ip: str = ""
    http_port: int = HTTP_PORT
    grpc_port: int = GRPC_PORT
    model_name: str = ""
    model_source: str = "builtin:smollm2"
    model_dtype: str = "bfloat16"
    max_length: int = 2048
    device: Literal["npu", "cuda", "cpu"] = "cpu"
    device_count: int = 0
    transfer_backend: Literal["hixl", "cpu", "auto"] = "auto"
    queue_depth: int = 8
    connect_timeout_ms: int = 5000
    transfer_timeout_ms: int = 30000
    engine_options: dict[str, str] = Field(default_factory=dict)
    layers_per_chunk: int | None = None
    slots: int | None = None
    kv_block_tokens: int | None = None
    kv_tokens: int | None = None
    prefix_cache_tokens: int | None = None
    readiness_mode: Literal["interrupt", "poll", "spin"] | None = None
    poll_interval_micros: int | None = None
    warmup: bool | None = None
    layer_shards: int = 1
    decode_service: str = ""
    drain_timeout_seconds: int = 60

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "PodEnv":
        env = os.environ if environ is None else environ
        fields: dict[str, object] = {}
        for name, var in _FIELD_ENV.items():
            if var in env and env[var] != "":
                fields[name] = env[var]
        if "engine_options" in fields:
            fields["engine_options"] = json.loads(str(fields["engine_options"]))
        return cls.model_validate(fields)

    def group_member(self) -> tuple[int, int]:
        """This decode pod's (group, member), from its name's ordinal and the shard count."""
        return group_member(ordinal_of(self.pod_name), self.layer_shards)


_FIELD_ENV: dict[str, str] = {
    "role": ROLE,
    "service": SERVICE,
    "broker_address": BROKER_ADDRESS,
    "broker_token": BROKER_TOKEN,
    "pod_name": POD_NAME,
    "pod_ip": POD_IP,
    "http_port": HTTP_PORT_ENV,
    "grpc_port": GRPC_PORT_ENV,
    "model_name": MODEL_NAME,
    "model_source": MODEL_SOURCE,
    "model_dtype": MODEL_DTYPE,
    "max_length": MAX_LENGTH,
    "device": DEVICE,
    "device_count": DEVICE_COUNT,
    "transfer_backend": TRANSFER_BACKEND,
    "queue_depth": QUEUE_DEPTH,
    "connect_timeout_ms": CONNECT_TIMEOUT_MS,
    "transfer_timeout_ms": TRANSFER_TIMEOUT_MS,
    "engine_options": ENGINE_OPTIONS,
    "layers_per_chunk": LAYERS_PER_CHUNK,
    "slots": SLOTS,
    "kv_block_tokens": KV_BLOCK_TOKENS,
    "kv_tokens": KV_TOKENS,
    "prefix_cache_tokens": PREFIX_CACHE_TOKENS,
    "readiness_mode": READINESS_MODE,
    "poll_interval_micros": POLL_INTERVAL_MICROS,
    "warmup": WARMUP,
    "layer_shards": LAYER_SHARDS,
    "decode_service": DECODE_SERVICE,
    "drain_timeout_seconds": DRAIN_TIMEOUT_SECONDS,
}
