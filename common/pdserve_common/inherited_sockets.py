"""Listening sockets a parent bound and handed down (`pdserve local`): no port race.

`pdserve local` starts a dozen processes that must know each other's ports before they run
(a decode group's members, the router's port, the broker's). A port found free and then
released is only free until someone else binds it; under load a worker then failed to bind.
So the parent binds every port itself, keeps the socket for the deployment's life, and passes
it to the child that serves it (`subprocess.Popen(pass_fds=...)`), naming it in
`PDSERVE_LISTEN_FDS` (`port=fd,port=fd`). A listener about to bind (host, port) takes the
inherited socket for that port instead (`take`). This is systemd's socket activation, minus
systemd: the kernel holds the port from the parent's bind on, and a restarted child picks up
the same socket (connections that arrive meanwhile wait in its backlog instead of being
refused). The parent binds without listening, so nothing connects before a child listens.
"""

from __future__ import annotations

import os
import socket
import threading

LISTEN_FDS_ENV = "PDSERVE_LISTEN_FDS"

_lock = threading.Lock()
_taken: set[int] = set()


def parse(raw: str) -> dict[int, int]:
    """`port=fd,...` → {port: fd}; ValueError naming the entry that is not one."""
    out: dict[int, int] = {}
    for entry in filter(None, (e.strip() for e in raw.split(","))):
        port, sep, fd = entry.partition("=")
        if not sep or not port.isdigit() or not fd.isdigit():
            raise ValueError(f"{LISTEN_FDS_ENV}: {entry!r} is not port=fd")
        out[int(port)] = int(fd)
    return out


def take(port: int, env: dict[str, str] | None = None) -> socket.socket | None:
    """The socket handed down for `port`, once (a second listener of the port binds as usual);
    None when there is none. ValueError when the fd is not a TCP socket bound to that port."""
    fds = parse((os.environ if env is None else env).get(LISTEN_FDS_ENV, ""))
    fd = fds.get(port)
    if fd is None or port == 0:
        return None
    with _lock:
        if fd in _taken:
            return None
        _taken.add(fd)
    sock = socket.socket(fileno=fd)
    bound = sock.getsockname()[1] if sock.type == socket.SOCK_STREAM else None
    if bound != port:
        raise ValueError(f"{LISTEN_FDS_ENV}: fd {fd} is not a TCP socket bound to port {port} (bound: {bound})")
    return sock


def bind_for_child(host: str, port: int = 0) -> socket.socket:
    """A TCP socket bound to `port` of `host` (0: a free one), not listening, inheritable: for
    `pass_fds`. OSError when the port is taken. Made with IPPROTO_TCP, so asyncio sets
    TCP_NODELAY on what the child accepts from it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def env_value(sockets: list[socket.socket]) -> str:
    return ",".join(f"{s.getsockname()[1]}={s.fileno()}" for s in sockets)
