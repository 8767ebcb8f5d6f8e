"""The pod-facing HTTP endpoints of a worker (pod_env.py's contract) and an embeddable uvicorn.

- `GET /healthz`: the process is alive (answers while the model is still loading); 503 once
  the worker was drained and left the broker (`phase` "drained"), so a worker drained by
  anything but its own shutdown is restarted by its liveness probe instead of idling.
- `GET /readyz`: 200 once the model is loaded and the worker registered with the broker,
  503 (with the reason) before that and while draining.
- On the admin port (127.0.0.1 only, `admin_app`, the service's token): `GET /drain` (decode)
  stops taking slots, waits for the active ones, leaves the broker and answers 200 when done
  or when the drain timeout passed. Idempotent; the preStop hook calls it (`pdserve drain`).

`EmbeddedServer` is uvicorn without its signal handling: the worker's own shutdown sequence
(drain, deregister, stop gRPC) owns SIGTERM, and tells the server to stop when it is time.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from pdserve_common import inherited_sockets
from pdserve_common.auth import TLSConfig, TokenTable, authorize
from pdserve_worker.api.http_guard import HttpLimits
from pdserve_worker.api.server import build_router_server

ADMIN_HOST = "127.0.0.1"


@dataclass
class WorkerState:
    """What /readyz reports; the worker's main task updates it as it starts and stops."""

    role: str
    worker_id: str
    phase: str = "starting"  # starting | loading | registering | ready | draining | drained | stopping
    detail: dict[str, Any] = field(default_factory=dict)
    serving: Callable[[], bool] | None = None  # more than started: e.g. a router that knows its peers
    metrics: Callable[[], bytes] | None = None  # the Prometheus exposition, once the role exists

    @property
    def ready(self) -> bool:
        return self.phase == "ready" and (self.serving is None or self.serving())


def health_routes(state: WorkerState) -> list[Route]:
    async def healthz(_: Request) -> JSONResponse:
        body = {"status": "ok", "role": state.role, "worker": state.worker_id, "phase": state.phase}
        if state.phase == "drained":
            return JSONResponse({**body, "status": "drained"}, status_code=503)
        return JSONResponse(body)

    async def readyz(_: Request) -> JSONResponse:
        body = {
            "ready": state.ready,
            "role": state.role,
            "worker": state.worker_id,
            "phase": state.phase,
            **state.detail,
        }
        return JSONResponse(body, status_code=200 if state.ready else 503)

    return [Route("/healthz", healthz), Route("/readyz", readyz)]


# The probe port's bounds: the kubelet holds a connection or two per probe period; anything
# else that gets there (the pod's own network namespace, a node-local process) shares these.
PROBE_LIMITS = HttpLimits(request_deadline_s=5.0, max_connections=64, max_connections_per_peer=8)


def probe_app(state: WorkerState) -> Starlette:
    """The probe port's app (pod_env.PROBE_PORT): /healthz and /readyz, nothing else."""
    return Starlette(routes=health_routes(state))


def worker_app(state: WorkerState) -> Starlette:
    """The HTTP app of a prefill or decode worker (the pod's `http` port): probes and `/metrics`.

    `/metrics` is empty (200) while the model loads: the role's metrics exist once it does."""

    async def metrics(_: Request) -> Response:
        body = state.metrics() if state.metrics is not None else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    return Starlette(routes=[*health_routes(state), Route("/metrics", metrics)])


def admin_app(tokens: TokenTable, drain: Callable[[], Awaitable[dict[str, Any]]]) -> Starlette:
    """The admin endpoints (`/drain`), for the admin port on 127.0.0.1: every call needs the
    service's token, as gRPC calls do (`Authorization: Bearer <token>`)."""

    async def drain_endpoint(request: Request) -> JSONResponse:
        denial = authorize(tokens, [(k.lower(), v) for k, v in request.headers.items()], None)
        if denial is not None:
            return JSONResponse({"error": denial.details}, status_code=401)
        return JSONResponse(await drain())

    return Starlette(routes=[Route("/drain", drain_endpoint)])


class EmbeddedServer(uvicorn.Server):
    """uvicorn that leaves signals to its host: stop it with `should_exit = True`."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def listen(host: str, port: int) -> socket.socket:
    """A bound TCP socket for uvicorn, so a taken port fails here, as an OSError naming it.

    Made with `IPPROTO_TCP` explicitly: asyncio turns TCP_NODELAY on for the connections it
    accepts only when the listening socket's `proto` says TCP (a socket made with proto 0 keeps
    Nagle on, and with the client's delayed ACK every small response on a kept-alive connection
    waited ~40 ms)."""
    handed = inherited_sockets.take(port)  # `pdserve local` bound it for us
    if handed is not None:
        return handed
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} (HTTP): {exc.strerror}") from exc
    return sock


def embedded_server(
    app: ASGIApp, host: str, port: int, grace_s: float, tls: TLSConfig | None = None, limits: HttpLimits = HttpLimits()
) -> EmbeddedServer:
    """The router's uvicorn configuration (quiet, graceful drain of `grace_s`, HTTPS with
    `tls`, the bounds of `limits` on unfinished requests), signal-free."""
    return EmbeddedServer(build_router_server(app, host, port, grace_s=grace_s, tls=tls, limits=limits).config)


@dataclass
class RunningServer:
    """An embedded server serving in a task of the running event loop."""

    server: EmbeddedServer
    task: asyncio.Task[None]

    async def stop(self) -> None:
        """Stop accepting, let requests in flight finish (the server's grace period), end."""
        self.server.should_exit = True
        with contextlib.suppress(Exception):
            await self.task


def serve_in_background(
    app: ASGIApp,
    host: str,
    port: int,
    grace_s: float,
    tls: TLSConfig | None = None,
    name: str = "http",
    limits: HttpLimits = HttpLimits(),
) -> RunningServer:
    """Listen on host:port now (OSError naming it if taken) and serve `app` in a task."""
    sock = listen(host, port)
    server = embedded_server(app, host, port, grace_s, tls, limits)
    return RunningServer(server, asyncio.create_task(server.serve(sockets=[sock]), name=name))
