"""The router app's uvicorn server, drained gracefully when told to stop.

Kubernetes stops a pod with SIGTERM, then SIGKILL after the grace period. The worker process
(`process.worker_main`) runs this server embedded and signal-free (`process.pod_http`); on the
stop signal it tells the server to exit, and uvicorn stops accepting connections, lets the
requests in flight (streams included) run for up to `grace_s` seconds and then cancels what
is left, which closes the backends' generators and frees their slots.
"""

from __future__ import annotations

import uvicorn
from starlette.types import ASGIApp

from pdserve_common.auth import TLSConfig
from pdserve_worker.api.http_guard import HttpLimits, guarded_h11

DEFAULT_GRACE_S = 30.0


def build_router_server(
    app: ASGIApp,
    host: str,
    port: int,
    *,
    grace_s: float = DEFAULT_GRACE_S,
    log_level: str = "warning",
    tls: TLSConfig | None = None,
    limits: HttpLimits = HttpLimits(),
) -> uvicorn.Server:
    """A uvicorn server for `app`, not yet started (tests run it in a thread and stop it).
    With `tls` it serves HTTPS only (clients are not asked for certificates: API clients use
    the API's own authentication). `limits` bound what clients that never finish a request
    can hold (http_guard.py)."""
    ssl: dict[str, str] = {}
    if tls is not None and tls.cert_file is not None and tls.key_file is not None:
        ssl = {"ssl_certfile": str(tls.cert_file), "ssl_keyfile": str(tls.key_file)}
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        timeout_graceful_shutdown=grace_s,  # type: ignore[arg-type]  # typed int, used as a float timeout
        log_config=None,  # keep the process's key=value logging (pdserve_common.logs.setup)
        log_level=log_level,
        access_log=False,  # the router logs one structured line per request instead
        lifespan="off",
        http=guarded_h11(limits),
        **ssl,  # type: ignore[arg-type]
    )
    return uvicorn.Server(config)
