"""The broker's gRPC face (`BrokerServicer`) and `BrokerServer`, which hosts it in-process.

`BrokerServer` runs a grpc.aio server on its own event loop in a daemon thread, so that the
operator (whose kopf loop it must not share: a slow handler there must not delay lease
renewals) and the `pdserve broker` command host it the same way, with plain `start()` and
`stop()` calls. State lives in a `Registry`; this module only translates between protos and
registry calls, maps failures to status codes, and runs the lease reaper.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import threading
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

import grpc

from pdserve.v1 import broker_pb2, broker_pb2_grpc
from pdserve_common.auth import SERVICE_ROLE, TLSConfig, TokenTable, caller
from pdserve_common.channels import BROKER_MAX_CONNECTIONS, BROKER_MAX_MESSAGE, GrpcLimits, aio_server, listen
from pdserve_common.credentials import MEMBER_CREDENTIAL_HEADER
from pdserve_common.grpc_front import PeerCappedFront
from pdserve_common.logs import kv
from pdserve_common.membership import (
    BROKER_ID_HEADER,
    Member,
    Role,
    event_to_proto,
    load_from_proto,
    member_info_from_proto,
    member_to_proto,
    role_from_proto,
)
from pdserve_operator.broker.identity import MemberCredentials, Review
from pdserve_operator.broker.registry import DEFAULT_MAX_MEMBERS, MemberTaken, Registry, TooManyMembers, WatchEnded

Context = grpc.aio.ServicerContext[Any, Any]

log = logging.getLogger(__name__)

# A member's description as registered: a worker's is a few hundred bytes; the cap bounds what
# one token holder can make the broker keep (with the per-service member cap, Registry).
MAX_MEMBER_BYTES = 16 * 1024
MAX_MEMBERS_ENV = "PDSERVE_BROKER_MAX_MEMBERS"

_ENDED_CODES: dict[str, grpc.StatusCode] = {
    "overflow": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "service_removed": grpc.StatusCode.NOT_FOUND,
    "shutdown": grpc.StatusCode.UNAVAILABLE,
}


async def _roles(request_roles: Iterable[int], context: Context) -> list[Role]:
    try:
        return [role_from_proto(r) for r in request_roles]
    except ValueError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        raise  # unreachable: abort raises


async def _require_service_key(service_key: str, context: Context) -> None:
    if not service_key:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "service_key must be 'namespace/name', got ''")


class BrokerServicer(broker_pb2_grpc.BrokerServicer):
    """Authentication happens before these run (ServiceAuthInterceptor): each request's
    service_key is one the caller's token grants."""

    def __init__(self, registry: Registry, broker_id: str, members: MemberCredentials | None = None) -> None:
        self._registry = registry
        self._broker_id = broker_id
        self._members = members or MemberCredentials()

    async def Register(self, request: broker_pb2.RegisterRequest, context: Context) -> broker_pb2.RegisterReply:
        await _require_service_key(request.service_key, context)
        size = request.member.ByteSize()
        if size > MAX_MEMBER_BYTES:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"member: {size} bytes, more than the {MAX_MEMBER_BYTES} a member may take",
            )
        try:
            info = member_info_from_proto(request.member)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"member: {exc}")
        who = caller()  # (None: called without the interceptor, in-process)
        if who is not None and who.role != SERVICE_ROLE and info.role.value != who.role:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"a {who.role}'s token may not register a {info.role.value} member ({info.worker_id})",
            )
        full = who is None or who.role == SERVICE_ROLE
        if not full:
            await self._check_member(request.service_key, info.role.value, info.worker_id, context)
        try:
            lease = self._registry.register(
                request.service_key,
                info,
                draining=request.draining,
                replaces=request.replaces_lease_id,
                may_replace=full,
            )
        except TooManyMembers as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except MemberTaken as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return broker_pb2.RegisterReply(
            lease_id=lease.lease_id, ttl_ms=int(lease.ttl_s * 1000), broker_id=self._broker_id
        )

    async def _check_member(self, service_key: str, role: str, worker_id: str, context: Context) -> None:
        """A role token registers only the member its member credential is bound to (identity.py)."""
        presented = [v for k, v in context.invocation_metadata() or () if k == MEMBER_CREDENTIAL_HEADER]
        value = presented[0] if len(presented) == 1 and isinstance(presented[0], str) else ""
        # (a TokenReview is a blocking HTTP call: off the broker's loop)
        refusal = await asyncio.to_thread(self._members.refusal, service_key, role, worker_id, value)
        if refusal is not None:
            log.warning(kv(event="broker.member_refused", service=service_key, worker=worker_id, peer=context.peer()))
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal)

    async def KeepAlive(self, request: broker_pb2.KeepAliveRequest, context: Context) -> broker_pb2.KeepAliveReply:
        load = load_from_proto(request.load) if request.HasField("load") else None
        if not self._registry.keepalive(request.service_key, request.lease_id, load):
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"lease {request.lease_id!r} unknown in service {request.service_key!r} "
                "(expired, or the broker restarted): register again",
            )
        # The reply says whether the member is marked draining: a decode the operator marked
        # (scale-down) learns it here and drains itself (worker_main.py).
        return broker_pb2.KeepAliveReply(
            ttl_ms=int(self._registry.ttl_s * 1000),
            broker_id=self._broker_id,
            draining=self._registry.draining_of(request.service_key, request.lease_id),
        )

    async def Watch(self, request: broker_pb2.WatchRequest, context: Context) -> AsyncIterator[broker_pb2.WatchEvent]:
        await _require_service_key(request.service_key, context)
        roles = await _roles(request.roles, context)
        sub = self._registry.subscribe(request.service_key, roles, asyncio.get_running_loop())
        await context.send_initial_metadata(((BROKER_ID_HEADER, self._broker_id),))
        log.debug(
            kv(event="broker.watch", service=request.service_key, roles=",".join(roles) or "all", peer=context.peer())
        )
        try:
            while True:
                try:
                    event = await sub.next()
                except WatchEnded as ended:
                    await context.abort(_ENDED_CODES[ended.reason], str(ended))
                yield event_to_proto(event)
        finally:
            self._registry.unsubscribe(sub)

    async def SetDraining(
        self, request: broker_pb2.SetDrainingRequest, context: Context
    ) -> broker_pb2.SetDrainingReply:
        target = request.WhichOneof("target")
        if target is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "set lease_id or worker_id")
        if target == "worker_id":
            # A decode marked draining now drains for real (#17: it hands its requests over and
            # stays idle), so over the wire a worker may drain only itself, by its own lease; a
            # pod holding the service token must not empty the other decodes. The operator
            # drains a member through the registry in its own process, never through here.
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"SetDraining by worker_id {request.worker_id!r} is refused: a worker drains only itself (lease_id)",
            )
        value = getattr(request, target)
        found = self._registry.set_draining(request.service_key, draining=request.draining, **{target: value})
        if not found:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"no member with {target} {value!r} in service {request.service_key!r}"
            )
        return broker_pb2.SetDrainingReply()

    async def Deregister(self, request: broker_pb2.DeregisterRequest, context: Context) -> broker_pb2.DeregisterReply:
        return broker_pb2.DeregisterReply(removed=self._registry.deregister(request.service_key, request.lease_id))

    async def ListMembers(
        self, request: broker_pb2.ListMembersRequest, context: Context
    ) -> broker_pb2.ListMembersReply:
        roles = await _roles(request.roles, context)
        return broker_pb2.ListMembersReply(
            members=[member_to_proto(m) for m in self._registry.members(request.service_key, roles)],
            revision=self._registry.revision(request.service_key),
        )


class BrokerServer:
    """The broker, hosted in-process: `start(host, port) -> port`, `stop(grace)`.

    Tokens and state can be read and changed from any thread, before or after start.
    """

    def __init__(
        self,
        tokens: Mapping[str, str] | None = None,
        *,
        ttl_s: float = 10.0,
        tls: TLSConfig | None = None,
        resync_grace_s: float | None = None,
        queue_size: int = 1024,
        max_members: int | None = None,
        review: Review | None = None,
    ) -> None:
        """`max_members` per service: default $PDSERVE_BROKER_MAX_MEMBERS, else 4,096; `review`
        checks pods' identity tokens (identity.py; None: only member credentials are taken)."""
        self.tokens = TokenTable(tokens)
        self.member_credentials = MemberCredentials(review)
        for service_key, token in (tokens or {}).items():
            self.member_credentials.set(service_key, token)
        if max_members is None:
            max_members = int(os.environ.get(MAX_MEMBERS_ENV) or DEFAULT_MAX_MEMBERS)
        self.registry = Registry(ttl_s, resync_grace_s=resync_grace_s, queue_size=queue_size, max_members=max_members)
        self.broker_id = secrets.token_hex(8)
        self._tls = tls
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: grpc.aio.Server | None = None
        self._front: PeerCappedFront | None = None  # the per-address cap in front of the port
        self._reaper: asyncio.Task[None] | None = None
        self.port: int | None = None

    # --- lifecycle ----------------------------------------------------------------------

    def start(self, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 10.0) -> int:
        """Listen on host:port (0 picks a free port) and serve; return the bound port."""
        if self._thread is not None:
            raise RuntimeError(f"broker {self.broker_id} already started on port {self.port}")
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name=f"pdserve-broker-{self.broker_id}", daemon=True)
        thread.start()
        self._loop, self._thread = loop, thread
        try:
            self.port = asyncio.run_coroutine_threadsafe(self._start(host, port), loop).result(timeout_s)
        except BaseException:
            self._halt_loop()
            raise
        log.info(
            kv(
                event="broker.listening",
                host=host,
                port=self.port,
                broker_id=self.broker_id,
                tls=self._tls is not None,
                ttl_s=self.registry.ttl_s,
                services=len(self.tokens.services()),
            )
        )
        return self.port

    async def _start(self, host: str, port: int) -> int:
        limits = GrpcLimits.from_env(max_connections=BROKER_MAX_CONNECTIONS)
        server = aio_server(self.tokens, max_message=BROKER_MAX_MESSAGE, limits=limits)
        broker_pb2_grpc.add_BrokerServicer_to_server(
            BrokerServicer(self.registry, self.broker_id, self.member_credentials), server
        )
        bound, self._front = await listen(server, host, port, self._tls, limits)
        await server.start()
        self.registry.start()
        self._server = server
        self._reaper = asyncio.get_running_loop().create_task(self._reap())
        return bound

    async def _reap(self) -> None:
        period = min(1.0, self.registry.ttl_s / 4)
        while True:
            await asyncio.sleep(period)
            self.registry.expire()

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop serving: watchers are ended (UNAVAILABLE), unary calls get `grace` seconds.

        Blocks the calling thread until done; from async code use
        `await asyncio.to_thread(server.stop, grace)`. Safe to call twice."""
        if self._loop is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._stop(grace), self._loop).result((grace or 0) + 10)
        finally:
            self._halt_loop()
            log.info(kv(event="broker.stopped", port=self.port, broker_id=self.broker_id))

    async def _stop(self, grace: float | None) -> None:
        self.registry.close_all()
        if self._reaper is not None:
            self._reaper.cancel()
        if self._server is not None:
            await self._server.stop(grace)
        if self._front is not None:
            await self._front.close()

    def _halt_loop(self) -> None:
        loop, thread = self._loop, self._thread
        self._loop = self._thread = None
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        if not thread.is_alive():
            loop.close()

    @property
    def address(self) -> str:
        if self.port is None:
            raise RuntimeError("broker not started")
        return f"127.0.0.1:{self.port}"

    # --- what the operator uses ---------------------------------------------------------

    def set_service_token(self, service_key: str, token: str) -> None:
        # Members' credentials first: a role token the table admits must never meet a broker
        # that cannot yet check its member credential (a PERMISSION_DENIED the worker takes as final).
        self.member_credentials.set(service_key, token)
        self.tokens.set(service_key, token)

    def remove_service(self, service_key: str) -> None:
        """Revoke the service's token and forget its members; its watchers end."""
        self.tokens.remove(service_key)
        self.member_credentials.remove(service_key)
        self.registry.remove_service(service_key)

    def members(self, service_key: str) -> list[Member]:
        return self.registry.members(service_key)

    def registered_counts(self, service_key: str) -> dict[Role, int]:
        return self.registry.registered_counts(service_key)

    def kv_tokens_in_use(self, service_key: str) -> int:
        return self.registry.kv_tokens_in_use(service_key)

    def set_draining(self, service_key: str, worker_id: str, draining: bool = True) -> bool:
        return self.registry.set_draining(service_key, worker_id=worker_id, draining=draining)
