"""The host engine's links to remote engines: connect, disconnect, and the async connect queue.

One `Link` (link.py) per remote engine. A concurrent connect to the same remote keeps the
first link and closes the other (ALREADY_CONNECTED). `connect_async` and `disconnect_async`
run on one worker thread, FIFO for all remotes, at most CONNECT_QUEUE_CAPACITY queued (HIXL's
connect_pool.task_queue_capacity). Calls take the engine's lock, shared with its other tables.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from pdserve_common.logs import kv
from pdserve_worker.transfer import hixl_api as api
from pdserve_worker.transfer.backends.host import link_auth
from pdserve_worker.transfer.backends.host.link import Link, LinkOptions
from pdserve_worker.transfer.backends.host.netio import parse_engine_id

log = logging.getLogger(__name__)

CONNECT_QUEUE_CAPACITY = 128  # HIXL's connect_pool.task_queue_capacity default


class LinkTable:
    """Open links by remote engine id, and the async connect queue's state."""

    def __init__(self, lock: threading.RLock) -> None:
        self._lock = lock
        self._links: dict[str, Link] = {}
        self._connector: ThreadPoolExecutor | None = None
        self._connect_status: dict[str, api.AsyncConnectStatus] = {}
        self._connect_queued = 0

    def get(self, remote_engine: str) -> Link | None:
        """The link to `remote_engine` as it is now (closed or not), None if never linked."""
        with self._lock:
            return self._links.get(remote_engine)

    def connect(self, local_engine: str, remote_engine: str, timeout_in_millis: int, options: LinkOptions) -> int:
        with self._lock:  # the common case first: every push checks its targets are linked
            link = self._links.get(remote_engine)
            if link is not None and not link.closed:
                return api.ALREADY_CONNECTED
        try:
            host, port = parse_engine_id(remote_engine)
        except ValueError as exc:
            log.error(kv(event="connect_rejected", remote=remote_engine, error=exc))
            return api.PARAM_INVALID
        if port <= 0:
            return api.PARAM_INVALID
        try:
            new = Link.open(local_engine, remote_engine, host, port, timeout_in_millis / 1000.0, options)
        except link_auth.AuthError as exc:
            log.warning(kv(event="connect_unauthenticated", remote=remote_engine, error=exc))
            return api.FAILED
        except TimeoutError as exc:
            log.warning(kv(event="connect_timeout", remote=remote_engine, timeout_ms=timeout_in_millis, error=exc))
            return api.TIMEOUT
        except OSError as exc:
            log.warning(kv(event="connect_failed", remote=remote_engine, error=exc))
            return api.FAILED
        return self._keep(remote_engine, new)

    def _keep(self, remote_engine: str, new: Link) -> int:
        stale: Link | None
        with self._lock:
            old = self._links.get(remote_engine)
            if old is not None and not old.closed:  # a concurrent connect won
                stale = new
            else:
                stale, self._links[remote_engine] = old, new
        if stale is not None:
            stale.close(timeout_s=1.0)
            if stale is new:
                return api.ALREADY_CONNECTED
        return api.SUCCESS

    def disconnect(self, local_engine: str, remote_engine: str, timeout_in_millis: int) -> int:
        with self._lock:
            link = self._links.pop(remote_engine, None)
        if link is None:
            return api.NOT_CONNECTED
        link.close(timeout_s=max(timeout_in_millis, 1) / 1000.0)
        log.info(kv(event="disconnected", local=local_engine, remote=remote_engine))
        return api.SUCCESS

    def queue(
        self,
        remote_engine: str,
        timeout_ms: int,
        connect: Callable[[str, int], int] | None,
        disconnect: Callable[[str, int], int],
    ) -> int:
        """Run `connect(remote, timeout_ms)` (or, when None, `disconnect`) on the connect thread."""
        S = api.AsyncConnectStatus
        with self._lock:
            if self._connect_queued >= CONNECT_QUEUE_CAPACITY:
                return api.RESOURCE_EXHAUSTED
            if self._connector is None:
                self._connector = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hixl-connect")
            self._connect_queued += 1
            self._connect_status[remote_engine] = S.CONNECT_PENDING if connect else S.DISCONNECT_PENDING
            connector = self._connector

        def task() -> None:
            try:
                with self._lock:
                    self._connect_status[remote_engine] = S.CONNECTING if connect else S.DISCONNECTING
                if connect:
                    ok = connect(remote_engine, timeout_ms) in (api.SUCCESS, api.ALREADY_CONNECTED)
                    result = S.CONNECTED if ok else S.CONNECT_FAILED
                else:
                    disconnect(remote_engine, timeout_ms)
                    result = S.NOT_CONNECT
                with self._lock:
                    self._connect_status[remote_engine] = result
            finally:
                with self._lock:
                    self._connect_queued -= 1

        connector.submit(task)
        return api.SUCCESS

    def async_status(self, remote: str) -> api.AsyncConnectStatus:
        with self._lock:
            status = self._connect_status.get(remote)
            if status is not None:
                return status
            link = self._links.get(remote)
            connected = link is not None and not link.closed
            return api.AsyncConnectStatus.CONNECTED if connected else api.AsyncConnectStatus.NOT_CONNECT

    def all_async_status(self) -> dict[str, api.AsyncConnectStatus]:
        with self._lock:
            names = set(self._connect_status) | set(self._links)
            return {name: self.async_status(name) for name in names}

    def detach(self) -> tuple[list[Link], ThreadPoolExecutor | None]:
        """At finalize (lock held): every link and the connect thread, for the caller to close."""
        links, self._links = list(self._links.values()), {}
        connector, self._connector = self._connector, None
        return links, connector

    def path(self, remote_engine: str) -> str | None:
        """'shm' when we map some of the remote's memory, 'tcp' otherwise; None if unlinked."""
        link = self.get(remote_engine)
        if link is None or link.closed:
            return None
        return "shm" if any(link.shares(r) for r in link.remote.snapshot()) else "tcp"
