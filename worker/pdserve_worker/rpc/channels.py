"""Channel and server construction with the options every pdserve process shares.

Keepalive pings let a watch stream notice a broker host that vanished without closing its
sockets (a plain TCP stream would wait forever); the server must permit those pings or it
answers with GOAWAY "too_many_pings". A short reconnect backoff lets clients find a restarted
broker within a second or two instead of gRPC's default of up to two minutes.

Message sizes are set explicitly on both ends of every channel (gRPC's defaults are 4 MiB in
and unlimited out): a server buffers a whole message before the token is checked, so its
receive limit is what an unauthenticated peer can make it hold per call.

With a `TLSConfig` a server listens with TLS only (no plaintext port next to it) and a client
verifies the server's certificate against the configured CA, under `server_name` when the
address is a pod IP that no certificate names.
"""

from __future__ import annotations

from typing import Any

import grpc

from pdserve_worker.rpc.auth import ServiceAuthInterceptor, TLSConfig, TokenTable, bearer_interceptors

KEEPALIVE_MS = 10_000
# Worker services: a Prefill or Generate request holds up to max_len token ids (<= 5 bytes
# each; the spec caps max_len at 1,048,576) plus at most 16 KiB of stop strings.
WORKER_MAX_MESSAGE = 16 * 1024 * 1024
# The broker: registrations and membership lists (a few hundred bytes per member).
BROKER_MAX_MESSAGE = 4 * 1024 * 1024


def size_options(max_message: int) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", max_message), ("grpc.max_receive_message_length", max_message)]

CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2_000),
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


def aio_channel(address: str, token: str, tls: TLSConfig | None = None, *,
                max_message: int = WORKER_MAX_MESSAGE) -> grpc.aio.Channel:
    """An aio channel to `address` whose every call carries the service's bearer token."""
    options = channel_options(tls, max_message)
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=bearer_interceptors(token))
    return grpc.aio.secure_channel(address, tls.channel_credentials(token), options=options)


def aio_server(tokens: TokenTable, *, max_message: int = WORKER_MAX_MESSAGE) -> grpc.aio.Server:
    """An aio server (create it inside the loop that will run it) that checks every call's token."""
    return grpc.aio.server(interceptors=[ServiceAuthInterceptor(tokens)],
                           options=[*SERVER_OPTIONS, *size_options(max_message)])


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
