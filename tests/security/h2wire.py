"""What an unauthenticated peer sends a gRPC port, frame by frame: HTTP/2 (RFC 9113) whose
header blocks are HPACK literals (RFC 7541 6.2.2: no Huffman, no table), enough to open a
call and stop at any point of it. No library: h2 would be a test dependency for a few lines.
"""

from __future__ import annotations

import socket
import struct

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, GOAWAY = 0x0, 0x1, 0x3, 0x4, 0x7
END_STREAM, END_HEADERS = 0x1, 0x4


def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + struct.pack("!I", stream) + payload


def settings(pairs: tuple[tuple[int, int], ...] = ()) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(struct.pack("!HI", k, v) for k, v in pairs))


def _integer(value: int, prefix_bits: int) -> bytes:
    """RFC 7541 5.1."""
    top = (1 << prefix_bits) - 1
    if value < top:
        return bytes([value])
    out = [top]
    value -= top
    while value >= 128:
        out.append((value & 127) | 128)
        value >>= 7
    return bytes(out + [value])


def _literal(name: str, value: str) -> bytes:
    n, v = name.encode(), value.encode()
    return b"\x00" + _integer(len(n), 7) + n + _integer(len(v), 7) + v


def call_headers(stream: int, path: str, extra: tuple[tuple[str, str], ...] = ()) -> bytes:
    """The HEADERS frame that opens a gRPC call (no END_STREAM: the request message would follow)."""
    fields = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", "x"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
        *extra,
    ]
    return frame(HEADERS, END_HEADERS, stream, b"".join(_literal(k, v) for k, v in fields))


def connect(address: str) -> socket.socket:
    """A connection that has sent the client preface and its SETTINGS, nothing else."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(PREFACE + settings(((0x4, 1 << 30),)))  # a big window for what the server sends
    return sock


def frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    """(type, flags, stream, payload) of every whole frame in `data`."""
    out, i = [], 0
    while i + 9 <= len(data):
        length = int.from_bytes(data[i : i + 3], "big")
        if i + 9 + length > len(data):
            break
        stream = int.from_bytes(data[i + 5 : i + 9], "big") & 0x7FFFFFFF
        out.append((data[i + 3], data[i + 4], stream, data[i + 9 : i + 9 + length]))
        i += 9 + length
    return out
