"""What a worker or router uses to join its service at the broker and to watch its peers.

asyncio (the worker roles are grpc.aio servers): create and use a client inside one running loop.
- `register(info)` joins and starts a keepalive task renewing the lease every ttl/3 with the
  load. When the broker does not know the lease (restarted, or it lapsed) the task registers
  again, keeping the draining state; while the broker is unreachable it retries with jittered
  exponential backoff.
- `watch(roles)` starts a task keeping a `MembershipView` up to date (rpc/broker_watch.py).
- `set_draining`, `deregister`, `list_members`, `close`. A member someone else marked draining
  learns it from the next KeepAlive reply; one registered with `on_marked_draining` keeps the
  mark as its own and calls it once.
- `report_now()` sends the load at once (a drained decode's migration counts, for the operator).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable

import grpc

from pdserve.v1 import broker_pb2, broker_pb2_grpc
from pdserve_common.auth import TLSConfig
from pdserve_common.channels import BROKER_MAX_MESSAGE, aio_channel
from pdserve_common.credentials import MEMBER_CREDENTIAL_HEADER
from pdserve_common.logs import kv
from pdserve_common.membership import (
    Load,
    Member,
    MemberInfo,
    Role,
    load_to_proto,
    member_from_proto,
    member_info_to_proto,
    role_to_proto,
)
from pdserve_worker.rpc.backoff import PERMANENT, Backoff, raise_if_cancelling
from pdserve_worker.rpc.broker_watch import Listener, MembershipView, watch_loop

log = logging.getLogger(__name__)

DEFAULT_BACKOFF = Backoff(base_s=0.1, cap_s=5.0)


class BrokerError(Exception):
    """A broker call failed; `code` is the gRPC status code."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class BrokerClient:
    """One service's view of the broker at `address`, authenticated by the service's token."""

    def __init__(
        self,
        address: str,
        service_key: str,
        token: str,
        tls: TLSConfig | None = None,
        *,
        backoff: Backoff = DEFAULT_BACKOFF,
        call_timeout_s: float = 5.0,
        credential: Callable[[], str] | None = None,
    ) -> None:
        """`credential`: this member's credential (pdserve_common/credentials.py), asked before
        each registration (a pod's identity token is rotated); needed with a role token."""
        if not service_key or "/" not in service_key:
            raise ValueError(f"service_key must be 'namespace/name', got {service_key!r}")
        self.address = address
        self.service_key = service_key
        self._token = token
        self._tls = tls
        self._backoff = backoff
        self._timeout = call_timeout_s
        self._credential = credential
        self._channel: grpc.aio.Channel | None = None
        self._stub_: broker_pb2_grpc.BrokerStub | None = None
        self._info: MemberInfo | None = None
        self._load_fn: Callable[[], Load] | None = None
        self._on_marked_draining: Callable[[], None] | None = None
        self._draining = False
        self._draining_acked = True  # the broker has self._draining (or will get it on register)
        self._lease_id: str | None = None
        self._ttl_s = 10.0
        self.broker_id = ""
        self.registrations = 0  # successful Register calls: 1 + re-registrations
        self._keepalive_task: asyncio.Task[None] | None = None
        self._watch_tasks: list[asyncio.Task[None]] = []

    # --- registration -------------------------------------------------------------------

    @property
    def lease_id(self) -> str | None:
        return self._lease_id

    @property
    def draining(self) -> bool:
        return self._draining

    async def register(
        self,
        info: MemberInfo,
        *,
        load: Callable[[], Load] | None = None,
        wait: bool = True,
        timeout_s: float | None = None,
        on_marked_draining: Callable[[], None] | None = None,
    ) -> None:
        """Join the service and keep the lease alive in the background.

        `load` is called before each keepalive for the load to report. With `wait`, return
        once registered (retrying while the broker is unreachable, up to `timeout_s`);
        a refusal that retrying cannot fix (bad token, invalid member) raises BrokerError.
        Without `wait`, the keepalive task registers as soon as the broker answers.
        `on_marked_draining` is called (once, on the event loop) when a KeepAlive reply says
        someone else marked this member draining.
        """
        info.validate()
        if self._keepalive_task is not None:
            raise RuntimeError(f"worker {self._info.worker_id if self._info else '?'} is already registered")
        self._info, self._load_fn, self._on_marked_draining = info, load, on_marked_draining
        if wait:
            async with asyncio.timeout(timeout_s):
                await _register_retrying(self._register_once, self.address, info.worker_id, self._backoff)
        self._keepalive_task = asyncio.get_running_loop().create_task(
            self._keepalive_loop(), name=f"broker-keepalive-{info.worker_id}"
        )

    async def update(self, info: MemberInfo) -> None:
        """Replace what the broker knows about this worker (same worker_id; e.g. new capacity).

        Registers again at once (the broker swaps the lease and watchers see UPDATED); if the
        broker is away, the keepalive task will register the new info when it is back.
        """
        info.validate()
        if self._info is None or info.worker_id != self._info.worker_id:
            registered = self._info.worker_id if self._info else None
            raise ValueError(f"update() keeps the worker_id: registered {registered!r}, got {info.worker_id!r}")
        self._info = info
        try:
            await self._register_once()
        except grpc.aio.AioRpcError as exc:
            if exc.code() in PERMANENT:
                raise BrokerError(
                    f"broker {self.address} refused the update of {info.worker_id}: {exc.details()}", exc.code()
                ) from None
            self._lease_id = None  # the keepalive task registers the new info when the broker is back
            log.warning(kv(event="broker_client.update_deferred", code=exc.code().name, detail=exc.details()))

    async def _register_once(self) -> None:
        assert self._info is not None
        draining = self._draining
        reply = await self._stub().Register(
            broker_pb2.RegisterRequest(
                service_key=self.service_key,
                member=member_info_to_proto(self._info),
                draining=draining,
                replaces_lease_id=self._lease_id or "",  # (an update: the member's own lease)
            ),
            timeout=self._timeout,
            metadata=((MEMBER_CREDENTIAL_HEADER, self._credential()),) if self._credential else None,
        )
        self._lease_id, self._ttl_s, self.broker_id = reply.lease_id, reply.ttl_ms / 1000, reply.broker_id
        self._draining_acked = draining == self._draining
        self.registrations += 1
        log.info(
            kv(
                event="broker_client.registered",
                service=self.service_key,
                worker=self._info.worker_id,
                role=self._info.role,
                broker_id=reply.broker_id,
                ttl_s=self._ttl_s,
                registrations=self.registrations,
            )
        )

    def _keepalive_request(self, lease: str) -> broker_pb2.KeepAliveRequest:
        """A renewal of `lease` carrying the current load (none when there is no load
        function, or it failed)."""
        request = broker_pb2.KeepAliveRequest(service_key=self.service_key, lease_id=lease)
        try:
            load = None if self._load_fn is None else self._load_fn()
        except Exception:
            log.exception(kv(event="broker_client.load_failed", worker=self._info.worker_id if self._info else ""))
            load = None
        if load is not None:
            request.load.CopyFrom(load_to_proto(load))
        return request

    async def _keepalive_loop(self) -> None:
        """Renew every ttl/3; re-register when the broker forgot the lease; back off when it is away."""
        failures = 0
        while True:
            interval = self._ttl_s / 3
            if self._lease_id is None:
                try:
                    await self._register_once()
                    failures = 0
                except grpc.aio.AioRpcError as exc:
                    raise_if_cancelling()
                    failures += 1
                    _log_failure(self.address, "register", exc, failures)
                    await asyncio.sleep(self._backoff.delay(failures - 1))
                continue
            await asyncio.sleep(interval if failures == 0 else min(interval, self._backoff.delay(failures - 1)))
            request = self._keepalive_request(self._lease_id)
            try:
                reply = await self._stub().KeepAlive(request, timeout=self._timeout)
            except grpc.aio.AioRpcError as exc:
                raise_if_cancelling()
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    log.warning(
                        kv(
                            event="broker_client.lease_unknown",
                            service=self.service_key,
                            worker=self._info.worker_id if self._info else "",
                            detail=exc.details(),
                        )
                    )
                    self._lease_id = None
                    continue
                failures += 1
                _log_failure(self.address, "keepalive", exc, failures)
                continue
            if failures:
                log.info(kv(event="broker_client.keepalive_recovered", broker=self.address, after_failures=failures))
            failures = 0
            self._ttl_s, self.broker_id = reply.ttl_ms / 1000, reply.broker_id
            if not self._draining_acked:  # a SetDraining that failed earlier: tell the broker now
                await self._send_draining()
            elif reply.draining and not self._draining and self._on_marked_draining is not None:
                self._marked_draining()
            elif self._draining and not reply.draining:  # unmarked by someone else: a drained worker
                await self._send_draining()  # takes nothing new, so the mark stays true

    def _marked_draining(self) -> None:
        """Someone holding the service's token marked us draining and our owner acts on it: keep
        the mark (a re-registration after a broker restart carries it) and tell the owner, once."""
        assert self._on_marked_draining is not None
        self._draining = True
        worker = self._info.worker_id if self._info else ""
        log.info(kv(event="broker_client.marked_draining", service=self.service_key, worker=worker))
        try:
            self._on_marked_draining()
        except Exception:
            log.exception(kv(event="broker_client.on_marked_draining_failed"))

    async def report_now(self) -> bool:
        """Renew the lease with the current load at once (not waiting for the next turn); False
        when it did not reach the broker (the keepalive task goes on as before)."""
        lease = self._lease_id
        if lease is None:
            return False
        try:
            await self._stub().KeepAlive(self._keepalive_request(lease), timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            log.warning(kv(event="broker_client.report_failed", code=exc.code().name, detail=exc.details()))
            return False
        return True

    async def set_draining(self, draining: bool = True) -> bool:
        """Take no new requests (or take them again). Remembered: if the broker cannot be told
        now, the keepalive task tells it later (or re-registers with it). Returns whether the
        broker has it already."""
        self._draining = draining
        self._draining_acked = False
        return await self._send_draining()

    async def _send_draining(self) -> bool:
        draining, lease = self._draining, self._lease_id
        if lease is None:
            return False
        try:
            await self._stub().SetDraining(
                broker_pb2.SetDrainingRequest(service_key=self.service_key, lease_id=lease, draining=draining),
                timeout=self._timeout,
            )
        except grpc.aio.AioRpcError as exc:
            log.warning(kv(event="broker_client.set_draining_failed", code=exc.code().name, detail=exc.details()))
            return False
        self._draining_acked = draining == self._draining
        return True

    async def deregister(self) -> bool:
        """Stop the keepalive and leave the service; False if the broker could not be told
        (the lease then expires on its own)."""
        await _cancel(self._keepalive_task)
        self._keepalive_task = None
        lease, self._lease_id, self._info = self._lease_id, None, None
        if lease is None:
            return False
        try:
            reply = await self._stub().Deregister(
                broker_pb2.DeregisterRequest(service_key=self.service_key, lease_id=lease), timeout=self._timeout
            )
            return bool(reply.removed)
        except grpc.aio.AioRpcError as exc:
            log.warning(kv(event="broker_client.deregister_failed", code=exc.code().name, detail=exc.details()))
            return False

    # --- reading the membership ---------------------------------------------------------

    async def list_members(self, roles: Iterable[Role] = ()) -> list[Member]:
        try:
            reply = await self._stub().ListMembers(
                broker_pb2.ListMembersRequest(service_key=self.service_key, roles=[role_to_proto(r) for r in roles]),
                timeout=self._timeout,
            )
        except grpc.aio.AioRpcError as exc:
            raise BrokerError(
                f"ListMembers at {self.address}: {exc.code().name}: {exc.details()}", exc.code()
            ) from None
        return [member_from_proto(m) for m in reply.members]

    async def watch(self, roles: Iterable[Role] = (), listener: Listener | None = None) -> MembershipView:
        """Start watching (in the background) and return the view it keeps."""
        view = MembershipView(roles)
        if listener is not None:
            view.add_listener(listener)
        self._watch_tasks.append(
            asyncio.get_running_loop().create_task(
                watch_loop(self._stub, self.service_key, view, self._backoff), name=f"broker-watch-{self.service_key}"
            )
        )
        return view

    # --- plumbing -----------------------------------------------------------------------

    def _stub(self) -> broker_pb2_grpc.BrokerStub:
        if self._stub_ is None:  # created on first use, inside the loop that will run it
            self._channel = aio_channel(self.address, self._token, self._tls, max_message=BROKER_MAX_MESSAGE)
            self._stub_ = broker_pb2_grpc.BrokerStub(self._channel)
        return self._stub_

    async def close(self) -> None:
        """Stop the keepalive and the watches and close the channel (does not deregister:
        call deregister() first to leave at once rather than when the lease lapses)."""
        for task in [self._keepalive_task, *self._watch_tasks]:
            await _cancel(task)
        self._keepalive_task, self._watch_tasks = None, []
        if self._channel is not None:
            await self._channel.close()
            self._channel, self._stub_ = None, None

    async def __aenter__(self) -> BrokerClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


async def _register_retrying(
    register_once: Callable[[], Awaitable[None]], address: str, worker_id: str, backoff: Backoff
) -> None:
    """Call `register_once` until it succeeds, backing off while the broker is unreachable; a
    refusal that retrying cannot fix raises BrokerError."""
    attempt = 0
    while True:
        try:
            await register_once()
            return
        except grpc.aio.AioRpcError as exc:
            if exc.code() in PERMANENT:
                raise BrokerError(
                    f"broker {address} refused registration of {worker_id}: {exc.details()}",
                    exc.code(),
                ) from None
            log.warning(kv(event="broker_client.register_retry", broker=address, code=exc.code().name, attempt=attempt))
            await asyncio.sleep(backoff.delay(attempt))
            attempt += 1


def _log_failure(address: str, what: str, exc: grpc.aio.AioRpcError, failures: int) -> None:
    # First failure of a streak (and every tenth) at WARNING: a down broker must not flood the log.
    level = logging.ERROR if exc.code() in PERMANENT else logging.WARNING
    if failures == 1 or failures % 10 == 0 or exc.code() in PERMANENT:
        log.log(
            level,
            kv(
                event=f"broker_client.{what}_failed",
                broker=address,
                code=exc.code().name,
                detail=exc.details(),
                failures=failures,
            ),
        )


async def _cancel(task: asyncio.Task[None] | None) -> None:
    if task is None or task.done():
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
