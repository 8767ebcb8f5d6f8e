"""The host engine's TCP framing: one control/data stream per client→server link.

A fixed header `(kind, arg, seq, size)`, then by kind; payloads go straight from/into registered memory.
  HELLO   c→s  JSON {v, nonce}                 reply CHALLENGE: JSON {auth, nonce}
  AUTH    c→s  JSON {client, host, proof}      reply HELLO_ACK: JSON {proof, regions, ...}
  WRITE   c→s  arg=n, size=payload; n × (remote_addr, len), then payload
  READ    c→s  arg=n; n × (remote_addr, len)   reply ACK size=bytes, then payload
  NOTIFY  c→s  arg=name bytes; name then message (UTF-8)   reply ACK
  ACK     s→c  arg=status code, seq echoes the request
  BYE     c→s  the client disconnects
The server answers in order, so the client matches ACKs to its FIFO of pending frames by seq.
Until the handshake (link_auth.py) succeeded the server reads only small bodies
(`MAX_HANDSHAKE_BODY`) under a deadline and tells nothing but a nonce. Caps on an
authenticated peer: `MAX_NOTIFY_BODY`, `MAX_READ_BYTES` per READ, `MAX_DESCS_PER_FRAME`.
"""

from __future__ import annotations

import ctypes
import json
import socket
import struct
import time
from enum import IntEnum

from pdserve_worker.transfer.backends.host.netio import recvmsg_into_all

HEADER = struct.Struct("!B3xIQQ")  # kind, arg, seq, size
DESC = struct.Struct("!QQ")  # remote_addr, len
MAX_CONTROL_BODY = 4 << 20  # HIXL's control message limit (HIXL.md 1.5)
MAX_HANDSHAKE_BODY = 1024  # HELLO/CHALLENGE/AUTH bodies: nonces and names, nothing more
MAX_NOTIFY_BODY = 2 * 4 * 1024  # name + message, 1024 characters each, UTF-8 (<= 4 bytes each)
MAX_DESCS_PER_FRAME = 1 << 16
# One READ frame may ask for at most this many bytes back: a 40-byte request must not make
# the server send gigabytes. A client refuses bigger READ requests up front (PARAM_INVALID).
MAX_READ_BYTES = 256 << 20
# A WRITE frame's declared payload: the descriptors bound the real size (each range must lie
# in registered memory), this only stops a nonsense header from being "discarded" forever.
MAX_WRITE_BYTES = 1 << 40


class Kind(IntEnum):
    HELLO = 1
    HELLO_ACK = 2
    WRITE = 3
    READ = 4
    NOTIFY = 5
    ACK = 6
    BYE = 7
    CHALLENGE = 8
    AUTH = 9


class ProtocolError(ConnectionError):
    """The peer sent something this protocol does not allow: the link is dropped."""


def header(kind: Kind, arg: int = 0, seq: int = 0, size: int = 0) -> bytes:
    return HEADER.pack(int(kind), arg, seq, size)


def notify_frame(body: bytes, name_len: int, seq: int = 0) -> bytes:
    """A NOTIFY frame: `body` is the name's bytes followed by the message's."""
    return HEADER.pack(Kind.NOTIFY.value, name_len, seq, len(body)) + body


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


class FrameReader:
    """Buffered reads from a stream socket: a small frame (header plus body, or several ACKs)
    costs one recv instead of two or more. Payload bytes already buffered are copied into
    their destination; the rest is received straight into it (no intermediate buffer)."""

    def __init__(self, sock: socket.socket, capacity: int = 1 << 16) -> None:
        self._sock = sock
        # While set (the handshake), every recv gets only the time left until it: a peer
        # that trickles one byte at a time cannot stretch the handshake past it.
        self.deadline: float | None = None
        self._buf = bytearray(capacity)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0

    def _fill(self, need: int) -> None:
        """Make at least `need` bytes available in the buffer."""
        if need > len(self._buf):
            grown = bytearray(need)
            grown[: self._end - self._start] = self._view[self._start : self._end]
            self._buf, self._view = grown, memoryview(grown)
            self._end -= self._start
            self._start = 0
        elif self._start + need > len(self._buf):
            n = self._end - self._start
            self._view[:n] = self._view[self._start : self._end]
            self._start, self._end = 0, n
        while self._end - self._start < need:
            if self.deadline is not None:
                left = self.deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("handshake deadline passed")
                self._sock.settimeout(left)
            k = self._sock.recv_into(self._view[self._end :])
            if k == 0:
                raise ConnectionError(f"peer closed the connection after {self._end - self._start} of {need} bytes")
            self._end += k

    def read(self, n: int) -> bytes:
        self._fill(n)
        data = bytes(self._view[self._start : self._start + n])
        self._start += n
        return data

    def readinto(self, views: list[memoryview]) -> None:
        """Fill every view in order: buffered bytes first, then straight from the socket."""
        rest = []
        for view in views:
            take = min(len(view), self._end - self._start)
            if take:
                view[:take] = self._view[self._start : self._start + take]
                self._start += take
            if take < len(view):
                rest.append(view[take:])
        if rest:
            recvmsg_into_all(self._sock, rest)

    def discard(self, n: int) -> None:
        """Drop n bytes: the payload of a frame that was refused."""
        while n > 0:
            if self._end == self._start:
                self._start = self._end = 0
                self._fill(1)
            take = min(n, self._end - self._start)
            self._start += take
            n -= take

    def header(self) -> tuple[Kind, int, int, int]:
        kind, arg, seq, size = HEADER.unpack(self.read(HEADER.size))
        try:
            return Kind(kind), arg, seq, size
        except ValueError:
            raise ProtocolError(f"unknown frame kind {kind}") from None

    def json(self, size: int, limit: int = MAX_CONTROL_BODY) -> dict[str, object]:
        """A JSON object body of `size` bytes; ProtocolError past `limit` (checked before any read)."""
        if size > limit:
            raise ProtocolError(f"control body of {size} bytes exceeds {limit}")
        try:
            body = json.loads(self.read(size))
        except (ValueError, RecursionError) as exc:  # (UnicodeDecodeError is a ValueError)
            raise ProtocolError(f"control body is not JSON: {type(exc).__name__}") from None
        if not isinstance(body, dict):
            raise ProtocolError(f"control body must be a JSON object, got {type(body).__name__}")
        return body
