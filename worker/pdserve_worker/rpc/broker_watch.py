"""The membership a worker or router watches: `MembershipView`, kept by `watch_loop`.

`BrokerClient.watch(roles)` starts `watch_loop`, which keeps the view, the last-known
membership, up to date from the broker's watch stream and calls listeners with each change.
When the broker is down the view keeps what it knew (`connected` is False); when the stream
comes back the broker's snapshot is applied as a diff, and members missing from it are
dropped once the broker says the snapshot is complete (SYNCED).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

import grpc

from pdserve.v1 import broker_pb2, broker_pb2_grpc
from pdserve_common.logs import kv
from pdserve_common.membership import (
    BROKER_ID_HEADER,
    EventType,
    Member,
    MemberEvent,
    Role,
    change_type,
    event_from_proto,
    role_to_proto,
)
from pdserve_worker.rpc.backoff import PERMANENT, Backoff, raise_if_cancelling

log = logging.getLogger(__name__)

Listener = Callable[[MemberEvent], None]


class MembershipView:
    """The last-known members of a service (optionally of some roles), kept by a watch task.

    Readers get copies; listeners are called on the event loop, in order, with every change.
    """

    def __init__(self, roles: Iterable[Role] = ()) -> None:
        self.roles = frozenset(roles)
        self._members: dict[str, Member] = {}
        self._listeners: list[Listener] = []
        self._changed = asyncio.Event()
        self.connected = False
        self.synced = False
        self.broker_id = ""
        self.revision = 0

    # --- reading ------------------------------------------------------------------------

    @property
    def members(self) -> dict[str, Member]:
        return dict(self._members)

    def get(self, worker_id: str) -> Member | None:
        return self._members.get(worker_id)

    def by_role(self, role: Role, *, include_draining: bool = False) -> list[Member]:
        return sorted(
            (m for m in self._members.values() if m.role == role and (include_draining or not m.draining)),
            key=lambda m: m.worker_id,
        )

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)

    async def wait_for(self, predicate: Callable[[MembershipView], bool], timeout: float | None = None) -> None:
        """Return once `predicate(view)` holds; TimeoutError after `timeout` seconds."""
        async with asyncio.timeout(timeout):
            while not predicate(self):
                changed = self._changed
                await changed.wait()

    # --- updates from the watch task ----------------------------------------------------

    def _apply(self, member: Member, revision: int) -> None:
        kind = change_type(self._members.get(member.worker_id), member)
        self._members[member.worker_id] = member
        if kind is not None:
            self._emit(MemberEvent(kind, member, revision))

    def _remove(self, worker_id: str, revision: int) -> None:
        member = self._members.pop(worker_id, None)
        if member is not None:
            self._emit(MemberEvent(EventType.REMOVED, member, revision))

    def _resync(self, seen: set[str], revision: int) -> None:
        """The broker's snapshot is complete: drop what it did not contain."""
        for worker_id in sorted(set(self._members) - seen):
            self._remove(worker_id, revision)
        self.synced = True
        self._emit(None)

    def _set_connected(self, connected: bool, broker_id: str = "") -> None:
        if connected != self.connected:
            self.connected = connected
            if broker_id:
                self.broker_id = broker_id
            self._emit(None)

    def _emit(self, event: MemberEvent | None) -> None:
        if event is not None:
            self.revision = max(self.revision, event.revision)
            for listener in list(self._listeners):
                try:
                    listener(event)
                except Exception:  # a listener's bug must not stop the watch
                    log.exception(
                        kv(
                            event="broker_client.listener_failed",
                            type=event.type,
                            worker=event.member.worker_id if event.member else "",
                        )
                    )
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()


async def watch_loop(
    stub: Callable[[], broker_pb2_grpc.BrokerStub], service_key: str, view: MembershipView, backoff: Backoff
) -> None:
    """Keep `view` up to date from the broker's watch stream, reconnecting with `backoff`."""
    request = broker_pb2.WatchRequest(service_key=service_key, roles=[role_to_proto(r) for r in view.roles])
    attempt = 0
    while True:
        call = stub().Watch(request)
        seen: set[str] = set()
        detail: str | None
        code: grpc.StatusCode | None
        try:
            metadata = await call.initial_metadata()
            broker_id = dict(metadata or ()).get(BROKER_ID_HEADER, "")
            if broker_id:
                view._set_connected(True, broker_id)
                log.info(kv(event="broker_client.watching", service=service_key, broker_id=broker_id))
            async for msg in call:
                attempt = 0
                _on_watch_event(view, msg, seen)
            detail, code = "stream ended", None
        except grpc.aio.AioRpcError as exc:
            detail, code = exc.details(), exc.code()
        finally:
            call.cancel()
        raise_if_cancelling()
        view._set_connected(False)
        level = logging.ERROR if code in PERMANENT else logging.WARNING
        if attempt == 0 or attempt % 10 == 0 or code in PERMANENT:
            log.log(
                level,
                kv(
                    event="broker_client.watch_lost",
                    service=service_key,
                    code=code.name if code else "OK",
                    detail=detail,
                    kept=len(view.members),
                ),
            )
        await asyncio.sleep(backoff.delay(attempt))
        attempt += 1


def _on_watch_event(view: MembershipView, msg: broker_pb2.WatchEvent, seen: set[str]) -> None:
    try:
        event = event_from_proto(msg)
    except ValueError as exc:
        log.warning(kv(event="broker_client.bad_watch_event", detail=str(exc)))
        return
    if event.type is EventType.SYNCED:
        view._resync(seen, event.revision)
        return
    assert event.member is not None
    if event.type is EventType.REMOVED:
        seen.discard(event.member.worker_id)
        view._remove(event.member.worker_id, event.revision)
    else:
        seen.add(event.member.worker_id)
        view._apply(event.member, event.revision)
