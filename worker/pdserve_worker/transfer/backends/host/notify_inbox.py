"""Where a server's received notifies wait to be drained, and how a waiter sleeps on them.

The path from a prefill's `send_notify` to the waiting decode thread is one wake-up where it
can be:
- Same host (network namespace): one datagram to this inbox's abstract Unix socket; the waiter
  sleeps in `poll` on it. An accepted datagram is queued (as good as HIXL's ACK); when the
  kernel queue is full the client falls back to TCP.
- Over TCP: the link's server thread appends the NOTIFY to a bounded deque and rings the same
  socket with an empty datagram.
With `check_sender` (the engine has a link key) each datagram carries its sender's credentials
(SO_PASSCRED) and one from another user is dropped and counted. What a notify says is checked
above the engine (readiness.py: the reservation's capability).
The bound: `capacity` notifies in the deque (past it a TCP notify is RESOURCE_EXHAUSTED) plus
the kernel's datagram queue; `drain` moves at most that many, so it always returns.
"""

from __future__ import annotations

import collections
import logging
import os
import secrets
import select
import socket
import struct
import threading
import time

from pdserve_worker.transfer import hixl_api as api
from pdserve_worker.transfer.backends.host import wire
from pdserve_worker.util.drops import DropCounter

log = logging.getLogger(__name__)

MAX_DATAGRAM = wire.HEADER.size + 8 * api.MAX_NOTIFY_FIELD + 64  # two UTF-8 fields, generously
UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid
CRED_SPACE = socket.CMSG_SPACE(UCRED.size)


def abstract(name: str) -> str:
    """The socket address of an abstract-namespace name (Python spells it with a leading NUL)."""
    return "\0" + name


class NotifyInbox:
    def __init__(self, capacity: int, check_sender: bool = False) -> None:
        self.capacity = capacity
        self.name = f"pdserve-hixl-notify-{os.getpid()}-{secrets.token_hex(6)}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._check_sender = check_sender
        if check_sender:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self._sock.bind(abstract(self.name))
        self._uid = os.getuid()
        self._pull_max = capacity + _kernel_queue_length()  # per drain: all that can be queued now
        self.drops = DropCounter(log, "notify_datagrams_dropped", inbox=self.name)
        self._bell = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._bell.connect(abstract(self.name))
        self._items: collections.deque[api.NotifyDesc] = collections.deque()
        self._lock = threading.Lock()
        self._closed = False

    # ---- filling ---------------------------------------------------------------------------------
    def put(self, item: api.NotifyDesc) -> bool:
        """A notify that came over TCP. False when full: the sender gets RESOURCE_EXHAUSTED."""
        with self._lock:
            if len(self._items) >= self.capacity:
                return False
            self._items.append(item)
        try:
            self._bell.send(b"", socket.MSG_DONTWAIT)
        except OSError:
            pass  # the socket already holds datagrams: the waiter wakes for those anyway
        return True

    # ---- draining --------------------------------------------------------------------------------
    def drain(self) -> list[api.NotifyDesc]:
        """Everything received so far, oldest first; never blocks."""
        self._pull_datagrams()
        with self._lock:
            items = list(self._items)
            self._items.clear()
        return items

    def wait_drain(self, timeout_s: float) -> list[api.NotifyDesc]:
        """Block (in poll, no CPU) until something arrives or timeout_s passes, then drain."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        poller = select.poll()
        poller.register(self._sock, select.POLLIN)
        while True:
            items = self.drain()
            remaining = deadline - time.monotonic()
            if items or remaining <= 0 or self._closed:
                return items
            try:
                poller.poll(remaining * 1000.0)
            except OSError:
                return []  # closed under us

    def _pull_datagrams(self) -> None:
        for _ in range(self._pull_max):
            try:
                if self._check_sender:
                    data, ancdata, _, _ = self._sock.recvmsg(MAX_DATAGRAM, CRED_SPACE, socket.MSG_DONTWAIT)
                else:
                    data, ancdata = self._sock.recv(MAX_DATAGRAM, socket.MSG_DONTWAIT), []
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # closed
            if self._check_sender and _sender_uid(ancdata) != self._uid:
                self.drops.count("other_user")
                continue
            if not data:
                continue  # a doorbell: the deque has something
            item = _parse(data)
            if item is None:
                self.drops.count("malformed", bytes=len(data))
                continue
            with self._lock:
                self._items.append(item)

    def close(self) -> None:
        self._closed = True
        try:
            self._bell.send(b"", socket.MSG_DONTWAIT)  # wake a waiter so it sees `closed`
        except OSError:
            pass
        self._bell.close()
        self._sock.close()

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


def _kernel_queue_length() -> int:
    """How many datagrams the kernel queues on a Unix socket (net.unix.max_dgram_qlen)."""
    try:
        with open("/proc/sys/net/unix/max_dgram_qlen", encoding="ascii") as f:
            return max(1, int(f.read()))
    except (OSError, ValueError):
        return 512


def _sender_uid(ancdata: list[tuple[int, int, bytes]]) -> int | None:
    """The uid the kernel attached to a datagram (SCM_CREDENTIALS), None if there is none."""
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(payload) >= UCRED.size:
            return int(UCRED.unpack_from(payload)[1])
    return None


def _parse(data: bytes) -> api.NotifyDesc | None:
    """A NOTIFY frame in one datagram → NotifyDesc, or None if it is not a valid one."""
    if len(data) < wire.HEADER.size:
        return None
    kind, name_len, _, size = wire.HEADER.unpack_from(data)
    body = data[wire.HEADER.size :]
    if kind != wire.Kind.NOTIFY or size != len(body) or name_len > size:
        return None
    try:
        name, msg = body[:name_len].decode(), body[name_len:].decode()
    except UnicodeDecodeError:
        return None
    if len(name) > api.MAX_NOTIFY_FIELD or len(msg) > api.MAX_NOTIFY_FIELD:
        return None
    return api.NotifyDesc(name, msg)
