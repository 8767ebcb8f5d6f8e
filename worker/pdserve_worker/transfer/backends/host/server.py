"""The server half of the host engine: accepts links, writes/reads registered memory, takes notifies.

One thread accepts; one serves each client, answering its frames in order (wire.py). At HELLO
the client gets the regions registered at that moment, all the link may ever touch (HIXL's
rule); every range is checked again here before a byte is written. What a peer may do is
`ServerPolicy` (the threat: anyone who can reach the port):
- With a key, the challenge-response of link_auth.py comes first; until then the server reads
  only small bodies under `handshake_timeout_s`, sizes no buffer from the peer and tells it
  nothing but a nonce. Regions (and, to a client on this host, shm names and the inbox) after.
- At most `max_links` links and `max_pending` handshakes; a newcomer cuts the oldest pending
  handshake when all are taken, and is closed at accept when every link is admitted or its
  address already holds `max_pending_per_peer` handshakes. A failed accept is retried later.
- `remote_write="leased"`: a WRITE lands only in leased ranges (leases.py); `remote_read=False`:
  every READ is PARAM_INVALID. Refusals are counted (`stats()`). Real HIXL has none of this.
"""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve_common import inherited_sockets
from pdserve_common.logs import kv
from pdserve_worker.transfer import hixl_api as api
from pdserve_worker.transfer.backends.host import link_auth, wire
from pdserve_worker.transfer.backends.host.netio import sendmsg_all
from pdserve_worker.transfer.backends.host.notify_inbox import NotifyInbox
from pdserve_worker.transfer.backends.host.regions import Region, RegionTable
from pdserve_worker.transfer.copy_counts import CopyCounts
from pdserve_worker.transfer.leases import LeaseTable
from pdserve_worker.util.drops import DropCounter

log = logging.getLogger(__name__)

MAX_CLIENT_NAME = 256
ACCEPT_RETRY_S = 0.1  # after a failed accept (EMFILE, ENFILE, ENOBUFS, ENOMEM): the cause lasts a while


@dataclass(frozen=True)
class ServerPolicy:
    """What the server admits. The defaults are HIXL's behaviour (no authentication, any
    registered range readable and writable); a pdserve worker sets all of it."""

    key: bytes | None = None
    remote_write: str = "registered"  # "registered" | "leased"
    remote_read: bool = True
    max_links: int = 256
    max_pending: int = 32
    max_pending_per_peer: int = 8  # handshakes one source address may hold at once
    handshake_timeout_s: float = 5.0

    def __repr__(self) -> str:  # never print the key
        return (
            f"ServerPolicy(auth={self.key is not None}, remote_write={self.remote_write}, "
            f"remote_read={self.remote_read}, max_links={self.max_links}, max_pending={self.max_pending}, "
            f"handshake_timeout_s={self.handshake_timeout_s})"
        )


@dataclass(frozen=True)
class Served:
    """What a server serves, shared with its engine: the registered regions, the notify inbox,
    what only a client on this host is told (the inbox's name), the write leases, the copy counts."""

    regions: RegionTable
    notifies: NotifyInbox
    local_info: Callable[[], dict[str, object]]
    leases: LeaseTable = field(default_factory=LeaseTable)
    copies: CopyCounts = field(default_factory=CopyCounts)


class HostServer:
    """Listens on (host, port); serves each client link on its own thread."""

    def __init__(
        self, host: str, port: int, engine_id: str, served: Served, policy: ServerPolicy | None = None
    ) -> None:
        self.engine_id = engine_id
        self.copies = served.copies
        self.policy = policy or ServerPolicy()
        self._regions = served.regions
        self._notifies = served.notifies
        self._local_info = served.local_info
        self._leases = served.leases
        self.drops = DropCounter(log, "kv_link_refusals", server=engine_id)
        self._listener = inherited_sockets.take(port) or _bound(host, port)  # (handed down by `pdserve local`)
        self._listener.listen(128)
        self._listener.setblocking(False)  # accepted when the selector says so (`_accept_loop`)
        # stop() wakes the acceptor through this pair, never by shutting the listener down: an
        # inherited listener is the launcher's too, and a shut-down one stays dead for the
        # restarted process that gets it next (#58 A6).
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._conns: set[socket.socket] = set()
        # Connections still in the handshake, oldest first, with their source address.
        self._pending: dict[socket.socket, str] = {}
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._stopping = False
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"hixl-accept-{port}", daemon=True)

    def start(self) -> None:
        self._acceptor.start()

    def stop(self, timeout_s: float = 2.0) -> bool:
        """Close the listener and every link, join the threads. True when all of them ended
        (so no server thread can touch registered memory any more)."""
        with self._lock:
            self._stopping = True
            conns = list(self._conns)
        self._wake_w.send(b"x")  # wakes the acceptor
        for sock in conns:  # (the links are this process's own: shutting them down wakes their recv)
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        if self._acceptor.is_alive():
            self._acceptor.join(timeout_s)
        self._selector.close()
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()  # closed, never shut down: the launcher's copy of the listener stays whole
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in [self._acceptor, *self._threads])

    def stats(self) -> dict[str, int]:
        """Refusals by reason, plus the links open now."""
        with self._lock:
            links, pending = len(self._conns), len(self._pending)
        return {**self.drops.totals(), "links_open": links - pending, "handshakes_pending": pending}

    def _accept_loop(self) -> None:
        while True:
            try:
                ready = {key.fileobj for key, _ in self._selector.select()}
            except (OSError, ValueError):  # the selector was closed
                return
            if self._wake_r in ready:  # stop()
                return
            try:
                conn, peer = self._listener.accept()
                conn.setblocking(True)
            except BlockingIOError:  # the connection went before it was accepted
                continue
            except OSError as exc:
                if self._stopping or exc.errno in (errno.EBADF, errno.EINVAL):
                    return  # the listener was closed
                self.drops.count("accept_failed", error=errno.errorcode.get(exc.errno or 0, exc.errno))
                time.sleep(ACCEPT_RETRY_S)
                continue
            evicted: socket.socket | None = None
            host = str(peer[0]) if isinstance(peer, tuple) and peer else str(peer)
            with self._lock:
                if self._stopping:
                    conn.close()
                    return
                if sum(1 for h in self._pending.values() if h == host) >= self.policy.max_pending_per_peer:
                    # One address may not hold (or, by evicting, churn) every handshake place:
                    # the newcomer goes, the other peers' handshakes stay.
                    conn.close()
                    self.drops.count("peer_handshake_cap", peer=host)
                    continue
                pending_full = len(self._pending) >= self.policy.max_pending
                links_full = len(self._conns) >= self.policy.max_links
                if (pending_full or links_full) and self._pending:
                    evicted = next(iter(self._pending))  # the oldest handshake makes room
                    del self._pending[evicted]
                    links_full = False
                if not links_full:
                    self._conns.add(conn)
                    self._pending[conn] = host
                    t = threading.Thread(target=self._serve, args=(conn, peer), name=f"hixl-serve-{peer}", daemon=True)
                    self._threads = [x for x in self._threads if x.is_alive()] + [t]
            if evicted is not None:
                self.drops.count("handshake_evicted", peer=peer)
                try:
                    evicted.shutdown(socket.SHUT_RDWR)  # its thread wakes, fails its handshake, cleans up
                except OSError:
                    pass
            if links_full:
                conn.close()
                self.drops.count("link_cap", peer=peer)
                continue
            t.start()

    def _serve(self, conn: socket.socket, peer: object) -> None:
        client = "?"
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # (inside: the finally must run)
            reader = wire.FrameReader(conn)
            reader.deadline = time.monotonic() + self.policy.handshake_timeout_s
            try:
                client, snapshot = self._handshake(conn, reader)
            except TimeoutError:
                self.drops.count("handshake_timeout", peer=peer)
                return
            except link_auth.AuthError:
                self.drops.count("auth_failed", peer=peer)
                return
            except (ConnectionError, OSError):  # ProtocolError included
                if not self._stopping and conn in self._pending:  # (an evicted one was counted)
                    self.drops.count("handshake_invalid", peer=peer)
                return
            finally:
                with self._lock:
                    self._pending.pop(conn, None)
            reader.deadline = None
            conn.settimeout(None)
            allowed = RegionTable(snapshot)  # exactly what the client was told, nothing registered later
            log.info(
                kv(
                    event="link_accepted",
                    server=self.engine_id,
                    client=client,
                    regions=len(allowed),
                    auth=self.policy.key is not None,
                )
            )
            while self._handle_frame(conn, reader, allowed):
                pass
        except (ConnectionError, OSError) as exc:
            if not self._stopping:
                log.info(kv(event="link_closed", server=self.engine_id, client=client, reason=exc))
        except Exception as exc:  # a bug or a hostile peer: drop this link, keep serving others
            log.error(kv(event="link_failed", server=self.engine_id, client=client, error=repr(exc)))
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._pending.pop(conn, None)
            conn.close()

    # ---- the handshake -----------------------------------------------------------------------------
    def _handshake(self, conn: socket.socket, reader: wire.FrameReader) -> tuple[str, list[Region]]:
        """HELLO → CHALLENGE → AUTH → HELLO_ACK. Returns the client's name and the regions it
        was told of; raises AuthError, ProtocolError or socket.timeout. Nothing but a nonce is
        sent before the proof checks."""
        key = self.policy.key
        kind, _, seq, size = reader.header()
        if kind is not wire.Kind.HELLO:
            raise wire.ProtocolError(f"first frame must be HELLO, got {kind.name}")
        client_nonce = link_auth.parse_nonce(reader.json(size, wire.MAX_HANDSHAKE_BODY).get("nonce"))
        server_nonce = link_auth.new_nonce()
        conn.sendall(
            wire.json_frame(wire.Kind.CHALLENGE, {"auth": key is not None, "nonce": server_nonce.hex()}, seq=seq)
        )
        kind, _, seq, size = reader.header()
        if kind is not wire.Kind.AUTH:
            raise wire.ProtocolError(f"expected AUTH, got {kind.name}")
        auth = reader.json(size, wire.MAX_HANDSHAKE_BODY)
        client, host = str(auth.get("client", ""))[:MAX_CLIENT_NAME], str(auth.get("host", ""))
        reply: dict[str, object] = {}
        if key is not None:
            expected = link_auth.client_proof(key, client_nonce, server_nonce, client, host)
            if not link_auth.proofs_equal(expected, auth.get("proof")):
                raise link_auth.AuthError(f"client {client!r} sent a wrong proof")
            reply["proof"] = link_auth.server_proof(key, client_nonce, server_nonce)
        same_host = host == link_auth.host_tag()
        snapshot = self._regions.snapshot()
        reply["regions"] = [_region_for_peer(r, same_host) for r in snapshot]
        if same_host:
            reply["host"] = host
            reply.update(self._local_info())
        conn.sendall(wire.json_frame(wire.Kind.HELLO_ACK, reply, seq=seq))
        return client or "?", snapshot

    # ---- frames of an admitted link ----------------------------------------------------------------
    def _handle_frame(self, conn: socket.socket, reader: wire.FrameReader, allowed: RegionTable) -> bool:
        """Serve one frame; False when the client said BYE."""
        kind, arg, seq, size = reader.header()
        if kind is wire.Kind.BYE:
            return False
        if kind is wire.Kind.NOTIFY:
            if size > wire.MAX_NOTIFY_BODY or arg > size:
                raise wire.ProtocolError(f"NOTIFY of {size} bytes with a {arg}-byte name")
            body = reader.read(size)
            try:
                name, msg = body[:arg].decode(), body[arg:].decode()
            except UnicodeDecodeError:
                status = api.PARAM_INVALID
            else:
                status = self._accept_notify(name, msg)
            conn.sendall(wire.header(wire.Kind.ACK, status, seq))
            return True
        if kind not in (wire.Kind.WRITE, wire.Kind.READ):
            raise wire.ProtocolError(f"unexpected frame {kind.name} from a client")
        if arg > wire.MAX_DESCS_PER_FRAME:
            raise wire.ProtocolError(f"{arg} descriptors in one frame exceed {wire.MAX_DESCS_PER_FRAME}")
        if kind is wire.Kind.WRITE and size > wire.MAX_WRITE_BYTES:
            raise wire.ProtocolError(f"WRITE frame declares {size} payload bytes, over {wire.MAX_WRITE_BYTES}")
        descs = wire.unpack_descs(reader.read(arg * wire.DESC.size))
        refusal = self._refusal(kind, descs, allowed)
        if kind is wire.Kind.WRITE:
            if refusal is not None:
                reader.discard(size)
                self.drops.count(refusal, server_frame="WRITE")
                conn.sendall(wire.header(wire.Kind.ACK, api.PARAM_INVALID, seq))
                return True
            if sum(length for _, length in descs) != size:
                raise wire.ProtocolError(f"WRITE payload {size} does not match its descriptors")
            reader.readinto([wire.memory(addr, length) for addr, length in descs])
            self.copies.add("socket_recv", size)
            conn.sendall(wire.header(wire.Kind.ACK, api.SUCCESS, seq))
            return True
        # READ
        if refusal is not None:
            self.drops.count(refusal, server_frame="READ")
            conn.sendall(wire.header(wire.Kind.ACK, api.PARAM_INVALID, seq))
            return True
        total = sum(length for _, length in descs)
        conn.sendall(wire.header(wire.Kind.ACK, api.SUCCESS, seq, total))
        sendmsg_all(conn, [wire.memory(addr, length) for addr, length in descs])
        return True

    def _refusal(self, kind: wire.Kind, descs: list[tuple[int, int]], allowed: RegionTable) -> str | None:
        """Why this frame may not touch memory (a counter's reason), or None when it may."""
        if kind is wire.Kind.READ:
            if not self.policy.remote_read:
                return "read_disabled"
            if sum(length for _, length in descs) > wire.MAX_READ_BYTES:
                return "read_too_big"
        for addr, length in descs:
            region: Region | None = allowed.find(addr, length)
            if region is None or length <= 0 or region not in self._regions:
                return "range_not_registered"
        if kind is wire.Kind.WRITE and self.policy.remote_write == "leased":
            for addr, length in descs:
                if not self._leases.covers(addr, length):
                    return "write_not_leased"
        return None

    def _accept_notify(self, name: str, msg: str) -> int:
        if len(name) > api.MAX_NOTIFY_FIELD or len(msg) > api.MAX_NOTIFY_FIELD:
            return api.PARAM_INVALID
        if not self._notifies.put(api.NotifyDesc(name, msg)):
            self.drops.count("notify_queue_full", capacity=self._notifies.capacity)
            return api.RESOURCE_EXHAUSTED
        return api.SUCCESS


def _region_for_peer(region: Region, same_host: bool) -> dict[str, object]:
    """A region as a peer sees it: where and how big; the shared-memory segment behind it only
    for a peer on this host (one that could map it), never for a remote one."""
    data = region.to_wire()
    del data["local_only"]
    if not same_host:
        data.update(shm_name="", shm_offset=0, shm_size=0)
    return data


def _bound(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock
