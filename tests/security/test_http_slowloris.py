"""Review of issue 13: clients that never finish a request, on every HTTP port of `pdserve local`.

Before: uvicorn has no deadline for receiving a request (its keep-alive timer runs only
between requests and is reset by every byte), and no cap on connections. A connection that
said nothing, or a header line now and then, was held for ever. 22,000 of them (no token
needed; the router's port is the public API, a worker's pod port is open to the whole cluster
for probes) took the router to its descriptor limit: /health stopped answering and asyncio
logged a traceback per failed accept (72 MB in two minutes); on a decode the transfer server
then stopped accepting KV links. Now every HTTP port cuts a request that is not whole within
its deadline and closes connections past its cap at once (api/http_guard.py). The
deployment runs with the deadline at 2 s and the cap at 64 (conftest.py).
"""

from __future__ import annotations

import os
import socket
import threading
import time

import httpx
import pytest

from security.conftest import HTTP_DEADLINE_S, HTTP_MAX_CONNECTIONS

pytestmark = [pytest.mark.slow, pytest.mark.timing]


def http_ports(run) -> dict[str, str]:
    """Every HTTP port the deployment's processes listen on: the router's API, each worker's
    pod port (probes), each decode's admin port (only a decode has one listening)."""
    ports = {"router": run.url.removeprefix("http://")}
    for child in run.manifest["children"]:
        for kind in ("http", "admin"):
            if child.get(kind) and child["role"] != "router" and (kind == "http" or child["role"] == "decode"):
                ports[f"{child['name']}/{kind}"] = child[kind]
    return ports


def connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


def closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closed `sock` (reading what it sent), None if it stayed open."""
    started = time.monotonic()
    sock.settimeout(0.05)
    while time.monotonic() - started < seconds:
        try:
            if sock.recv(4096) == b"":
                return time.monotonic() - started
        except TimeoutError:
            continue
        except ConnectionResetError:
            return time.monotonic() - started
    return None


def trickle(sock: socket.socket, stop: threading.Event) -> None:
    """Slowloris: a header byte every 0.3 s, so the connection is never idle."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000
    for byte in head:
        if stop.wait(0.3):
            return
        try:
            sock.send(bytes([byte]))
        except OSError:
            return


def test_requests_not_whole_within_the_deadline_are_cut_on_every_http_port(local):
    ports = http_ports(local)
    assert len(ports) == 4, ports  # router, decode pod + admin, prefill pod
    stop = threading.Event()
    held: list[tuple[str, str, socket.socket]] = []
    for name, address in ports.items():
        silent = connect(address)
        partial = connect(address)
        partial.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        body = connect(address)  # the whole head, half the promised body
        body.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"model": '
        )
        slow = connect(address)
        threading.Thread(target=trickle, args=(slow, stop), daemon=True).start()
        held += [
            (name, "silent", silent),
            (name, "partial head", partial),
            (name, "partial body", body),
            (name, "trickle", slow),
        ]
    try:
        assert httpx.get(f"{local.url}/health", timeout=5).status_code == 200  # served meanwhile
        waited = {(name, kind): closed_within(sock, HTTP_DEADLINE_S + 2.0) for name, kind, sock in held}
    finally:
        stop.set()
        for _, _, sock in held:
            sock.close()
    assert [k for k, took in waited.items() if took is None] == [], "held past the deadline"
    assert httpx.get(f"{local.url}/health", timeout=5).status_code == 200


def test_connections_past_the_cap_are_closed_at_once_and_cost_no_descriptors(local):
    for name in ("router-0", "decode-0"):
        child = local.child(name)
        address = local.url.removeprefix("http://") if name == "router-0" else child["http"]
        before = len(os.listdir(f"/proc/{child['pid']}/fd"))
        # From 12 addresses, so that the cap, not one address's share of it, is what fills.
        socks = [s for i in range(12) for s in flood_from(address, f"127.0.0.{2 + i}", HTTP_MAX_CONNECTIONS // 4)]
        try:
            time.sleep(0.3)
            during = len(os.listdir(f"/proc/{child['pid']}/fd"))
            refused = sum(1 for s in socks if closed_within(s, 0.05) is not None)
        finally:
            for s in socks:
                s.close()
        assert during - before <= HTTP_MAX_CONNECTIONS + 2, (name, before, during)
        assert refused >= 2 * HTTP_MAX_CONNECTIONS - 2, (name, refused)
    deadline = time.monotonic() + 5
    while httpx.get(f"{local.url}/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline


def flood_from(address: str, source: str, count: int) -> list[socket.socket]:
    """`count` idle connections to `address` from the loopback address `source`."""
    host, port = address.rsplit(":", 1)
    socks = []
    for _ in range(count):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind((source, 0))
        s.settimeout(5)
        s.connect((host, int(port)))
        s.send(b"G")  # one byte, as #29's flood: a request that never finishes
        socks.append(s)
    return socks


def test_a_flood_from_one_address_leaves_the_cap_to_other_clients_on_every_http_port(local):
    """#29: 4,200 idle connections from one client took the router's whole cap (every real
    request and /health refused), and the same on a decode's pod port failed its liveness
    probes. Now one address holds at most its share (the deployment runs with a per-peer cap of
    HTTP_MAX_CONNECTIONS_PER_PEER of HTTP_MAX_CONNECTIONS): flooded from 127.0.0.2 with twice
    the whole cap, each port still answers a client on 127.0.0.1."""
    from security.conftest import HTTP_MAX_CONNECTIONS_PER_PEER

    for name, address in http_ports(local).items():
        if name.endswith("/admin"):
            continue  # listens for the pod itself only (127.0.0.1, the token): no probe there
        socks = flood_from(address, "127.0.0.2", 2 * HTTP_MAX_CONNECTIONS)
        try:
            time.sleep(0.3)
            held = sum(1 for s in socks if closed_within(s, 0.05) is None)
            path = "/health" if name == "router" else "/healthz"
            for _ in range(3):
                assert httpx.get(f"http://{address}{path}", timeout=5).status_code == 200, name
        finally:
            for s in socks:
                s.close()
        assert held <= HTTP_MAX_CONNECTIONS_PER_PEER, (name, held)
