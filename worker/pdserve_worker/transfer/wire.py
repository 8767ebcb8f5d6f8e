"""The host engine's TCP framing: one control/data stream per client→server link.

Every frame starts with a fixed header `(kind, arg, seq, size)`; what follows depends on the
kind. Payload bytes are received straight into registered memory (`recv_into` on a view of
the raw address) and sent straight from it, so the TCP path makes no extra copy in Python.

  HELLO      client→server  body: JSON {client}            reply HELLO_ACK, body: JSON
  WRITE      client→server  arg=n, size=payload bytes; n × (remote_addr, len), then payload
  READ       client→server  arg=n; n × (remote_addr, len)   reply ACK size=bytes, then payload
  NOTIFY     client→server  body: JSON {name, msg}          reply ACK
  ACK        server→client  arg=status code, seq echoes the request
  BYE        client→server  the client disconnects

The server answers frames in order, one connection at a time, so the client matches ACKs to
its FIFO of pending frames and checks the seq.
"""

from __future__ import annotations

import ctypes
import json
import socket
import struct
from enum import IntEnum

HEADER = struct.Struct("!B3xIQQ")  # kind, arg, seq, size
DESC = struct.Struct("!QQ")  # remote_addr, len
MAX_CONTROL_BODY = 4 << 20  # HIXL's control message limit (HIXL.md 1.5)
MAX_DESCS_PER_FRAME = 1 << 16


class Kind(IntEnum):
    HELLO = 1
    HELLO_ACK = 2
    WRITE = 3
    READ = 4
    NOTIFY = 5
    ACK = 6
    BYE = 7


class ProtocolError(ConnectionError):
    """The peer sent something this protocol does not allow: the link is dropped."""


def header(kind: Kind, arg: int = 0, seq: int = 0, size: int = 0) -> bytes:
    return HEADER.pack(int(kind), arg, seq, size)


def pack_descs(descs: list[tuple[int, int]]) -> bytes:
    return b"".join(DESC.pack(addr, length) for addr, length in descs)


def unpack_descs(data: bytes) -> list[tuple[int, int]]:
    return [DESC.unpack_from(data, i * DESC.size) for i in range(len(data) // DESC.size)]


def json_frame(kind: Kind, body: dict[str, object], seq: int = 0, arg: int = 0) -> bytes:
    raw = json.dumps(body, separators=(",", ":")).encode()
    return header(kind, arg, seq, len(raw)) + raw


def memory(addr: int, length: int) -> memoryview:
    """A writable byte view of raw memory at `addr` (which the caller has range-checked)."""
    return memoryview((ctypes.c_char * length).from_address(addr)).cast("B")


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf))
    return bytes(buf)


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {n} bytes")
        got += k


def discard(sock: socket.socket, n: int) -> None:
    """Read and drop n bytes: the payload of a frame that was refused."""
    scratch = memoryview(bytearray(min(n, 1 << 20) or 1))
    while n > 0:
        k = sock.recv_into(scratch, min(n, len(scratch)))
        if k == 0:
            raise ConnectionError("peer closed the connection while a refused payload was drained")
        n -= k


def recv_header(sock: socket.socket) -> tuple[Kind, int, int, int]:
    kind, arg, seq, size = HEADER.unpack(recv_exact(sock, HEADER.size))
    try:
        return Kind(kind), arg, seq, size
    except ValueError:
        raise ProtocolError(f"unknown frame kind {kind}") from None


def recv_json(sock: socket.socket, size: int) -> dict[str, object]:
    if size > MAX_CONTROL_BODY:
        raise ProtocolError(f"control body of {size} bytes exceeds {MAX_CONTROL_BODY}")
    body = json.loads(recv_exact(sock, size))
    if not isinstance(body, dict):
        raise ProtocolError(f"control body must be a JSON object, got {type(body).__name__}")
    return body
