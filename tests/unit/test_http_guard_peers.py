"""api/http_guard.py's per-peer cap, in process: one source address holds at most its share
of an HTTP port's connections, the rest of the cap stays for other clients, and a closed
connection gives its place back (the count has one release path, `connection_lost`)."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest

from pdserve_worker.api.http_guard import HttpLimits
from pdserve_worker.process.pod_http import WorkerState, serve_in_background, worker_app


def open_from(source: str, port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    s.setblocking(False)
    return s


def closed(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def test_the_share_defaults_to_a_sixteenth_of_the_cap_and_never_exceeds_it() -> None:
    assert HttpLimits().effective_per_peer() == 256  # (#58 A2: half let two addresses fill the router)
    assert HttpLimits(max_connections=100).effective_per_peer() == 6
    assert HttpLimits(max_connections=100, max_connections_per_peer=500).effective_per_peer() == 100
    assert HttpLimits(max_connections=1).effective_per_peer() == 1


@pytest.mark.asyncio
async def test_one_address_gets_its_share_and_another_is_still_served() -> None:
    limits = HttpLimits(request_deadline_s=30, max_connections=8, max_connections_per_peer=3)
    running = serve_in_background(worker_app(WorkerState("decode", "d")), "127.0.0.1", 0, 1.0, limits=limits)
    try:
        while not running.server.started:
            await asyncio.sleep(0.01)
        port = running.server.servers[0].sockets[0].getsockname()[1]
        flood = [open_from("127.0.0.2", port) for _ in range(6)]
        await asyncio.sleep(0.2)
        assert sum(not closed(s) for s in flood) == 3
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            assert (await client.get("/healthz")).status_code == 200
        for s in flood:
            s.close()
        await asyncio.sleep(0.2)  # their places come back: the same address gets 3 again
        again = [open_from("127.0.0.2", port) for _ in range(4)]
        await asyncio.sleep(0.2)
        assert sum(not closed(s) for s in again) == 3
        for s in again:
            s.close()
    finally:
        await running.stop()
