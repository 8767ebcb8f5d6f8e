"""A router process over a ScriptedBackend, drained on SIGTERM (for the SIGTERM tests).

uvicorn drains on SIGTERM: it stops accepting, lets requests in flight run for up to
`grace_s`, cancels the rest (closing the backends' generators), then re-raises the signal.

Usage: python -m support.router_fake_server (tests/ on PYTHONPATH) PORT GRACE_S TOKENS DELAY_S
Prints `closed REQUEST_ID cancelled=BOOL tokens=N` when a backend generator closes.
"""

from __future__ import annotations

import signal
import sys
from types import FrameType

from pdserve_common import logs
from pdserve_worker.api.app import create_app
from pdserve_worker.api.server import build_router_server
from support.router_fakes import ScriptedBackend


def _after_drain(sig: int, frame: FrameType | None) -> None:
    """uvicorn re-raises the captured SIGTERM once drained; the drain was the stop: exit cleanly."""


def main() -> None:
    port, grace_s, tokens, delay_s = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    logs.setup("router")
    backend = ScriptedBackend(
        pieces=[f"t{i} " for i in range(tokens)],
        delay_s=delay_s,
        max_model_len=100_000,
        on_close=lambda call: print(
            f"closed {call.request_id} cancelled={call.cancelled} tokens={call.tokens_sent}", flush=True
        ),
    )
    signal.signal(signal.SIGTERM, _after_drain)
    build_router_server(create_app(backend), "127.0.0.1", port, grace_s=grace_s).run()
    print("exited", flush=True)


if __name__ == "__main__":
    main()
