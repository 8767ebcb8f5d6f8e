"""Channel and server construction with the options every pdserve process shares.

Keepalive pings let a watch stream notice a broker host that vanished without closing its
sockets; servers permit them (else GOAWAY "too_many_pings"). A short reconnect backoff finds a
restarted broker within a second or two. Message sizes are set on both ends of every channel.

What a peer without a token can hold on a server (`GrpcLimits`): a connection must finish its
HTTP/2 (and TLS) handshake within `handshake_timeout_ms`; one with no call for `idle_timeout_ms`
is closed; at most `max_connections` are open (a newer one closed at accept), a sixty-fourth per
source address (`listen`: our front caps per address, grpc_front.py). A call without a valid
token is refused from its headers (auth.py), so such a connection stays idle.

With a `TLSConfig` a server listens with TLS only, and a client verifies the server's
certificate against the CA, under `server_name` when the address is a pod IP no certificate names.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from pdserve_common import tracing
from pdserve_common.auth import Policy, ServiceAuthInterceptor, TLSConfig, TokenTable, bearer_interceptors
from pdserve_common.grpc_front import PeerCappedFront, inner_address, per_peer_from_env

KEEPALIVE_MS = 10_000
# Worker services: a Prefill or Generate request holds up to max_len token ids (<= 5 bytes
# each; the spec caps max_len at 1,048,576) plus at most 16 KiB of stop strings.
WORKER_MAX_MESSAGE = 16 * 1024 * 1024
# The broker: registrations and membership lists (a few hundred bytes per member).
BROKER_MAX_MESSAGE = 4 * 1024 * 1024


# The environment's names for GrpcLimits (every process of a deployment reads its own).
HANDSHAKE_TIMEOUT_ENV = "PDSERVE_GRPC_HANDSHAKE_TIMEOUT_MS"
IDLE_TIMEOUT_ENV = "PDSERVE_GRPC_IDLE_TIMEOUT_MS"
MAX_CONNECTIONS_ENV = "PDSERVE_GRPC_MAX_CONNECTIONS"
WORKER_MAX_CONNECTIONS = 1024  # routers, prefills, group members and the operator of one service
BROKER_MAX_CONNECTIONS = 8192  # one channel per pod of every service; ~13 KB each when idle


@dataclass(frozen=True)
class GrpcLimits:
    """Bounds of a gRPC server on connections (see the module docstring)."""

    handshake_timeout_ms: int = 10_000
    idle_timeout_ms: int = 300_000
    max_connections: int = WORKER_MAX_CONNECTIONS

    @classmethod
    def from_env(
        cls, max_connections: int = WORKER_MAX_CONNECTIONS, env: Mapping[str, str] | None = None
    ) -> GrpcLimits:
        env = os.environ if env is None else env

        def positive(name: str, default: int) -> int:
            raw = env.get(name)
            if not raw:
                return default
            try:
                value = int(raw)
            except ValueError:
                raise ValueError(f"{name} must be a positive integer, got {raw!r}") from None
            if value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value}")
            return value

        return cls(
            positive(HANDSHAKE_TIMEOUT_ENV, cls.handshake_timeout_ms),
            positive(IDLE_TIMEOUT_ENV, cls.idle_timeout_ms),
            positive(MAX_CONNECTIONS_ENV, max_connections),
        )

    def options(self) -> list[tuple[str, int]]:
        return [
            ("grpc.server_handshake_timeout_ms", self.handshake_timeout_ms),
            ("grpc.max_connection_idle_ms", self.idle_timeout_ms),
            ("grpc.max_allowed_incoming_connections", self.max_connections),
        ]


def size_options(max_message: int) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", max_message), ("grpc.max_receive_message_length", max_message)]


CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    # Not grpc.min_reconnect_backoff_ms: despite its name, gRPC core reads it as the minimum
    # *connect timeout* (subchannel.cc: min_connect_timeout, default 20 s). At the 100 ms it
    # once had here, every connection whose HTTP/2 handshake took longer (a loaded 2-core
    # machine, a slow link) failed as "connection attempt timed out before receiving SETTINGS
    # frame", and the channel then failed calls fast during its backoff: the soak at twice the
    # fault rate lost 416 of 1,000 requests that way (benchmarks/README.md, soak).
)

SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),
    # gRPC sets SO_REUSEPORT by default, which lets a second server silently share a port
    # that is already taken; a clash must be an error instead.
    ("grpc.so_reuseport", 0),
)


def channel_options(tls: TLSConfig | None, max_message: int) -> list[tuple[str, Any]]:
    options: list[tuple[str, Any]] = [*CHANNEL_OPTIONS, *size_options(max_message)]
    if tls is not None and tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return options


def aio_channel(
    address: str, token: str, tls: TLSConfig | None = None, *, max_message: int = WORKER_MAX_MESSAGE
) -> grpc.aio.Channel:
    """An aio channel to `address` whose every call carries the service's bearer token."""
    options = channel_options(tls, max_message)
    traced = tracing.client_interceptors() if tracing.enabled() else []  # W3C traceparent on every call
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=[*bearer_interceptors(token), *traced])
    return grpc.aio.secure_channel(
        address, tls.channel_credentials(token), options=options, interceptors=traced or None
    )


# Which roles' tokens may call a worker's methods (auth.py): the router routes requests to the
# workers; a decode group's leader drives its members. Every other call between workers goes
# over the KV plane, not gRPC. The broker admits every role (a member registers its own role).
_ROUTER = frozenset({"router"})
_DECODE = frozenset({"decode"})
WORKER_POLICY: Policy = {
    **{
        f"/pdserve.v1.Decode/{m}": _ROUTER
        for m in ("Reserve", "Generate", "Release", "Status", "Migrate", "BlockEvents")
    },
    **{f"/pdserve.v1.Prefill/{m}": _ROUTER for m in ("Prefill", "Cancel", "BlockEvents")},
    **{f"/pdserve.v1.DecodeShard/{m}": _DECODE for m in ("Describe", "Forward", "WaitReady", "PushHandoff")},
}


def aio_server(
    tokens: TokenTable,
    *,
    max_message: int = WORKER_MAX_MESSAGE,
    limits: GrpcLimits | None = None,
    policy: Policy | None = None,
) -> grpc.aio.Server:
    """An aio server (create it inside the loop that will run it) that checks every call's
    token (and, with a `policy`, its role); `limits` default to `GrpcLimits.from_env()`."""
    limits = limits or GrpcLimits.from_env()
    return grpc.aio.server(
        interceptors=[ServiceAuthInterceptor(tokens, policy)],
        options=[*SERVER_OPTIONS, *size_options(max_message), *limits.options()],
    )


def bind(server: grpc.aio.Server, host: str, port: int, tls: TLSConfig | None = None) -> int:
    """Listen on host:port (0 = any free port); return the bound port, or raise OSError.
    With `tls`, the port speaks TLS only."""
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_secure_port(address, tls.server_credentials()) if tls else server.add_insecure_port(address)
    except RuntimeError as exc:  # grpc raises RuntimeError("Failed to bind to address ...")
        raise OSError(f"cannot listen on {address}: {exc}") from exc
    if bound == 0:
        raise OSError(f"cannot listen on {address}")
    return bound


async def listen(
    server: grpc.aio.Server,
    host: str,
    port: int,
    tls: TLSConfig | None = None,
    limits: GrpcLimits | None = None,
    per_peer: int | None = None,
) -> tuple[int, PeerCappedFront]:
    """Listen on host:port (0 = any free port) behind a per-address connection cap
    (grpc_front.py): the gRPC server itself listens on a unix socket in a private folder. Returns
    the bound port and the front (close it after the server stops); OSError if it cannot."""
    limits = limits or GrpcLimits.from_env()
    inner = inner_address()
    bind_inner = f"unix:{inner}"
    try:
        bound = (
            server.add_secure_port(bind_inner, tls.server_credentials())
            if tls
            else server.add_insecure_port(bind_inner)
        )
    except RuntimeError as exc:
        raise OSError(f"cannot listen on {bind_inner}: {exc}") from exc
    if bound == 0:
        raise OSError(f"cannot listen on {bind_inner}")
    # Each spliced connection holds three descriptors here (outer, inner, gRPC's end of the
    # inner): the total stays within a third of the process's limit, the rest for everything else.
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    total = limits.max_connections if soft == resource.RLIM_INFINITY else max(1, min(limits.max_connections, soft // 6))
    front = PeerCappedFront(inner, min(total, per_peer or per_peer_from_env(total)), total)
    try:
        return await front.start(host, port), front
    except OSError as exc:
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        raise OSError(f"cannot listen on {address}: {exc}") from exc
