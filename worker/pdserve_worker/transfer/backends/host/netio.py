"""Scatter/gather socket I/O over raw memory views, and engine-id parsing.

`sendmsg`/`recvmsg_into` move many registered ranges per system call (one per frame instead
of one per descriptor); both may stop part way, so these loops resume from where they were.
"""

from __future__ import annotations

import socket

IOV_MAX = 1024  # Linux's limit on buffers per sendmsg/recvmsg call


def sendmsg_all(sock: socket.socket, views: list[memoryview]) -> None:
    pending = [v for v in views if len(v)]
    while pending:
        batch = pending[:IOV_MAX]
        sent = sock.sendmsg(batch)
        pending = _advance(pending, sent)


def recvmsg_into_all(sock: socket.socket, views: list[memoryview]) -> None:
    pending = [v for v in views if len(v)]
    while pending:
        got, _, _, _ = sock.recvmsg_into(pending[:IOV_MAX])
        if got == 0:
            raise ConnectionError("peer closed the connection in the middle of a payload")
        pending = _advance(pending, got)


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    """Drop the first n bytes from a list of views."""
    i = 0
    while i < len(views) and n >= len(views[i]):
        n -= len(views[i])
        i += 1
    rest = views[i:]
    if rest and n:
        rest[0] = rest[0][n:]
    return rest


def parse_engine_id(engine_id: str) -> tuple[str, int]:
    """`"ip:port"`, `"ip"` or `"[v6]:port"` → (host, port); port 0 when absent (client only)."""
    text = engine_id.strip()
    if not text:
        raise ValueError("engine id is empty")
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep:
            raise ValueError(f"engine id {engine_id!r}: unterminated [ipv6]")
        if not rest:
            return host, 0
        if not rest.startswith(":"):
            raise ValueError(f"engine id {engine_id!r}: expected ':port' after ']'")
        port_text = rest[1:]
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    elif ":" in text:
        return text, 0  # a bare IPv6 address
    else:
        return text, 0
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"engine id {engine_id!r}: port {port_text!r} is not an integer") from None
    if port > 65535:
        raise ValueError(f"engine id {engine_id!r}: port {port} out of range")
    return host, max(port, 0)  # HIXL: port <= 0 means a client that does not listen
