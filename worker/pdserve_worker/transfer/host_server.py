"""The server half of the host engine: accepts links, writes/reads registered memory, queues notifies.

One thread accepts; one thread serves each connected client, answering its frames in order
(wire.py). At HELLO the client gets the regions registered *at that moment* and that snapshot
is all the link may ever touch: HIXL's "memory registered after a link exists is not reachable
over it". Every range is checked again here before a byte is written, because the client's
check ran against what it was told, and the region may since have been deregistered.
"""

from __future__ import annotations

import collections
import logging
import socket
import threading
import time
from collections.abc import Callable

from pdserve_worker.logs import kv
from pdserve_worker.transfer import hixl_api as api
from pdserve_worker.transfer import wire
from pdserve_worker.transfer.netio import recvmsg_into_all, sendmsg_all
from pdserve_worker.transfer.regions import Region, RegionTable

log = logging.getLogger("pdserve.transfer.host_server")


class NotifyQueue:
    """Bounded FIFO of received notifies; `wait_drain` blocks on a condition (no polling)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: collections.deque[api.NotifyDesc] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False

    def put(self, item: api.NotifyDesc) -> bool:
        """False when full: the sender gets RESOURCE_EXHAUSTED and may retry."""
        with self._cond:
            if len(self._items) >= self.capacity:
                return False
            self._items.append(item)
            self._cond.notify_all()
            return True

    def drain(self) -> list[api.NotifyDesc]:
        with self._cond:
            items = list(self._items)
            self._items.clear()
            return items

    def wait_drain(self, timeout_s: float) -> list[api.NotifyDesc]:
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._cond:
            while not self._items and not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            items = list(self._items)
            self._items.clear()
            return items

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)


class HostServer:
    """Listens on (host, port); serves each client link on its own thread."""

    def __init__(
        self,
        host: str,
        port: int,
        engine_id: str,
        regions: RegionTable,
        notifies: NotifyQueue,
        hello_extra: Callable[[], dict[str, object]],
    ) -> None:
        self.engine_id = engine_id
        self._regions = regions
        self._notifies = notifies
        self._hello_extra = hello_extra
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, port))
        self._listener.listen(128)
        self._conns: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._stopping = False
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"hixl-accept-{port}", daemon=True)

    def start(self) -> None:
        self._acceptor.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        with self._lock:
            self._stopping = True
            conns = list(self._conns)
        for sock in [self._listener, *conns]:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in accept/recv
            except OSError:
                pass
        self._listener.close()
        deadline = time.monotonic() + timeout_s
        for t in [self._acceptor, *self._threads]:
            t.join(max(0.0, deadline - time.monotonic()))

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return  # listener shut down
            with self._lock:
                if self._stopping:
                    conn.close()
                    return
                self._conns.add(conn)
                t = threading.Thread(target=self._serve, args=(conn, peer), name=f"hixl-serve-{peer}", daemon=True)
                self._threads = [x for x in self._threads if x.is_alive()] + [t]
            t.start()

    def _serve(self, conn: socket.socket, peer: object) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        client = "?"
        try:
            kind, _, seq, size = wire.recv_header(conn)
            if kind is not wire.Kind.HELLO:
                raise wire.ProtocolError(f"first frame must be HELLO, got {kind.name}")
            hello = wire.recv_json(conn, size)
            client = str(hello.get("client", "?"))
            snapshot = self._regions.snapshot()
            allowed = RegionTable(snapshot)
            reply = {"server": self.engine_id, "regions": [r.to_wire() for r in snapshot], **self._hello_extra()}
            conn.sendall(wire.json_frame(wire.Kind.HELLO_ACK, reply, seq=seq))
            log.info(kv(event="link_accepted", server=self.engine_id, client=client, regions=len(snapshot)))
            while self._handle_frame(conn, allowed):
                pass
        except (ConnectionError, OSError) as exc:
            if not self._stopping:
                log.info(kv(event="link_closed", server=self.engine_id, client=client, reason=exc))
        except Exception as exc:  # a bug or a hostile peer: drop this link, keep serving others
            log.error(kv(event="link_failed", server=self.engine_id, client=client, error=repr(exc)))
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _handle_frame(self, conn: socket.socket, allowed: RegionTable) -> bool:
        """Serve one frame; False when the client said BYE."""
        kind, arg, seq, size = wire.recv_header(conn)
        if kind is wire.Kind.BYE:
            return False
        if kind is wire.Kind.NOTIFY:
            body = wire.recv_json(conn, size)
            status = self._accept_notify(body)
            conn.sendall(wire.header(wire.Kind.ACK, status, seq))
            return True
        if kind not in (wire.Kind.WRITE, wire.Kind.READ):
            raise wire.ProtocolError(f"unexpected frame {kind.name} from a client")
        if arg > wire.MAX_DESCS_PER_FRAME:
            raise wire.ProtocolError(f"{arg} descriptors in one frame exceed {wire.MAX_DESCS_PER_FRAME}")
        descs = wire.unpack_descs(wire.recv_exact(conn, arg * wire.DESC.size))
        bad = self._first_invalid(descs, allowed)
        if kind is wire.Kind.WRITE:
            if bad is not None:
                wire.discard(conn, size)
                log.warning(kv(event="write_refused", server=self.engine_id, addr=hex(bad[0]), len=bad[1]))
                conn.sendall(wire.header(wire.Kind.ACK, api.PARAM_INVALID, seq))
                return True
            if sum(length for _, length in descs) != size:
                raise wire.ProtocolError(f"WRITE payload {size} does not match its descriptors")
            recvmsg_into_all(conn, [wire.memory(addr, length) for addr, length in descs])
            conn.sendall(wire.header(wire.Kind.ACK, api.SUCCESS, seq))
            return True
        # READ
        if bad is not None:
            conn.sendall(wire.header(wire.Kind.ACK, api.PARAM_INVALID, seq))
            return True
        total = sum(length for _, length in descs)
        conn.sendall(wire.header(wire.Kind.ACK, api.SUCCESS, seq, total))
        sendmsg_all(conn, [wire.memory(addr, length) for addr, length in descs])
        return True

    def _first_invalid(self, descs: list[tuple[int, int]], allowed: RegionTable) -> tuple[int, int] | None:
        for addr, length in descs:
            region: Region | None = allowed.find(addr, length)
            if region is None or length <= 0 or region not in self._regions:
                return addr, length
        return None

    def _accept_notify(self, body: dict[str, object]) -> int:
        name, msg = body.get("name"), body.get("msg")
        if not isinstance(name, str) or not isinstance(msg, str):
            return api.PARAM_INVALID
        if len(name) > api.MAX_NOTIFY_FIELD or len(msg) > api.MAX_NOTIFY_FIELD:
            return api.PARAM_INVALID
        if not self._notifies.put(api.NotifyDesc(name, msg)):
            log.warning(kv(event="notify_queue_full", server=self.engine_id, capacity=self._notifies.capacity))
            return api.RESOURCE_EXHAUSTED
        return api.SUCCESS
