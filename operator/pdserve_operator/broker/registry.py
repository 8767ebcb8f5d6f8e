"""The broker's state: members of each service, their leases, and the watchers' queues.

No gRPC here, and time is injected, so leases, draining and the watch protocol are tested
without sockets or sleeps. One lock guards everything: the gRPC handlers run on the broker's
event loop while the operator reads counts and sets tokens from its own threads.
Watch protocol (broker.proto): one ADDED per current member, then SYNCED (held back until
`resync_grace_s` after `start()`, so a restarted broker's empty snapshot is not taken as the
truth), then changes. One service holds at most `max_members` members (`TooManyMembers`), each
at most 16 KiB. Each watcher has its own bounded queue: a slow watcher never blocks others, and
one `queue_size` events behind is closed (`WatchEnded('overflow')`) and re-watches.
The protocol in detail: docs/operator.md.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from pdserve_common.logs import kv
from pdserve_common.membership import EventType, Load, Member, MemberEvent, MemberInfo, Role, change_type

log = logging.getLogger(__name__)


DEFAULT_MAX_MEMBERS = 4096  # per service: prefill + decode groups x shards + routers, with room to roll


class TooManyMembers(Exception):
    """A service already has `max_members` members: a new worker id is refused."""


class MemberTaken(Exception):
    """A worker id's registration is live and the caller may not replace it (#29: a router's
    token re-registered decode-0 at an endpoint of its own until the real pod came back)."""


class WatchEnded(Exception):
    """The broker ended a watch: `reason` is 'overflow', 'service_removed' or 'shutdown'."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class Subscription:
    """One watcher's queue: filled under the registry lock from any thread, drained by one asyncio task."""

    def __init__(
        self, service_key: str, roles: frozenset[Role], queue_size: int, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.service_key = service_key
        self.roles = roles
        self._limit = queue_size
        self._loop = loop
        self._items: deque[MemberEvent] = deque()
        self._wake = asyncio.Event()
        self._ended: WatchEnded | None = None
        self.pending_sync = True

    def wants(self, member: Member) -> bool:
        return not self.roles or member.role in self.roles

    @property
    def closed(self) -> bool:
        return self._ended is not None

    def offer(self, event: MemberEvent, *, force: bool = False) -> None:
        """Queue without blocking; a full queue ends this watch instead of growing or waiting."""
        if self._ended is not None:
            return
        if not force and len(self._items) >= self._limit:
            self.close(WatchEnded("overflow", f"watcher fell {len(self._items)} events behind; watch again"))
            return
        self._items.append(event)
        self._notify()

    def close(self, ended: WatchEnded) -> None:
        if self._ended is None:
            self._ended = ended
            self._notify()

    def _notify(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self._wake.set)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    async def next(self) -> MemberEvent:
        """The next event; raises WatchEnded once closed (queued events first, unless it overflowed)."""
        while True:
            if self._ended is not None and (self._ended.reason == "overflow" or not self._items):
                raise self._ended
            if self._items:
                return self._items.popleft()
            self._wake.clear()
            # A producer that appends after the check above schedules set() after this clear().
            await self._wake.wait()


@dataclass(frozen=True)
class Lease:
    lease_id: str
    ttl_s: float


@dataclass
class _Entry:
    member: Member
    lease_id: str
    deadline: float


@dataclass
class _Service:
    entries: dict[str, _Entry] = field(default_factory=dict)  # by worker_id
    leases: dict[str, str] = field(default_factory=dict)  # lease_id -> worker_id
    revision: int = 0
    subscriptions: set[Subscription] = field(default_factory=set)


class Registry:
    def __init__(
        self,
        ttl_s: float = 10.0,
        *,
        resync_grace_s: float | None = None,
        queue_size: int = 1024,
        max_members: int = DEFAULT_MAX_MEMBERS,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {queue_size}")
        if max_members < 1:
            raise ValueError(f"max_members must be >= 1, got {max_members}")
        self.max_members = max_members
        self.ttl_s = ttl_s
        self.resync_grace_s = ttl_s if resync_grace_s is None else resync_grace_s
        self.queue_size = queue_size
        self._clock = clock
        self._wall = wall_clock
        self._lock = threading.Lock()
        self._services: dict[str, _Service] = {}
        self._synced_after = clock() + self.resync_grace_s

    def start(self) -> None:
        """Begin the resync grace now (the broker just started serving)."""
        with self._lock:
            self._synced_after = self._clock() + self.resync_grace_s

    # --- membership changes -------------------------------------------------------------

    def register(
        self,
        service_key: str,
        info: MemberInfo,
        *,
        draining: bool = False,
        replaces: str = "",
        may_replace: bool = True,
    ) -> Lease:
        """Add a member, or replace the registration of its worker_id (the old lease ends).
        Raises TooManyMembers for a new worker id of a service that has `max_members`, and
        MemberTaken when the worker_id's registration is live and the caller may not replace it
        (`may_replace` False: a role token) without presenting that registration's lease."""
        info.validate()
        lease_id = secrets.token_hex(16)
        with self._lock:
            svc = self._services.setdefault(service_key, _Service())
            old = svc.entries.get(info.worker_id)
            if old is not None and not may_replace and not secrets.compare_digest(replaces, old.lease_id):
                left = old.deadline - self._clock()
                raise MemberTaken(
                    f"member {info.worker_id!r} of {service_key!r} is registered (its lease runs {left:.1f} s more); "
                    "only its own lease replaces it: register again once it has expired"
                )
            if old is None and len(svc.entries) >= self.max_members:
                raise TooManyMembers(
                    f"service {service_key!r} already has {len(svc.entries)} members, "
                    f"the most one service may register; {info.worker_id!r} is not added"
                )
            if old is not None:
                svc.leases.pop(old.lease_id, None)
            member = Member(
                info=info,
                draining=draining,
                load=Load(slots_used=info.slots_total - info.slots_free, slots_free=info.slots_free),
                registered_unix_ms=int(self._wall() * 1000),
            )
            svc.entries[info.worker_id] = _Entry(member, lease_id, self._clock() + self.ttl_s)
            svc.leases[lease_id] = info.worker_id
            self._publish(svc, change_type(old.member if old else None, member) or EventType.UPDATED, member)
        log.info(
            kv(
                event="broker.register",
                service=service_key,
                worker=info.worker_id,
                role=info.role,
                endpoint=info.grpc_endpoint,
                engine=info.engine_id,
                replaced=old is not None,
                draining=draining,
            )
        )
        return Lease(lease_id, self.ttl_s)

    def keepalive(self, service_key: str, lease_id: str, load: Load | None = None) -> bool:
        """Renew a lease (and record the load); False when the lease is unknown."""
        with self._lock:
            entry = self._entry_by_lease(service_key, lease_id)
            if entry is None:
                return False
            now = self._clock()
            entry.deadline = now + self.ttl_s
            if load is not None:
                changed = load != entry.member.load
                entry.member = replace(entry.member, load=load, load_at=now)
                if changed:  # (load_at alone is no change: it is not compared, nor sent to watchers)
                    self._publish(self._services[service_key], EventType.UPDATED, entry.member)
            return True

    def draining_of(self, service_key: str, lease_id: str) -> bool:
        """Whether the member holding `lease_id` is marked draining (False when unknown)."""
        with self._lock:
            entry = self._entry_by_lease(service_key, lease_id)
            return entry is not None and entry.member.draining

    def set_draining(
        self, service_key: str, *, lease_id: str | None = None, worker_id: str | None = None, draining: bool = True
    ) -> bool:
        """Mark a member (by lease or worker id) draining or active; False when there is no such member."""
        if (lease_id is None) == (worker_id is None):
            raise ValueError("set_draining needs exactly one of lease_id and worker_id")
        with self._lock:
            if lease_id is not None:
                entry = self._entry_by_lease(service_key, lease_id)
            else:
                entry = self._services.get(service_key, _Service()).entries.get(worker_id or "")
            if entry is None:
                return False
            if entry.member.draining != draining:
                old = entry.member
                entry.member = replace(old, draining=draining)
                self._publish(
                    self._services[service_key], change_type(old, entry.member) or EventType.UPDATED, entry.member
                )
                log.info(kv(event="broker.draining", service=service_key, worker=old.worker_id, draining=draining))
            return True

    def deregister(self, service_key: str, lease_id: str) -> bool:
        with self._lock:
            entry = self._entry_by_lease(service_key, lease_id)
            if entry is None:
                return False
            self._drop(service_key, entry, why="deregistered")
            return True

    def expire(self) -> list[Member]:
        """Remove every member whose lease ran out; hand pending watchers their SYNCED."""
        now = self._clock()
        gone: list[Member] = []
        with self._lock:
            for key, svc in self._services.items():
                for entry in [e for e in svc.entries.values() if e.deadline <= now]:
                    self._drop(key, entry, why="lease expired")
                    gone.append(entry.member)
                if now >= self._synced_after:
                    for sub in svc.subscriptions:
                        self._send_synced(svc, sub)
        return gone

    def remove_service(self, service_key: str) -> int:
        """Forget a service: its members go, its watchers end. Returns the members dropped."""
        with self._lock:
            svc = self._services.pop(service_key, None)
        if svc is None:
            return 0
        for sub in svc.subscriptions:
            sub.close(WatchEnded("service_removed", f"service {service_key!r} was removed from the broker"))
        log.info(kv(event="broker.service_removed", service=service_key, members=len(svc.entries)))
        return len(svc.entries)

    def close_all(self, detail: str = "broker is shutting down") -> None:
        with self._lock:
            subs = [s for svc in self._services.values() for s in svc.subscriptions]
        for sub in subs:
            sub.close(WatchEnded("shutdown", detail))

    # --- watching -----------------------------------------------------------------------

    def subscribe(self, service_key: str, roles: Iterable[Role], loop: asyncio.AbstractEventLoop) -> Subscription:
        """A new watcher, its queue already holding the snapshot (and SYNCED unless in the grace)."""
        sub = Subscription(service_key, frozenset(roles), self.queue_size, loop)
        with self._lock:
            svc = self._services.setdefault(service_key, _Service())
            for entry in sorted(svc.entries.values(), key=lambda e: e.member.worker_id):
                if sub.wants(entry.member):
                    sub.offer(MemberEvent(EventType.ADDED, entry.member, svc.revision), force=True)
            if self._clock() >= self._synced_after:
                self._send_synced(svc, sub)
            svc.subscriptions.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            svc = self._services.get(sub.service_key)
            if svc is not None:
                svc.subscriptions.discard(sub)

    # --- reading ------------------------------------------------------------------------

    def members(self, service_key: str, roles: Iterable[Role] = ()) -> list[Member]:
        wanted = frozenset(roles)
        with self._lock:
            svc = self._services.get(service_key)
            entries = list(svc.entries.values()) if svc else []
        return sorted((e.member for e in entries if not wanted or e.member.role in wanted), key=lambda m: m.worker_id)

    def revision(self, service_key: str) -> int:
        with self._lock:
            svc = self._services.get(service_key)
            return svc.revision if svc else 0

    def registered_counts(self, service_key: str) -> dict[Role, int]:
        """Members per role, every role present (0 when none): the operator's status counts."""
        counts = {role: 0 for role in Role}
        for member in self.members(service_key):
            counts[member.role] += 1
        return counts

    def kv_tokens_in_use(self, service_key: str) -> int:
        """KV tokens the service's decodes last reported in use (a layer-sharded group once,
        by its leader): the operator's status."""
        return sum(m.load.kv_tokens_used for m in self.members(service_key) if m.role is Role.DECODE)

    def services(self) -> list[str]:
        with self._lock:
            return sorted(self._services)

    # --- internals (lock held) ----------------------------------------------------------

    def _entry_by_lease(self, service_key: str, lease_id: str) -> _Entry | None:
        svc = self._services.get(service_key)
        worker_id = svc.leases.get(lease_id) if svc else None
        return svc.entries.get(worker_id) if svc and worker_id else None

    def _drop(self, service_key: str, entry: _Entry, *, why: str) -> None:
        svc = self._services[service_key]
        svc.entries.pop(entry.member.worker_id, None)
        svc.leases.pop(entry.lease_id, None)
        self._publish(svc, EventType.REMOVED, entry.member)
        log.info(
            kv(
                event="broker.remove",
                service=service_key,
                worker=entry.member.worker_id,
                role=entry.member.role,
                why=why,
            )
        )

    def _publish(self, svc: _Service, kind: EventType, member: Member) -> None:
        svc.revision += 1
        event = MemberEvent(kind, member, svc.revision)
        for sub in list(svc.subscriptions):
            if sub.closed:
                svc.subscriptions.discard(sub)
            elif sub.wants(member):
                sub.offer(event)

    def _send_synced(self, svc: _Service, sub: Subscription) -> None:
        if sub.pending_sync:
            sub.pending_sync = False
            sub.offer(MemberEvent(EventType.SYNCED, None, svc.revision), force=True)
