"""A worker's settings: environment first (what the operator renders into a pod), flags on top.

The environment names are `pod_env.py`'s, so the operator and the worker cannot drift apart;
`pdserve worker` passes the flags a user gave as keyword arguments, which pydantic-settings
ranks above the environment. A few knobs that pods never need to change (bind address, the
transfer engine's port, torch threads, timeouts of the request road) have names of their own,
declared here, with defaults that suit a pod.

The one parser of these variables: pydantic-settings gives validation, flag/env precedence
and JSON parsing of `PDSERVE_ENGINE_OPTIONS` without hand-written code.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from pdserve_common import pod_env as E
from pdserve_common.auth import GATEWAY_ROLE, SERVICE_ROLE, TLSConfig, TokenTable, role_of_token, token_digest
from pdserve_common.credentials import gateway_token
from pdserve_common.service_keys import PURPOSE_PREFIX_DISK, ServiceKeys, hkdf
from pdserve_worker.api.http_guard import HttpLimits
from pdserve_worker.model.loading.default_model import BUILTIN_SOURCE
from pdserve_worker.transfer.registry import NAMES

# Worker-only knobs (the operator leaves them at their defaults).
BIND_HOST = "PDSERVE_BIND_HOST"  # address the HTTP and gRPC servers listen on
TRANSFER_PORT_ENV = "PDSERVE_TRANSFER_PORT"  # the transfer engine's port (engine id = POD_IP:port)
TRANSFER_PORT = 50052
THREADS = "PDSERVE_THREADS"  # torch CPU threads; 0 = the CPUs this process may use
READINESS_TIMEOUT_MS = "PDSERVE_READINESS_TIMEOUT_MS"  # decode: how long Generate waits for the KV
# decode: what a drain does with requests in flight: migrate (push their KV to another decode),
# resume (end their streams at once: the router re-prefills them elsewhere), wait (let them finish)
DRAIN_MODE = "PDSERVE_DRAIN_MODE"
MIGRATE_WAIT_S = "PDSERVE_MIGRATE_WAIT_SECONDS"  # decode: how long a handed-over request waits for its Migrate
LEASE_MS = "PDSERVE_LEASE_MS"  # router: lease of a reserved slot until Generate claims it
REQUEST_TIMEOUT_S = "PDSERVE_REQUEST_TIMEOUT_SECONDS"  # router: deadline of one Prefill call
# router: how long a request whose worker went away waits for one to come back (a restart)
RETURN_WAIT_S = "PDSERVE_RETURN_WAIT_SECONDS"
GRACE_S = "PDSERVE_GRACE_SECONDS"  # router/prefill: how long requests in flight may finish on SIGTERM
SHARD_INDEX = E.SHARD_INDEX
GROUP_PEERS = E.GROUP_PEERS
MAX_BODY_BYTES = "PDSERVE_MAX_BODY_BYTES"  # router: larger request bodies are answered 413
PREFIX_BLOCK_TOKENS = "PDSERVE_PREFIX_BLOCK_TOKENS"  # prefill: tokens per prefix-cache block
PREFILL_BATCH = "PDSERVE_PREFILL_BATCH"  # prefill: prompts one forward pass may pack (each a scratch KV slot)
PREFILL_TOKEN_BUDGET = "PDSERVE_PREFILL_TOKEN_BUDGET"  # prefill: tokens one pass packs (the first prompt always goes)
# prefill: prompts of at most this many tokens run between a longer pass's layer chunks (0: off)
PREFILL_OVERTAKE_TOKENS = "PDSERVE_PREFILL_OVERTAKE_TOKENS"
# colocated: prompt positions computed between two decode steps (chunked prefill, decode/generation_loop.py)
PREFILL_CHUNK_TOKENS = "PDSERVE_PREFILL_CHUNK_TOKENS"
LOCAL_PREFILL = "PDSERVE_LOCAL_PREFILL"  # decode: prefill locally when the router asks (true/false)
DECODE_PREFIX_CACHE = "PDSERVE_DECODE_PREFIX_CACHE"  # decode: keep ended requests' blocks for later prompts
DECODE_PREFIX_ANSWERS = "PDSERVE_DECODE_PREFIX_ANSWERS"  # decode: keep the answer's blocks too
PREFIX_ROUTING = "PDSERVE_PREFIX_ROUTING"  # router: events (the prefills' reports) or predict
MEMORY_SHARE = "PDSERVE_MEMORY_SHARE"  # share of the memory limit a cache may be sized from (kv/memory_budget.py)
ENGINE = E.ENGINE  # the model engine (pod_env.py: the operator renders it)
WEIGHTS = "PDSERVE_WEIGHTS"  # how matrices are held: auto, dequantized, int8, int4 (model/layers/weight_routes.py)
# Every HTTP port (router API, pod probes, admin): a request must arrive whole within this
# many seconds, and connections past the cap are closed at once (api/http_guard.py).
HTTP_REQUEST_DEADLINE_S = "PDSERVE_HTTP_REQUEST_DEADLINE_SECONDS"
HTTP_MAX_CONNECTIONS = "PDSERVE_HTTP_MAX_CONNECTIONS"
HTTP_MAX_CONNECTIONS_PER_PEER = "PDSERVE_HTTP_MAX_CONNECTIONS_PER_PEER"
WORKER_HTTP_PER_PEER = 64  # a prefill's or decode's pod port: probes and metrics
# A tensor-parallel instance's other ranks (ranks/prefill.py): rank 0 starts them with these.
TP_RANK = "PDSERVE_TP_RANK"  # this process's rank (0: the instance's face, the others follow it)
TP_ADDRESS = "PDSERVE_TP_ADDRESS"  # the group's rendezvous (file:///path or host:port)
TP_TIMEOUT_S = "PDSERVE_TP_TIMEOUT_SECONDS"  # a collective not done in this long means a rank died or hangs

Role = Literal["prefill", "decode", "router", "colocated"]
BUILTIN_PREFIX = "builtin:"
BUILTIN_DEFAULT = BUILTIN_SOURCE


class WorkerSettings(BaseSettings):
    """Everything `pdserve worker` needs; see pod_env.py for what each variable means."""

    model_config = SettingsConfigDict(frozen=True, extra="ignore", populate_by_name=True, case_sensitive=True)

    role: Role = Field(validation_alias=E.ROLE)
    service: str = Field("default/pdserve", validation_alias=E.SERVICE, pattern=r"^[a-z0-9-]+/[a-z0-9-]+$")
    broker_address: str = Field("", validation_alias=E.BROKER_ADDRESS)
    broker_token: SecretStr = Field(SecretStr(""), validation_alias=E.BROKER_TOKEN)
    # With a role token (a pod): who may call this worker's gRPC server, and the KV plane's keys
    # (pod_env.py). With the service token itself (in-process stacks) both are derived from it.
    accept_token_digests: str = Field("", validation_alias=E.ACCEPT_TOKEN_DIGESTS)
    kv_link_key: SecretStr = Field(SecretStr(""), validation_alias=E.KV_LINK_KEY)
    kv_capability_key: SecretStr = Field(SecretStr(""), validation_alias=E.KV_CAPABILITY_KEY)
    worker_id: str = Field("", validation_alias=E.POD_NAME)
    member_credential: SecretStr = Field(SecretStr(""), validation_alias=E.MEMBER_CREDENTIAL)
    member_credential_file: str = Field("", validation_alias=E.MEMBER_CREDENTIAL_FILE)
    advertise_host: str = Field("127.0.0.1", validation_alias=E.POD_IP)
    bind_host: str = Field("0.0.0.0", validation_alias=BIND_HOST)
    http_port: int = Field(E.HTTP_PORT, ge=0, le=65535, validation_alias=E.HTTP_PORT_ENV)
    grpc_port: int = Field(E.GRPC_PORT, ge=0, le=65535, validation_alias=E.GRPC_PORT_ENV)
    transfer_port: int = Field(TRANSFER_PORT, ge=1, le=65535, validation_alias=TRANSFER_PORT_ENV)

    model_name: str = Field("", validation_alias=E.MODEL_NAME)
    model_source: str = Field(BUILTIN_DEFAULT, validation_alias=E.MODEL_SOURCE)
    model_dtype: Literal["bfloat16", "float16", "float32"] = Field("bfloat16", validation_alias=E.MODEL_DTYPE)
    max_length: int = Field(2048, ge=16, validation_alias=E.MAX_LENGTH)
    device: Literal["npu", "cuda", "cpu"] = Field("cpu", validation_alias=E.DEVICE)
    threads: int = Field(0, ge=0, validation_alias=THREADS)
    weights: Literal["auto", "dequantized", "int8", "int4"] = Field("auto", validation_alias=WEIGHTS)
    engine: str = Field("native", min_length=1, validation_alias=ENGINE)

    transfer_backend: str = Field("auto", validation_alias=E.TRANSFER_BACKEND)  # transfer.registry.NAMES
    queue_depth: int = Field(8, ge=1, validation_alias=E.QUEUE_DEPTH)
    connect_timeout_ms: int = Field(5000, ge=1, validation_alias=E.CONNECT_TIMEOUT_MS)
    transfer_timeout_ms: int = Field(30000, ge=1, validation_alias=E.TRANSFER_TIMEOUT_MS)
    engine_options: dict[str, str] = Field(default_factory=dict, validation_alias=E.ENGINE_OPTIONS)
    # A digest on every pushed KV chunk, checked before the decode uses it (transfer/digest.py):
    # both roles of a service must agree (a decode with it on refuses a ready without one).
    kv_digest: bool = Field(True, validation_alias=E.KV_DIGEST)

    layers_per_chunk: int = Field(4, ge=1, validation_alias=E.LAYERS_PER_CHUNK)
    prefill_batch: int = Field(8, ge=1, le=256, validation_alias=PREFILL_BATCH)
    prefill_token_budget: int = Field(4096, ge=1, validation_alias=PREFILL_TOKEN_BUDGET)
    prefill_overtake_tokens: int = Field(256, ge=0, validation_alias=PREFILL_OVERTAKE_TOKENS)
    slots: int = Field(8, ge=1, validation_alias=E.SLOTS)
    # Decode KV in blocks of this many tokens (0: one max-length slot per request; a layer-
    # sharded group keeps slots). The pool holds kv_tokens (0: slots x max_length, capped by
    # half the decode's memory share: kv/memory_budget.py); `slots` caps concurrent requests.
    kv_block_tokens: int = Field(16, ge=0, le=4096, validation_alias=E.KV_BLOCK_TOKENS)
    kv_tokens: int = Field(0, ge=0, validation_alias=E.KV_TOKENS)
    # Prefill: tokens of prompt-prefix KV kept for reuse, in blocks of prefix_block_tokens.
    # None (unset, or "auto"): a share of this process's memory (kv/memory_budget.py); 0: off.
    prefix_cache_tokens: int | None = Field(None, ge=0, validation_alias=E.PREFIX_CACHE_TOKENS)
    # The part of the memory limit (the pod's cgroup, else the machine) this process counts as
    # its own when it sizes a cache: 1 in a pod; `pdserve local` gives each model process its share.
    memory_share: float = Field(1.0, gt=0, le=1, validation_alias=MEMORY_SHARE)
    # Prefill: the prefix cache's disk tier (kv/disk_tier.py): a folder (None: no disk tier) and
    # its bound in bytes (0: the smaller of 10 GiB and half the folder's free space).
    prefix_disk_dir: Path | None = Field(None, validation_alias=E.PREFIX_DISK_DIR)
    prefix_disk_bytes: int = Field(0, ge=0, validation_alias=E.PREFIX_DISK_BYTES)
    # Router: choose a prefill by what the prefills report they hold (router/kv_index.py), or by
    # this router's own prediction from its routing history alone.
    prefix_routing: Literal["events", "predict"] = Field("events", validation_alias=PREFIX_ROUTING)
    prefix_block_tokens: int = Field(16, ge=1, le=4096, validation_alias=PREFIX_BLOCK_TOKENS)
    prefill_chunk_tokens: int = Field(512, ge=1, le=1_048_576, validation_alias=PREFILL_CHUNK_TOKENS)
    # Decode: compute a prompt's KV itself when the router asks (decode/local_prefill.py); a
    # layer-sharded or tensor-parallel decode never does. Router: when to ask for it
    # (router/disaggregation.py: always | never | auto).
    local_prefill: bool = Field(True, validation_alias=LOCAL_PREFILL)
    # Decode: keep the blocks of ended requests for the next turn of a conversation
    # (kv/decode_prefix.py; a paged pool of a plain decode: not a layer-sharded or TP group).
    decode_prefix_cache: bool = Field(True, validation_alias=DECODE_PREFIX_CACHE)
    # ... and the blocks of the tokens it generated, whose KV the decode's steps computed (not a
    # prompt pass: in bf16 the next turn's greedy text may then differ from a recomputation's).
    decode_prefix_answers: bool = Field(False, validation_alias=DECODE_PREFIX_ANSWERS)
    disaggregation: Literal["always", "never", "auto"] = Field("auto", validation_alias=E.DISAGGREGATION)
    readiness_mode: Literal["interrupt", "poll", "spin"] = Field("interrupt", validation_alias=E.READINESS_MODE)
    poll_interval_micros: int = Field(100, ge=1, validation_alias=E.POLL_INTERVAL_MICROS)
    warmup: bool = Field(True, validation_alias=E.WARMUP)
    layer_shards: int = Field(1, ge=1, validation_alias=E.LAYER_SHARDS)
    tensor_parallel: int = Field(1, ge=1, le=64, validation_alias=E.TENSOR_PARALLEL)
    tp_rank: int = Field(0, ge=0, validation_alias=TP_RANK)
    tp_address: str = Field("", validation_alias=TP_ADDRESS)
    tp_timeout_seconds: float = Field(60.0, gt=0, validation_alias=TP_TIMEOUT_S)
    drain_timeout_seconds: float = Field(60.0, ge=0, validation_alias=E.DRAIN_TIMEOUT_SECONDS)
    drain_mode: Literal["migrate", "resume", "wait"] = Field("migrate", validation_alias=DRAIN_MODE)
    migrate_wait_seconds: float = Field(10.0, gt=0, validation_alias=MIGRATE_WAIT_S)
    decode_service: str = Field("", validation_alias=E.DECODE_SERVICE)
    shard_index: int | None = Field(None, ge=0, validation_alias=SHARD_INDEX)
    group_index: int | None = Field(None, ge=0, validation_alias=E.GROUP_INDEX)
    group_peers: str = Field("", validation_alias=GROUP_PEERS)

    readiness_timeout_ms: int = Field(300_000, ge=1, validation_alias=READINESS_TIMEOUT_MS)
    lease_ms: int = Field(30_000, ge=1, validation_alias=LEASE_MS)
    request_timeout_seconds: float = Field(600.0, gt=0, validation_alias=REQUEST_TIMEOUT_S)
    return_wait_seconds: float = Field(60.0, ge=0, le=3600, validation_alias=RETURN_WAIT_S)
    grace_seconds: float = Field(30.0, ge=0, validation_alias=GRACE_S)
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024, validation_alias=MAX_BODY_BYTES)
    http_request_deadline_seconds: float = Field(30.0, gt=0, validation_alias=HTTP_REQUEST_DEADLINE_S)
    http_max_connections: int = Field(4096, ge=1, validation_alias=HTTP_MAX_CONNECTIONS)
    # One source address's share of that (0: by role, a sixteenth of the cap on a router's public port,
    # 64 on a worker's pod port, whose clients are the kubelet and Prometheus).
    http_max_connections_per_peer: int = Field(0, ge=0, validation_alias=HTTP_MAX_CONNECTIONS_PER_PEER)
    admin_port: int = Field(E.ADMIN_PORT, ge=0, le=65535, validation_alias=E.ADMIN_PORT_ENV)
    probe_port: int = Field(0, ge=0, le=65535, validation_alias=E.PROBE_PORT_ENV)
    epp_port: int = Field(0, ge=0, le=65535, validation_alias=E.EPP_PORT_ENV)
    epp_accept_token_digests: str = Field("", validation_alias=E.EPP_ACCEPT_TOKEN_DIGESTS)
    api_keys_file: Path | None = Field(None, validation_alias=E.API_KEYS_FILE)
    admission_queue: int = Field(1024, ge=0, le=1_000_000, validation_alias=E.ADMISSION_QUEUE)  # 0: no queue
    admission_per_tenant: int = Field(256, ge=1, le=1_000_000, validation_alias=E.ADMISSION_PER_TENANT)
    admission_deadline_seconds: float = Field(60.0, gt=0, le=86_400, validation_alias=E.ADMISSION_DEADLINE_SECONDS)
    router_replicas: int = Field(1, ge=1, le=1024, validation_alias=E.ROUTER_REPLICAS)

    tls_cert: Path | None = Field(None, validation_alias=E.TLS_CERT)
    tls_key: Path | None = Field(None, validation_alias=E.TLS_KEY)
    tls_ca: Path | None = Field(None, validation_alias=E.TLS_CA)
    tls_server_name: str = Field("", validation_alias=E.TLS_SERVER_NAME)
    broker_tls: bool | None = Field(None, validation_alias=E.BROKER_TLS)  # None: as the worker's own TLS

    @field_validator("transfer_backend")
    @classmethod
    def _known_backend(cls, value: str) -> str:
        if value not in NAMES:
            raise ValueError(f"must be one of {', '.join(NAMES)}, got {value!r}")
        return value

    @field_validator("prefix_cache_tokens", mode="before")
    @classmethod
    def _auto_is_none(cls, value: object) -> object:
        return None if isinstance(value, str) and value.strip().lower() in ("", "auto") else value

    @model_validator(mode="after")
    def _consistent(self) -> WorkerSettings:
        if self.role != "colocated":
            if not self.broker_address:
                raise ValueError(f"a {self.role} worker needs the broker's address ({E.BROKER_ADDRESS} or --broker)")
            if not self.broker_token.get_secret_value():
                raise ValueError(f"a {self.role} worker needs the service's broker token ({E.BROKER_TOKEN})")
        if self.layer_shards != 1:
            if self.role != "decode":
                raise ValueError(f"{E.LAYER_SHARDS}={self.layer_shards}: only decode workers are layer-sharded")
            group, member = self.group_member
            if len(self.peers) != self.layer_shards:
                raise ValueError(
                    f"{GROUP_PEERS}: a group of {self.layer_shards} needs {self.layer_shards} member endpoints, "
                    f"got {len(self.peers)} ({self.group_peers!r}); pods derive them from {E.DECODE_SERVICE}"
                )
        if self.tensor_parallel != 1 and self.role not in ("prefill", "decode"):
            raise ValueError(f"{E.TENSOR_PARALLEL}={self.tensor_parallel}: a {self.role} is not a model instance")
        if self.tensor_parallel != 1 and self.layer_shards != 1:
            raise ValueError(
                f"{E.TENSOR_PARALLEL}={self.tensor_parallel} with a layer-sharded decode group of {self.layer_shards}: "
                "a decode is tensor-parallel or layer-sharded, not both"
            )
        if self.tensor_parallel != 1 and self.role == "decode" and not self.kv_block_tokens:
            raise ValueError(
                f"{E.TENSOR_PARALLEL}={self.tensor_parallel}: a tensor-parallel decode needs a paged KV pool "
                "(kv_block_tokens > 0)"
            )
        if self.tp_rank >= self.tensor_parallel:
            raise ValueError(f"{TP_RANK}={self.tp_rank} outside a tensor-parallel group of {self.tensor_parallel}")
        tls_files = {E.TLS_CERT: self.tls_cert, E.TLS_KEY: self.tls_key, E.TLS_CA: self.tls_ca}
        if any(tls_files.values()) and not all(tls_files.values()):
            missing = ", ".join(name for name, value in tls_files.items() if not value)
            raise ValueError(f"TLS needs a certificate, its key and the CA; missing {missing}")
        if self.broker_tls and self.tls is None:
            raise ValueError(
                f"{E.BROKER_TLS}=true: the broker speaks TLS, but no certificate is configured "
                f"({E.TLS_CERT}/{E.TLS_KEY}/{E.TLS_CA}, spec.tls)"
            )
        if self.weights in ("int8", "int4") and self.device != "cpu":
            raise ValueError(
                f"{WEIGHTS}={self.weights} runs on the CPU only (torch's weight-only kernels), "
                f"not on {self.device}; use auto or dequantized"
            )
        if self.model_source.startswith(BUILTIN_PREFIX) and self.model_source != BUILTIN_DEFAULT:
            raise ValueError(
                f"{E.MODEL_SOURCE}: unknown built-in model {self.model_source!r}; known: {BUILTIN_DEFAULT}"
            )
        return self

    # ---- derived -----------------------------------------------------------------------------

    @property
    def http_limits(self) -> HttpLimits:
        per_peer = self.http_max_connections_per_peer or (
            None if self.role in ("router", "colocated") else WORKER_HTTP_PER_PEER
        )
        return HttpLimits(self.http_request_deadline_seconds, self.http_max_connections, per_peer)

    @property
    def token(self) -> str:
        return self.broker_token.get_secret_value()

    def token_table(self) -> TokenTable:
        """Who this worker's gRPC server admits: the role tokens whose digests it was given, or,
        holding the service token itself, every token derived from it."""
        table = TokenTable()
        if self.accept_token_digests:
            table.accept(self.service, _digest_pairs(E.ACCEPT_TOKEN_DIGESTS, self.accept_token_digests))
        elif role_of_token(self.token) is None:
            table.set(self.service, self.token)
        else:
            raise ValueError(f"a worker with a role token needs {E.ACCEPT_TOKEN_DIGESTS} (who may call it)")
        return table

    def kv_keys(self) -> ServiceKeys:
        """The KV plane's keys: given (a pod with a role token), else derived from the service token."""
        link, capability = self.kv_link_key.get_secret_value(), self.kv_capability_key.get_secret_value()
        if link:
            return ServiceKeys.from_hex(link, capability)
        if role_of_token(self.token) is not None:
            raise ValueError(f"a {self.role} worker with a role token needs {E.KV_LINK_KEY}")
        return ServiceKeys.from_token(self.token)

    def prefix_disk_key(self) -> bytes:
        """The prefix disk tier's digest key (kv/disk_tier.py), derived from the link key: a
        prefill reads what another of its service wrote on a shared path, no other service can."""
        return hkdf(self.kv_keys().link, PURPOSE_PREFIX_DISK.encode())

    def capability_key(self) -> bytes:
        """The key of reservation capabilities (a decode's; a prefill is not given it)."""
        key = self.kv_keys().capability
        if key is None:
            raise ValueError(f"a {self.role} worker needs {E.KV_CAPABILITY_KEY} (the reservation capabilities' key)")
        return key

    @property
    def tls(self) -> TLSConfig | None:
        """This worker's certificate: its servers speak TLS only and require client certificates
        of the CA (mutual TLS); None when TLS is off."""
        if self.tls_cert is None or self.tls_key is None or self.tls_ca is None:
            return None
        return TLSConfig(self.tls_cert, self.tls_key, self.tls_ca)

    @property
    def peer_tls(self) -> TLSConfig | None:
        """How to dial other workers: they are reached by IP, so their certificate is checked
        under `tls_server_name` (when set; else under the address itself)."""
        tls = self.tls
        return None if tls is None else tls.for_peer(self.tls_server_name or None)

    @property
    def broker_channel_tls(self) -> TLSConfig | None:
        """How to dial the broker: with TLS (checked under its address's host) if it speaks it."""
        tls = self.tls
        speaks = self.broker_tls if self.broker_tls is not None else tls is not None
        return tls.for_peer(None) if speaks and tls is not None else None

    @property
    def member_id(self) -> str:
        """The worker's id in the service: the pod name, else role-host-pid (unique on a host)."""
        return self.worker_id or f"{self.role}-{socket.gethostname()}-{os.getpid()}"

    @property
    def model_path(self) -> str | None:
        """What `loader.load_model` takes: None for the bundled default, else the path."""
        return None if self.model_source.startswith(BUILTIN_PREFIX) else self.model_source

    @property
    def group_member(self) -> tuple[int, int]:
        """(group, member) of a layer-sharded decode: from PDSERVE_GROUP_INDEX / PDSERVE_SHARD_INDEX
        (a LeaderWorkerSet pod, `pdserve local`), else the StatefulSet pod's ordinal."""
        if self.shard_index is not None:
            if self.shard_index >= self.layer_shards:
                raise ValueError(f"{SHARD_INDEX}={self.shard_index} outside a group of {self.layer_shards}")
            return self.group_index or 0, self.shard_index
        if self.group_index is not None:
            raise ValueError(f"{E.GROUP_INDEX}={self.group_index} without {SHARD_INDEX}: say the member too")
        return E.group_member(E.ordinal_of(self.worker_id), self.layer_shards)

    @property
    def peers(self) -> list[str]:
        """gRPC endpoints of this group's members, in member order.

        Given explicitly (`pdserve local`), or for pods: the StatefulSet's stable DNS names of
        the group's ordinals under the headless decode Service."""
        if self.group_peers:
            return [p.strip() for p in self.group_peers.split(",") if p.strip()]
        if self.layer_shards == 1 or not self.decode_service or not self.worker_id:
            return []
        group, _ = self.group_member
        stem = self.worker_id.rsplit("-", 1)[0]
        first = group * self.layer_shards
        return [f"{stem}-{first + i}.{self.decode_service}:{self.grpc_port}" for i in range(self.layer_shards)]

    @property
    def grpc_endpoint(self) -> str:
        return f"{self.advertise_host}:{self.grpc_port}"

    @property
    def engine_id(self) -> str:
        return f"{self.advertise_host}:{self.transfer_port}"

    @property
    def torch_threads(self) -> int:
        return self.threads or len(os.sched_getaffinity(0))


def model_revision(folder: Path, dtype: str) -> str:
    """What peers must agree on to exchange KV: the model's architecture and the KV dtype.

    Hashed from config.json (parsed, so formatting does not matter) and the dtype, which every
    role can compute from the model folder alone: a router holds no weights.
    """
    config = json.loads((Path(folder) / "config.json").read_text())
    blob = json.dumps({"config": config, "dtype": dtype}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def member_credential_source(settings: WorkerSettings) -> Callable[[], str] | None:
    """What proves this member's id to the broker at each registration (pod_env.py): the
    value, or the file's current content (a rotated token); None without either."""
    value, path = settings.member_credential.get_secret_value(), settings.member_credential_file
    if value:
        return lambda: value
    if path:
        return lambda: _read_credential(path)
    return None


def epp_token_table(settings: WorkerSettings) -> TokenTable:
    """Who the router's endpoint picker admits (#58 A3): the gateway's token and the service
    token, by the digests given, or derived from the service token when this process holds it."""
    table = TokenTable()
    if settings.epp_accept_token_digests:
        table.accept(settings.service, _digest_pairs(E.EPP_ACCEPT_TOKEN_DIGESTS, settings.epp_accept_token_digests))
    elif role_of_token(settings.token) is None:
        digests = {
            GATEWAY_ROLE: token_digest(gateway_token(settings.token)),
            SERVICE_ROLE: token_digest(settings.token),
        }
        table.accept(settings.service, digests)
    else:
        raise ValueError(f"a router serving an endpoint picker needs {E.EPP_ACCEPT_TOKEN_DIGESTS} (who may call it)")
    return table


def _digest_pairs(name: str, value: str) -> dict[str, str]:
    try:
        return dict(item.split(":", 1) for item in value.split(","))
    except ValueError:
        raise ValueError(f"{name} is role:digest[,role:digest...]") from None


def _read_credential(path: str) -> str:
    """The credential file's content; '' when it cannot be read (the broker then refuses the
    registration, naming the member, and the worker retries)."""
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""
