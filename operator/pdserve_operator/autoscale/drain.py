"""A decode scale-down drains first, the autoscaler's and a manual one alike.

The decode groups that go (the highest ordinals, which a StatefulSet removes first) are marked
draining in the broker, so routers place nothing new there; each decode, seeing the mark in its
keepalive reply, hands its requests over to the others (docs/migration.md) and reports how many
moved in its load. Only when their running requests and held slots are 0, or
`decode.drainTimeoutSeconds` passed, is the workload lowered: one `DecodeDrained` Event per decode
says what its drain did, and `status.lastDrain` holds the sums. A scale-down without the
autoscaler (`kubectl scale`, an edited spec.decode.replicas) takes the same path (`manual_decode`).
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pdserve_common.logs import kv
from pdserve_operator import events as ev
from pdserve_operator import spec as s
from pdserve_operator.broker.view import BrokerView
from pdserve_operator.reconcile import decode_groups as dg
from pdserve_operator.reconcile.children.meta import Owner

log = logging.getLogger(__name__)

Live = dict[str, Any]
EventFn = Callable[[ev.EventType, str, str], Awaitable[None]]


def utc(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Drain:
    target: int  # decode groups to keep
    victims: tuple[str, ...]  # worker ids of the groups that go
    started: float
    baseline: dict[str, tuple[int, int]] = field(default_factory=dict)  # (migrated, fallbacks) at the mark


@dataclass(frozen=True)
class ScaleDown:
    """One decode scale-down as a step sees it: from `current` groups to `desired`, at `now`."""

    owner: Owner
    spec: s.PDInferenceServiceSpec
    current: int
    desired: int
    now: float
    post_event: EventFn


class DecodeDrains:
    """The drains under way, per service, and the last one each service finished."""

    def __init__(self, broker: BrokerView, clock: Callable[[], float], wall: Callable[[], float]) -> None:
        self.broker = broker
        self.clock = clock
        self.wall = wall
        self.manual: dict[str, Drain] = {}  # decode scale-downs without the autoscaler, draining
        self._last_drain: dict[str, s.DrainStatus] = {}

    def forget(self, key: str) -> None:
        self.manual.pop(key, None)
        self._last_drain.pop(key, None)

    def last_drain(self, key: str) -> s.DrainStatus | None:
        return self._last_drain.get(key)

    async def mark(self, down: ScaleDown, drain: Drain | None) -> Drain:
        """Mark the decode groups that go (the highest ordinals, which a StatefulSet removes
        first) draining: routers place nothing new there and each decode, seeing the mark in its
        keepalive reply, hands its requests over (docs/migration.md). Returns the drain."""
        owner = down.owner
        victims = dg.of(owner.name, down.spec).leader_ids(range(down.desired, down.current))
        if drain is None or drain.target != down.desired:
            if drain is not None:
                await self.undrain(owner, tuple(v for v in drain.victims if v not in victims))
            drain = Drain(down.desired, victims, down.now, self.handovers(owner.key, victims))
            await down.post_event(
                ev.NORMAL,
                "DrainingForScaleDown",
                f"decode {down.current} -> {down.desired}: draining {', '.join(victims)} first",
            )
        for victim in victims:  # every step: a broker restart forgets who was draining
            self.broker.set_draining(owner.key, victim, True)
        return drain

    async def drained(
        self, owner: Owner, drain: Drain, busy: Mapping[str, int], now: float, post_event: EventFn
    ) -> None:
        """The StatefulSet goes down now: one `DecodeDrained` Event per decode with what its
        drain did (from its last reported load, less what it had counted before the mark),
        and the sums in status.lastDrain."""
        seconds = max(0.0, now - drain.started)
        counts = self.handovers(owner.key, drain.victims)
        migrated = failed = 0
        for victim in drain.victims:
            base_m, base_f = drain.baseline.get(victim, (0, 0))
            m, f = counts.get(victim, (base_m, base_f))
            m, f = max(0, m - base_m), max(0, f - base_f)
            migrated, failed = migrated + m, failed + f
            left = f", {busy[victim]} still running (drain timed out)" if victim in busy else ""
            await post_event(
                ev.NORMAL if victim not in busy else ev.WARNING,
                "DecodeDrained",
                f"{victim}: {m} requests migrated, {f} resumed by re-prefill{left}; drained in {seconds:.1f}s",
            )
            log.info(
                kv(
                    event="decode_drained",
                    service=owner.key,
                    decode=victim,
                    migrated=m,
                    failed=f,
                    running=busy.get(victim, 0),
                    seconds=f"{seconds:.2f}",
                )
            )
        self._last_drain[owner.key] = s.DrainStatus(
            decodes=list(drain.victims),
            migrated=migrated,
            failed=failed,
            running=sum(busy.values()),
            seconds=round(seconds, 3),
            time=utc(self.wall()),
        )

    def handovers(self, key: str, victims: tuple[str, ...]) -> dict[str, tuple[int, int]]:
        """(migrated, fallbacks) each registered decode among `victims` reported (cumulative)."""
        members = {m.worker_id: m for m in (self.broker.members(key) or ())}
        return {v: (members[v].load.migrated, members[v].load.migration_fallbacks) for v in victims if v in members}

    async def manual_decode(
        self, owner: Owner, spec: s.PDInferenceServiceSpec, live: Live | None, post_event: EventFn
    ) -> bool:
        """Decode scale-down when no autoscaler drives decode (`kubectl scale pdis`, an edited
        spec.decode.replicas): the same drain-then-lower as the autoscaler's. True when the
        StatefulSet may take the spec's replicas now; False holds them while the groups that go
        drain (until their running requests are 0 or decode.drainTimeoutSeconds passed)."""
        current = dg.of(owner.name, spec).groups(int(((live or {}).get("spec") or {}).get("replicas") or 0))
        desired = spec.decode.replicas
        drain = self.manual.get(owner.key)
        if live is None or desired >= current:
            if drain is not None:  # scaled back up before the drain ended: keep every group
                del self.manual[owner.key]
                await self.undrain(owner, drain.victims)
                await post_event(ev.NORMAL, "ScaleDownCancelled", f"decode stays at {current}: spec asks {desired}")
            return True
        victims = dg.of(owner.name, spec).leader_ids(range(desired, current))
        if drain is None and not self.handovers(owner.key, victims):
            return True  # none of the groups that go is registered: nothing runs there to drain
        now = self.clock()
        down = ScaleDown(owner, spec, current, desired, now, post_event)
        drain = self.manual[owner.key] = await self.mark(down, drain)
        busy = self.busy(owner.key, drain.victims)
        if busy and now - drain.started < spec.decode.drain_timeout_seconds:
            return False
        del self.manual[owner.key]
        await self.drained(owner, drain, busy, now, post_event)
        return True

    def busy(self, key: str, victims: tuple[str, ...]) -> dict[str, int]:
        """Requests still running (or slots held) on the draining decodes; gone ones hold none."""
        members = {m.worker_id: m for m in (self.broker.members(key) or ())}
        busy = {}
        for v in victims:
            m = members.get(v)
            if m is not None and (m.load.active_requests or m.load.slots_used):
                busy[v] = max(m.load.active_requests, m.load.slots_used)
        return busy

    async def undrain(self, owner: Owner, victims: tuple[str, ...]) -> None:
        for victim in victims:
            self.broker.set_draining(owner.key, victim, False)
