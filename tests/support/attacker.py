"""What an attacker on the network does to a KV transfer port, at the wire level.

Frames are built with the protocol's own header layout (wire.py) because that is what a
peer must send to be understood at all; what the tests check is how the *server* answers.
"""

from __future__ import annotations

import json
import os
import socket
import time

from pdserve_worker.transfer.backends.host import link_auth, wire
from pdserve_worker.transfer.backends.host.netio import parse_engine_id


def connect(engine_id: str, timeout_s: float = 5.0, source: str | None = None) -> socket.socket:
    """A TCP connection to `engine_id`, from the loopback address `source` when given (several
    loopback addresses stand for several attacking hosts)."""
    host, port = parse_engine_id(engine_id)
    sock = socket.create_connection((host, port), timeout=timeout_s, source_address=(source, 0) if source else None)
    sock.settimeout(timeout_s)
    return sock


def recv_all_until_close(sock: socket.socket, timeout_s: float = 5.0) -> bytes:
    """Everything the server sends until it closes the connection (or the timeout)."""
    sock.settimeout(timeout_s)
    got = b""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(1 << 16)
        except TimeoutError:
            break
        except ConnectionResetError:
            break
        if not chunk:
            return got
        got += chunk
    raise AssertionError(f"server kept the connection open for {timeout_s}s; got {len(got)} bytes")


def read_frame(sock: socket.socket) -> tuple[wire.Kind, int, int, bytes]:
    head = _exactly(sock, wire.HEADER.size)
    kind, arg, seq, size = wire.HEADER.unpack(head)
    body = _exactly(sock, size) if size < (1 << 20) else b""
    return wire.Kind(kind), arg, seq, body


def _exactly(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError(f"closed after {len(out)} of {n} bytes")
        out += chunk
    return out


def hello(sock: socket.socket) -> tuple[bytes, dict]:
    """Send HELLO; return our nonce and the server's CHALLENGE body."""
    nonce = os.urandom(link_auth.NONCE_BYTES)
    sock.sendall(wire.json_frame(wire.Kind.HELLO, {"v": 1, "nonce": nonce.hex()}))
    kind, _, _, body = read_frame(sock)
    assert kind is wire.Kind.CHALLENGE, kind
    return nonce, json.loads(body)


def authenticate(sock: socket.socket, key: bytes, client: str = "attacker", host: str = "another-host") -> dict:
    """The whole handshake with `key` (an insider's view); returns the HELLO_ACK body."""
    nonce, challenge = hello(sock)
    server_nonce = bytes.fromhex(challenge["nonce"])
    proof = link_auth.client_proof(key, nonce, server_nonce, client, host)
    sock.sendall(wire.json_frame(wire.Kind.AUTH, {"client": client, "host": host, "proof": proof}))
    kind, _, _, body = read_frame(sock)
    assert kind is wire.Kind.HELLO_ACK, kind
    return json.loads(body)


def write_frame(addr: int, payload: bytes, seq: int = 1) -> bytes:
    return wire.header(wire.Kind.WRITE, 1, seq, len(payload)) + wire.pack_descs([(addr, len(payload))]) + payload


def read_request(descs: list[tuple[int, int]], seq: int = 1) -> bytes:
    return wire.header(wire.Kind.READ, len(descs), seq, 0) + wire.pack_descs(descs)


def ack(sock: socket.socket) -> tuple[int, int]:
    """(status, size) of the next ACK."""
    kind, status, _, size = read_frame_header_only(sock)
    assert kind is wire.Kind.ACK, kind
    return status, size


def read_frame_header_only(sock: socket.socket) -> tuple[wire.Kind, int, int, int]:
    kind, arg, seq, size = wire.HEADER.unpack(_exactly(sock, wire.HEADER.size))
    return wire.Kind(kind), arg, seq, size
