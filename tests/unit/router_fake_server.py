"""A router process over a ScriptedBackend, served by `serve_router` (for the SIGTERM tests).

Usage: python router_fake_server.py PORT GRACE_S TOKENS DELAY_S
Prints `closed REQUEST_ID cancelled=BOOL tokens=N` when a backend generator closes.
"""

from __future__ import annotations

import sys

from router_fakes import ScriptedBackend

from pdserve_common import logs
from pdserve_worker.router.app import create_app
from pdserve_worker.router.server import serve_router


def main() -> None:
    port, grace_s, tokens, delay_s = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    logs.setup("router")
    backend = ScriptedBackend(
        pieces=[f"t{i} " for i in range(tokens)], delay_s=delay_s, max_model_len=100_000,
        on_close=lambda call: print(f"closed {call.request_id} cancelled={call.cancelled} tokens={call.tokens_sent}",
                                    flush=True),
    )
    serve_router(create_app(backend), "127.0.0.1", port, grace_s=grace_s)
    print("exited", flush=True)


if __name__ == "__main__":
    main()
