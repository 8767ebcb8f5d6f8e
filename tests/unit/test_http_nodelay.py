"""Every HTTP listener turns Nagle off on the connections it accepts.

asyncio sets TCP_NODELAY on an accepted connection only when the listening socket's `proto`
is IPPROTO_TCP (`asyncio.base_events._set_nodelay`, called from `_accept_connection2` via the
selector transport's constructor): a socket made with proto 0 and handed to uvicorn keeps
Nagle on, and with the client's delayed ACK each small response on a kept-alive connection
waited ~40 ms. The worker's probe/metrics port, the admin port and the router's API all listen
through `pod_http.serve_in_background` → `pod_http.listen`; this checks the option on the
accepted sockets themselves, and that no other product module makes an HTTP listening socket.
"""

from __future__ import annotations

import ast
import asyncio
import socket
from pathlib import Path

import httpx
import pytest

from pdserve_worker.process.pod_http import WorkerState, listen, serve_in_background, worker_app

ROOT = Path(__file__).resolve().parents[2]


def test_the_listening_socket_says_tcp() -> None:
    sock = listen("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
    finally:
        sock.close()


@pytest.mark.asyncio
async def test_accepted_keep_alive_connections_have_tcp_nodelay() -> None:
    running = serve_in_background(worker_app(WorkerState("decode", "decode-0")), "127.0.0.1", 0, 1.0)
    try:
        for _ in range(200):
            if running.server.started:
                break
            await asyncio.sleep(0.01)
        port = running.server.servers[0].sockets[0].getsockname()[1]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            for _ in range(3):  # one kept-alive connection, several requests
                assert (await client.get("/healthz")).status_code == 200
            connections = list(running.server.server_state.connections)
            assert connections, "the server holds no connection"
            for protocol in connections:
                accepted = protocol.transport.get_extra_info("socket")
                assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        await running.stop()


def test_no_other_product_module_makes_a_stream_listener_for_http() -> None:
    """Sockets made with socket.socket(..., SOCK_STREAM) in product code: only pod_http.listen
    (HTTP), the host engine's server (which sets TCP_NODELAY on what it accepts), the
    free-port helpers (bound and closed at once, never listening) and a tensor-parallel group's
    rendezvous store, bound to loopback (torch's TCPStore serves it; no HTTP)."""
    allowed = {"process/pod_http.py", "transfer/backends/host/server.py", "util/free_ports.py", "ranks/group.py"}
    found = set()
    for path in (ROOT / "worker" / "pdserve_worker").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "socket.socket":
                if any("SOCK_STREAM" in ast.unparse(a) for a in node.args):
                    found.add(str(path.relative_to(ROOT / "worker" / "pdserve_worker")))
    assert found <= allowed, f"stream sockets made outside the known listeners: {sorted(found - allowed)}"
    assert "process/pod_http.py" in found
