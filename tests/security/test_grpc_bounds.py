"""Review of issue 13: what a peer without a token can hold on a gRPC port of `pdserve local`.

Before: gRPC's defaults. A TCP connection that never spoke HTTP/2 was kept 120 s, one that
sent the HTTP/2 preface and then nothing was kept for ever, a call opened without a token was
kept open until its request message arrived (the token was checked only then), and nothing
capped the connections. 22,000 preface-only connections (about 13 KB each) took the broker
to its descriptor limit ("File descriptor limit reached" from the listener); the operator's
broker is reachable from every pdserve pod of every service, and its pod has a 512 Mi
memory limit: about 35,000 such connections from one pod of another service would have had
it OOM-killed, and with it every service's membership.

Now every gRPC server (broker, prefill, decode) refuses a call without a valid token from its
headers, before reading its message, cuts a connection that has not finished the HTTP/2 (and
TLS) handshake in time, closes connections with no call for a while, and caps connections
(pdserve_common/channels.py). The deployment runs with those turned down (conftest.py).
"""

from __future__ import annotations

import os
import socket
import time

import pytest

from security import h2wire
from security.conftest import GRPC_HANDSHAKE_MS, GRPC_IDLE_MS, GRPC_MAX_CONNECTIONS

pytestmark = [pytest.mark.slow, pytest.mark.timing]

METHODS = {
    "broker": "/pdserve.v1.Broker/ListMembers",
    "decode-0": "/pdserve.v1.Decode/Reserve",
    "prefill-0": "/pdserve.v1.Prefill/Prefill",
}


def grpc_ports(run) -> dict[str, str]:
    ports = {"broker": run.manifest["broker"]}
    ports.update({c["name"]: c["grpc"] for c in run.manifest["children"] if c["role"] in ("decode", "prefill")})
    return ports


def received_until_close(sock: socket.socket, seconds: float) -> tuple[bytes, float | None]:
    """What the server sent, and after how many seconds it closed (None: still open)."""
    started, got = time.monotonic(), b""
    sock.settimeout(0.05)
    while time.monotonic() - started < seconds:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return got, time.monotonic() - started
        if not chunk:
            return got, time.monotonic() - started
        got += chunk
    return got, None


def answered(sock: socket.socket, stream: int, seconds: float) -> bool:
    """Whether the server ended `stream` (trailers or RST_STREAM) within `seconds`."""
    sock.settimeout(0.05)
    got, started = b"", time.monotonic()
    while time.monotonic() - started < seconds:
        try:
            got += sock.recv(65536)
        except TimeoutError:
            pass
        for kind, flags, sid, _ in h2wire.frames(got):
            if sid == stream and (kind == h2wire.RST_STREAM or (kind == h2wire.HEADERS and flags & h2wire.END_STREAM)):
                return True
    return False


def test_a_call_without_a_token_is_refused_before_its_message(local):
    for name, address in grpc_ports(local).items():
        with h2wire.connect(address) as sock:
            sock.sendall(h2wire.call_headers(1, METHODS[name]))  # no authorization, no message
            assert answered(sock, 1, 2.0), f"{name}: a call without a token stays open"
            sock.sendall(h2wire.call_headers(3, METHODS[name], (("authorization", "Bearer not-a-token"),)))
            assert answered(sock, 3, 2.0), f"{name}: a call with an unknown token stays open"


def test_silent_and_idle_connections_are_closed(local):
    deadline_s = max(GRPC_HANDSHAKE_MS, GRPC_IDLE_MS) / 1000 + 2.5
    held = []
    for name, address in grpc_ports(local).items():
        host, port = address.rsplit(":", 1)
        held.append((name, "tcp only", socket.create_connection((host, int(port)))))
        held.append((name, "preface only", h2wire.connect(address)))
        refused = h2wire.connect(address)  # its one call was refused: idle from then on
        refused.sendall(h2wire.call_headers(1, METHODS[name]))
        held.append((name, "refused call", refused))
    try:
        closed = {(name, kind): received_until_close(sock, deadline_s)[1] for name, kind, sock in held}
    finally:
        for _, _, sock in held:
            sock.close()
    assert [k for k, took in closed.items() if took is None] == [], "kept open"


def test_connections_past_the_cap_are_closed(local):
    decode = local.child("decode-0")
    before = len(os.listdir(f"/proc/{decode['pid']}/fd"))
    socks = [h2wire.connect(decode["grpc"]) for _ in range(3 * GRPC_MAX_CONNECTIONS)]
    try:
        time.sleep(0.5)
        during = len(os.listdir(f"/proc/{decode['pid']}/fd"))
    finally:
        for sock in socks:
            sock.close()
    assert during - before <= GRPC_MAX_CONNECTIONS + 4, (before, during)


def test_a_flood_from_one_address_leaves_every_grpc_port_to_the_others(local, reference):
    """#29: gRPC's one global cap could be taken whole by one peer (the broker is reachable from
    every pdserve pod of every service). Each gRPC port now sits behind a per-address cap
    (pdserve_common/grpc_front.py; `pdserve local` sizes it for its processes, all on 127.0.0.1:
    cli/local_env.py, 16 here, and #58 A9 made a pod's default a sixty-fourth, not a quarter):
    flooded from 127.0.0.2 with twice the whole cap, every port still serves the deployment's own
    processes on 127.0.0.1 — a request through router, prefill and decode, and a token-holder's
    broker call."""
    import grpc

    from pdserve.v1 import broker_pb2, broker_pb2_grpc
    from security.conftest import complete

    held: dict[str, int] = {}
    floods = []
    try:
        for name, address in grpc_ports(local).items():
            host, port = address.rsplit(":", 1)
            socks = []
            for _ in range(2 * GRPC_MAX_CONNECTIONS):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.bind(("127.0.0.2", 0))
                s.connect((host, int(port)))
                socks.append(s)
            floods.append(socks)
            time.sleep(0.3)
            held[name] = sum(1 for s in socks if received_until_close(s, 0.05)[1] is None)
        prompt = "The quick brown fox"
        answer = complete(local, prompt, 8)
        assert answer == reference.complete(reference.tokenizer.encode(prompt), 8)
        with grpc.insecure_channel(local.manifest["broker"]) as channel:
            reply = broker_pb2_grpc.BrokerStub(channel).ListMembers(
                broker_pb2.ListMembersRequest(service_key="local/pdserve"),
                metadata=(("authorization", f"Bearer {local.token}"),),
                timeout=10,
            )
        assert len(reply.members) >= 2
    finally:
        for socks in floods:
            for s in socks:
                s.close()
    share = per_peer_of(local.child("decode-0")["pid"])
    assert share < GRPC_MAX_CONNECTIONS // 2, share
    assert all(count <= share for count in held.values()), (held, share)


def per_peer_of(pid: int) -> int:
    """The per-address share a process of the run was given (its environment)."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    return int(env[b"PDSERVE_GRPC_MAX_CONNECTIONS_PER_PEER"])
