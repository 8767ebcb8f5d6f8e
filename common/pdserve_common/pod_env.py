"""The contract between the operator and a worker pod: environment variable names and ports.

The operator (`pdserve_operator.children`) renders these variables into every pod; `pdserve
worker` reads them back through `serving/settings.WorkerSettings`, whose field aliases are these
constants, so a renamed variable breaks a test instead of a deployment. A worker serves:
- `HTTP_PORT` (`http`): `GET /healthz` (alive), `GET /readyz` (loaded, registered, not draining);
  the router's OpenAI API too. `PROBE_PORT` (`probe`): the same two only, the kubelet's, which no
  NetworkPolicy admits other pods to (a flood of `http` cannot fail a probe).
- `GRPC_PORT` (`grpc`): the worker service of proto/pdserve/v1/worker.proto.
- Decode only: `TRANSFER_PORT` (`transfer`), the engine id `POD_IP:TRANSFER_PORT` it registers;
  and `GET /drain` on `ADMIN_PORT` (127.0.0.1, the service token), the preStop hook's `pdserve
  drain`: no new reservations, wait for reserved slots or the drain timeout, deregister, answer
  200, then `/healthz` 503. Layer-sharded decode: pod ordinal o of `shards` serves group
  `o // shards`, member `o % shards` (`pdserve_common.kv_layout.shard_layers(...)[member]`).
"""

from __future__ import annotations

import re

HTTP_PORT = 8080
GRPC_PORT = 50051
TRANSFER_PORT = 50052
ADMIN_PORT = 8081  # loopback only: /drain, for the pod's own preStop hook
PROBE_PORT = 8082  # the kubelet's probes only

ROLE = "PDSERVE_ROLE"
SERVICE = "PDSERVE_SERVICE"  # "namespace/name" of the PDInferenceService: the broker's service key
NAMESPACE = "PDSERVE_NAMESPACE"
POD_NAME = "PDSERVE_POD_NAME"
POD_IP = "PDSERVE_POD_IP"
BROKER_ADDRESS = "PDSERVE_BROKER_ADDRESS"  # host:port of the operator's gRPC broker
# This pod's role token (auth.role_token) from the service's Secret: every gRPC call it makes
# carries it. Only the operator holds the service token itself.
BROKER_TOKEN = "PDSERVE_BROKER_TOKEN"
# This member's own credential (issue #58 A4), sent with each broker registration: the broker
# admits a registration only for the member id the credential is bound to. Either the value
# (credentials.member_credential, `pdserve local`) or a file read at each registration (a pod:
# its projected ServiceAccount token, which the broker checks by TokenReview; the kubelet rotates it).
MEMBER_CREDENTIAL = "PDSERVE_MEMBER_CREDENTIAL"
MEMBER_CREDENTIAL_FILE = "PDSERVE_MEMBER_CREDENTIAL_FILE"
BROKER_AUDIENCE = "pdserve-broker"  # the projected token's audience: the API server refuses it
IDENTITY_DIR = "/var/run/pdserve/identity"  # where the pod's projected token is mounted (file `token`)
# What the pod's own gRPC server admits: role:sha256-hex of each role token that may call it
# (auth.token_digest; digests, not secrets), comma-separated.
ACCEPT_TOKEN_DIGESTS = "PDSERVE_ACCEPT_TOKEN_DIGESTS"
# The KV plane's keys (transfer/service_link.ServiceKeys), hex, from the Secret: prefill and decode.
KV_LINK_KEY = "PDSERVE_KV_LINK_KEY"
KV_CAPABILITY_KEY = "PDSERVE_KV_CAPABILITY_KEY"
HTTP_PORT_ENV = "PDSERVE_HTTP_PORT"
ADMIN_PORT_ENV = "PDSERVE_ADMIN_PORT"
PROBE_PORT_ENV = "PDSERVE_PROBE_PORT"  # 0: no probe listener (the probes are on the http port)
# A router's endpoint-picker port (Envoy ext_proc, gateway/ext_proc.py); 0: none (the default).
EPP_PORT_ENV = "PDSERVE_EPP_PORT"
# Whom that picker admits: role:digest pairs like ACCEPT_TOKEN_DIGESTS (the gateway's token's, #58 A3).
EPP_ACCEPT_TOKEN_DIGESTS = "PDSERVE_EPP_ACCEPT_TOKEN_DIGESTS"
GRPC_PORT_ENV = "PDSERVE_GRPC_PORT"
CONFIG_FILE = "PDSERVE_CONFIG_FILE"  # the rendered spec as JSON (ConfigMap), for humans and tools

MODEL_NAME = "PDSERVE_MODEL_NAME"
MODEL_SOURCE = "PDSERVE_MODEL_SOURCE"  # builtin:NAME, or a path inside the pod
MODEL_DTYPE = "PDSERVE_MODEL_DTYPE"
MAX_LENGTH = "PDSERVE_MAX_LENGTH"
DEVICE = "PDSERVE_DEVICE"  # npu | cuda | cpu
DEVICE_COUNT = "PDSERVE_DEVICE_COUNT"

TRANSFER_BACKEND = "PDSERVE_TRANSFER_BACKEND"  # hixl | cpu | auto (| two-sided: seed 002's baseline, loopback only)
QUEUE_DEPTH = "PDSERVE_QUEUE_DEPTH"
CONNECT_TIMEOUT_MS = "PDSERVE_CONNECT_TIMEOUT_MS"
TRANSFER_TIMEOUT_MS = "PDSERVE_TRANSFER_TIMEOUT_MS"
ENGINE_OPTIONS = "PDSERVE_ENGINE_OPTIONS"  # JSON object of strings, passed to the engine's initialize
# both: "true" (default) | "false": a digest on every pushed KV chunk, checked by the decode
KV_DIGEST = "PDSERVE_KV_DIGEST"

# prefill, decode: the model engine, a name of engines/registry.py (native, vllm) or module:Class
ENGINE = "PDSERVE_ENGINE"
LAYERS_PER_CHUNK = "PDSERVE_LAYERS_PER_CHUNK"  # prefill
SLOTS = "PDSERVE_SLOTS"  # decode
KV_BLOCK_TOKENS = "PDSERVE_KV_BLOCK_TOKENS"  # decode: tokens per KV block (0: max-length slots)
KV_TOKENS = "PDSERVE_KV_TOKENS"  # decode: KV pool size in tokens (0: slots x max length)
PREFIX_CACHE_TOKENS = "PDSERVE_PREFIX_CACHE_TOKENS"  # prefill: prefix cache in tokens (unset/auto: from memory; 0: off)
PREFIX_DISK_DIR = "PDSERVE_PREFIX_DISK_DIR"  # prefill: folder of the prefix cache's disk tier (unset: no disk tier)
PREFIX_DISK_BYTES = "PDSERVE_PREFIX_DISK_BYTES"  # prefill: the disk tier's bound in bytes (0: 10 GiB)
READINESS_MODE = "PDSERVE_READINESS_MODE"  # decode: interrupt | poll | spin
POLL_INTERVAL_MICROS = "PDSERVE_POLL_INTERVAL_MICROS"  # decode, only with poll
WARMUP = "PDSERVE_WARMUP"  # decode: "true" | "false"
LAYER_SHARDS = "PDSERVE_LAYER_SHARDS"  # decode: pods per group
# prefill: tensor-parallel ranks of the instance (one process each, all in the pod; rank 0 starts the others)
TENSOR_PARALLEL = "PDSERVE_TENSOR_PARALLEL"
DECODE_SERVICE = "PDSERVE_DECODE_SERVICE"  # decode: the headless Service giving pods stable DNS
DRAIN_TIMEOUT_SECONDS = "PDSERVE_DRAIN_TIMEOUT_SECONDS"  # decode: how long /drain may wait
# Decode group place, given explicitly (`pdserve local`; LeaderWorkerSet pods, from LWS's labels
# through the downward API); StatefulSet pods derive them from their ordinal instead.
GROUP_INDEX = "PDSERVE_GROUP_INDEX"  # decode: which group (default 0 when SHARD_INDEX is given)
SHARD_INDEX = "PDSERVE_SHARD_INDEX"  # decode: member index in its group
GROUP_PEERS = "PDSERVE_GROUP_PEERS"  # decode: gRPC endpoints of members 0..N-1, comma-separated

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
DISAGGREGATION = "PDSERVE_DISAGGREGATION"  # router: always | never | auto (router/disaggregation.py)
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
