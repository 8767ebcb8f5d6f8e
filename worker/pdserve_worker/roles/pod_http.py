"""The pod-facing HTTP endpoints of a worker (pod_env.py's contract) and an embeddable uvicorn.

- `GET /healthz`: the process is alive (answers while the model is still loading).
- `GET /readyz`: 200 once the model is loaded and the worker registered with the broker,
  503 (with the reason) before that and while draining.
- `GET /drain` (decode): stop taking slots, wait for the active ones, answer 200 when done or
  when the drain timeout passed. Idempotent: a second call waits as well.

`EmbeddedServer` is uvicorn without its signal handling: the worker's own shutdown sequence
(drain, deregister, stop gRPC) owns SIGTERM, and tells the server to stop when it is time.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import ASGIApp

from pdserve_worker.roles.router_server import build_router_server


@dataclass
class WorkerState:
    """What /readyz reports; the worker's main task updates it as it starts and stops."""

    role: str
    worker_id: str
    phase: str = "starting"  # starting | loading | registering | ready | draining | stopping
    detail: dict[str, Any] = field(default_factory=dict)
    serving: Callable[[], bool] | None = None  # more than started: e.g. a router that knows its peers

    @property
    def ready(self) -> bool:
        return self.phase == "ready" and (self.serving is None or self.serving())


def health_routes(state: WorkerState, drain: Callable[[], Awaitable[dict[str, Any]]] | None = None) -> list[Route]:
    async def healthz(_: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "role": state.role, "worker": state.worker_id, "phase": state.phase})

    async def readyz(_: Request) -> JSONResponse:
        body = {"ready": state.ready, "role": state.role, "worker": state.worker_id, "phase": state.phase,
                **state.detail}
        return JSONResponse(body, status_code=200 if state.ready else 503)

    routes = [Route("/healthz", healthz), Route("/readyz", readyz)]
    if drain is not None:

        async def drain_endpoint(_: Request) -> JSONResponse:
            return JSONResponse(await drain())

        routes.append(Route("/drain", drain_endpoint))
    return routes


def worker_app(state: WorkerState, drain: Callable[[], Awaitable[dict[str, Any]]] | None = None) -> Starlette:
    """The HTTP app of a prefill or decode worker."""
    return Starlette(routes=health_routes(state, drain))


class EmbeddedServer(uvicorn.Server):
    """uvicorn that leaves signals to its host: stop it with `should_exit = True`."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def listen(host: str, port: int) -> socket.socket:
    """A bound TCP socket for uvicorn, so a taken port fails here, as an OSError naming it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} (HTTP): {exc.strerror}") from exc
    return sock


def embedded_server(app: ASGIApp, host: str, port: int, grace_s: float) -> EmbeddedServer:
    """The router's uvicorn configuration (quiet, graceful drain of `grace_s`), signal-free."""
    return EmbeddedServer(build_router_server(app, host, port, grace_s=grace_s).config)
