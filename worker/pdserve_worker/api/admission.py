"""The router's admission queue: who gets the next KV reservation, and who is told to come back.

A request enters with its tenant (from its API key), a priority class and a deadline, and waits
here until the backend holds capacity for it (a decode slot's reservation), instead of a 429 the
moment every slot is taken. It is refused (`Rejected`: 429 with Retry-After) only when it cannot
be served: the queue or the tenant's share of it is full, the tenant is over its requests/min or
tokens/min, or the deadline cannot be met at the measured drain rate. Order of service
(`_next_ticket`, docs/admission.md): priority classes strictly; within a class, fair across
tenants over tokens (start-time fair queueing); FIFO within a tenant and class.

Every ticket leaves through `release` (called exactly once, however the request ends), which
undoes whatever the ticket held in the state it was in: a place in the queue, a probe, a
running request's concurrency. Pure asyncio, no I/O, no HTTP: the router maps `Rejected` to its
429 (api/intake.py).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from pdserve_worker.api.keys import PRIORITIES, Priority, Tenant, TenantLimits

INF = math.inf


@dataclass(frozen=True)
class AdmissionConfig:
    capacity: int = 1024  # requests waiting, all classes and tenants together
    max_queued_per_tenant: int = 256  # one tenant's share of the queue
    deadline_s: float = 60.0  # longest a request waits for admission; a header may shorten it
    retry_min_s: float = 0.02  # a blocked queue's probe timer, doubling up to retry_max_s
    retry_max_s: float = 0.5
    drain_window_s: float = 30.0  # admissions counted for the drain rate
    replicas: int = 1  # routers sharing the tenants' limits: each enforces 1/replicas

    def __post_init__(self) -> None:
        if self.capacity < 1 or self.max_queued_per_tenant < 1:
            raise ValueError(
                f"admission capacity {self.capacity} and per-tenant {self.max_queued_per_tenant} must be at least 1"
            )
        if not self.deadline_s > 0:
            raise ValueError(f"admission deadline must be positive, got {self.deadline_s}")
        if not 0 < self.retry_min_s <= self.retry_max_s:
            raise ValueError(f"retry interval {self.retry_min_s}..{self.retry_max_s} s is not a range")


class Reason(str, Enum):
    """Why a request was refused: the metrics label and the error's `code`."""

    QUEUE_FULL = "queue_full"
    TENANT_QUEUE_FULL = "tenant_queue_full"
    REQUESTS_PER_MINUTE = "requests_per_minute"
    TOKENS_PER_MINUTE = "tokens_per_minute"
    DEADLINE = "deadline"


class Rejected(Exception):
    """A request the queue will not serve; `retry_after_s` is when trying again makes sense."""

    def __init__(self, reason: Reason, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s


class Observer(Protocol):
    """What the queue reports (router.metrics.RouterMetrics implements it)."""

    def observe_admission_rejected(self, reason: str) -> None: ...
    def observe_admission_wait(self, priority: str, seconds: float) -> None: ...
    def observe_tenant_tokens(self, tenant: str, prompt: int, completion: int) -> None: ...


class TokenBucket:
    """`per_minute` units refilled continuously, at most `per_minute` stored. The level may go
    below zero (a request reserving more than a minute's budget, taken when the bucket was
    full), and a debt holds the tenant's next requests until it is refilled."""

    def __init__(self, per_minute: float, now: float) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = self.capacity
        self._updated = now

    def _refill(self, now: float) -> None:
        if now > self._updated:
            self.level = min(self.capacity, self.level + (now - self._updated) * self.rate)
            self._updated = now

    def wait_s(self, amount: float, now: float) -> float:
        """Seconds until `amount` can be taken (0: now; inf: never, it exceeds the capacity)."""
        self._refill(now)
        if amount > self.capacity:
            return INF
        return max(0.0, (amount - self.level) / self.rate)

    def take(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level -= amount

    def give(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level = min(self.capacity, self.level + amount)


class DrainRate:
    """Admissions per second over the last `window_s`, counted up to now: a queue that stopped
    draining shows a falling rate instead of keeping the last good one."""

    MIN_SAMPLES = 3

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._times: deque[float] = deque(maxlen=4096)

    def record(self, now: float) -> None:
        self._times.append(now)

    def per_second(self, now: float) -> float | None:
        while self._times and self._times[0] < now - self.window_s:
            self._times.popleft()
        if len(self._times) < self.MIN_SAMPLES:
            return None
        span = now - self._times[0]
        return len(self._times) / span if span > 0 else None


class State(str, Enum):
    WAITING = "waiting"  # in the queue
    TRYING = "trying"  # dispatched: reserving
    HELD = "held"  # the backend holds capacity: running
    DONE = "done"


@dataclass(eq=False)
class Ticket:
    """One request's passage through admission."""

    tenant: _TenantState
    priority: int  # index into PRIORITIES
    prompt_tokens: int
    max_tokens: int
    deadline: float
    enqueued: float
    seq: int
    state: State = State.WAITING
    turn: asyncio.Future[None] | None = None
    held_at: float | None = None
    charged: bool = False  # rate-limit buckets were charged (refunded if never admitted)
    grammar: bool = False  # structured outputs: counted against the tenant's maxConcurrentGrammars

    @property
    def cost(self) -> int:
        return self.prompt_tokens + self.max_tokens

    @property
    def priority_name(self) -> Priority:
        return PRIORITIES[self.priority]

    @property
    def tenant_name(self) -> str:
        return self.tenant.name


@dataclass(eq=False)
class _TenantState:
    name: str
    limits: TenantLimits
    requests: TokenBucket | None
    tokens: TokenBucket | None
    active: int = 0  # trying + held
    grammars: int = 0  # of those, with a grammar
    queued: dict[int, deque[Ticket]] = field(default_factory=dict)  # per class, FIFO
    finish: list[float] = field(default_factory=lambda: [0.0] * len(PRIORITIES))  # SFQ finish tag per class

    def waiting(self) -> int:
        return sum(len(q) for q in self.queued.values())

    def eligible(self, head: Ticket) -> bool:
        """May `head`, the tenant's next ticket, be dispatched: under maxConcurrent, and with a
        grammar, under maxConcurrentGrammars (its later tickets wait behind it: FIFO)."""
        cap, grammars = self.limits.max_concurrent, self.limits.max_concurrent_grammars
        if cap is not None and self.active >= cap:
            return False
        return not head.grammar or grammars is None or self.grammars < grammars

    def activate(self, ticket: Ticket, by: int) -> None:
        """`ticket` starts (+1) or stops (-1) holding the tenant's concurrency."""
        self.active += by
        self.grammars += by if ticket.grammar else 0


class AdmissionQueue:
    """One per router process, used from its event loop only.

    How capacity is found: the queue does not know how many slots exist (other routers share the
    decodes, decodes join and leave). While nothing waits, a request is dispatched at once. The
    first one that finds no slot (`no_capacity`) turns the queue *blocked*: from then on one
    request at a time (the *probe*, the one `_next_ticket` picks) tries to reserve, when a
    request of this router ends, when the previous probe got a slot, or on a timer with backoff
    (slots freed by other routers). So a full service costs one failed Reserve per event, not
    one per waiting request. The queue opens again when capacity moves and nothing waits.
    """

    def __init__(
        self,
        config: AdmissionConfig = AdmissionConfig(),
        observer: Observer | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._observer = observer
        self._clock = clock
        self._tenants: dict[str, _TenantState] = {}
        self._vtime = [0.0] * len(PRIORITIES)  # per class: start tag of the last admitted request
        self._waiting = [0] * len(PRIORITIES)
        self._running = 0
        self._seq = 0
        self._blocked = False
        self._probe: Ticket | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._backoff = config.retry_min_s
        self.drain = DrainRate(config.drain_window_s)

    # ---- entering ---------------------------------------------------------------------------------

    def enter(
        self,
        tenant: Tenant,
        priority: Priority,
        prompt_tokens: int,
        max_tokens: int,
        deadline_s: float | None = None,
        grammar: bool = False,
    ) -> Ticket:
        """A ticket for a request, or `Rejected` at once when it cannot be served.

        `priority` is lowered to the tenant's `maxPriority`; `deadline_s` (from a header) can
        only shorten the configured deadline; `grammar`: the request has structured outputs.
        """
        now = self._clock()
        state = self._tenant(tenant, now)
        rank = max(PRIORITIES.index(priority), PRIORITIES.index(state.limits.max_priority))
        wait_limit = self.config.deadline_s if deadline_s is None else min(deadline_s, self.config.deadline_s)
        total = sum(self._waiting) + (self._probe is not None)  # (the probe is a waiting request)
        if total >= self.config.capacity:
            self._refuse(
                Reason.QUEUE_FULL,
                f"the admission queue is full ({total} requests waiting)",
                self._drain_time(total, now),
            )
        if state.waiting() >= self.config.max_queued_per_tenant:
            self._refuse(
                Reason.TENANT_QUEUE_FULL,
                f"tenant {state.name!r} has {state.waiting()} requests waiting, its most",
                self._drain_time(state.waiting(), now),
            )
        refusal = _rate_refusal(state, prompt_tokens, prompt_tokens + max_tokens, now)
        if refusal is not None:
            self._refuse(refusal.reason, str(refusal), refusal.retry_after_s)
        ahead = _ahead(self._tenants.values(), self._waiting, state, rank)
        estimate = self._estimate(ahead, now)
        if estimate is not None and estimate > wait_limit:
            self._refuse(
                Reason.DEADLINE,
                f"the queue's measured drain rate admits this request in about "
                f"{estimate:.1f} s, later than its deadline of {wait_limit:g} s",
                estimate,
            )
        # Charged now, refunded if the request leaves without being admitted. The tokens
        # charged are the prompt and every token it may generate (a reservation): what it does
        # not generate comes back when it ends (`release`), so a burst cannot take more than
        # the bucket holds, plus the last request's overflow past it.
        if state.requests is not None:
            state.requests.take(1, now)
        if state.tokens is not None:
            state.tokens.take(prompt_tokens + max_tokens, now)
        self._seq += 1
        ticket = Ticket(
            state, rank, prompt_tokens, max_tokens, now + wait_limit, now, self._seq, charged=True, grammar=grammar
        )
        ticket.turn = asyncio.get_running_loop().create_future()
        state.queued.setdefault(rank, deque()).append(ticket)
        self._waiting[rank] += 1
        self._pump()
        return ticket

    def _tenant(self, tenant: Tenant, now: float) -> _TenantState:
        limits = tenant.limits.per_replica(self.config.replicas)
        state = self._tenants.get(tenant.name)
        if state is None or state.limits != limits:  # new, or its limits changed in the keys file
            requests = None if limits.requests_per_minute is None else TokenBucket(limits.requests_per_minute, now)
            tokens = None if limits.tokens_per_minute is None else TokenBucket(limits.tokens_per_minute, now)
            if state is None:
                state = self._tenants[tenant.name] = _TenantState(tenant.name, limits, requests, tokens)
            else:
                state.limits, state.requests, state.tokens = limits, requests, tokens
        return state

    def _refuse(self, reason: Reason, message: str, retry_after_s: float) -> None:
        if self._observer is not None:
            self._observer.observe_admission_rejected(reason.value)
        raise Rejected(reason, message, retry_after_s)

    def _estimate(self, ahead: int, now: float) -> float | None:
        rate = self.drain.per_second(now)
        if rate is None or ahead == 0:
            return None
        return ahead / rate

    def _drain_time(self, count: int, now: float) -> float:
        estimate = self._estimate(count, now)
        return 1.0 if estimate is None else estimate

    # ---- waiting ----------------------------------------------------------------------------------

    async def wait_turn(self, ticket: Ticket) -> None:
        """Until `ticket` is dispatched (then the caller reserves). `Rejected` at its deadline;
        cancellation (the client left) leaves the caller to `release` it."""
        if ticket.state is State.TRYING:
            return  # dispatched already
        if ticket.state is not State.WAITING:
            raise RuntimeError(f"ticket in state {ticket.state.value} cannot wait")
        assert ticket.turn is not None
        if not ticket.turn.done():
            try:
                async with asyncio.timeout_at(_loop_time(ticket.deadline, self._clock)):
                    await asyncio.shield(ticket.turn)
            except TimeoutError:
                if ticket.state is State.WAITING:
                    self._unqueue(ticket)
                    ticket.state = State.DONE
                    self._refund(ticket)
                    self._pump()
                    waited = self._clock() - ticket.enqueued
                    self._refuse(
                        Reason.DEADLINE,
                        f"the request waited {waited:.1f} s for admission, its deadline",
                        self._drain_time(sum(self._waiting), self._clock()),
                    )
                # dispatched at the very moment the deadline passed: it goes on
        ticket.turn = None

    def held(self, ticket: Ticket) -> None:
        """The backend holds capacity for `ticket`: it runs (idempotent)."""
        if ticket.state is not State.TRYING:
            return
        now = self._clock()
        ticket.state = State.HELD
        ticket.held_at = now
        self._running += 1
        self.drain.record(now)
        # Start-time fair queueing: the tenant's tag advances by the request's tokens / weight.
        state, rank = ticket.tenant, ticket.priority
        start = max(state.finish[rank], self._vtime[rank])
        state.finish[rank] = start + ticket.cost / state.limits.weight
        self._vtime[rank] = start
        if self._observer is not None:
            self._observer.observe_admission_wait(ticket.priority_name, now - ticket.enqueued)
        if ticket is self._probe:
            self._probe = None
            self._backoff = self.config.retry_min_s
            self._pump(may_probe=True)  # room for one: maybe for more

    def no_capacity(self, ticket: Ticket) -> None:
        """The backend found no free slot for `ticket`: it waits again, at its place."""
        if ticket.state is not State.TRYING:
            return
        ticket.state = State.WAITING
        ticket.tenant.activate(ticket, -1)
        queue = ticket.tenant.queued.setdefault(ticket.priority, deque())
        queue.appendleft(ticket)  # it was its tenant's oldest in its class
        self._waiting[ticket.priority] += 1
        ticket.turn = asyncio.get_running_loop().create_future()
        self._blocked = True
        if ticket is self._probe:
            self._probe = None
            self._backoff = min(self._backoff * 2, self.config.retry_max_s)
        self._pump()

    def release(self, ticket: Ticket, completion_tokens: int = 0) -> None:
        """The one way out of admission, whatever state the ticket is in (called exactly once)."""
        state = ticket.state
        ticket.state = State.DONE
        if state is State.WAITING:
            self._unqueue(ticket)
            self._refund(ticket)
        elif state is State.TRYING:
            ticket.tenant.activate(ticket, -1)
            self._refund(ticket)
            if ticket is self._probe:
                self._probe = None
        elif state is State.HELD:
            ticket.tenant.activate(ticket, -1)
            self._running -= 1
            tenant, now = ticket.tenant, self._clock()
            unused = max(ticket.max_tokens - completion_tokens, 0)
            if tenant.tokens is not None:  # the reservation's tokens it did not generate
                tenant.tokens.give(unused, now)
            tenant.finish[ticket.priority] -= unused / tenant.limits.weight
            if self._observer is not None:
                self._observer.observe_tenant_tokens(tenant.name, ticket.prompt_tokens, completion_tokens)
            self._backoff = self.config.retry_min_s
            self._pump(may_probe=True)  # a slot of ours came free
            return
        else:
            return
        self._pump()

    def _refund(self, ticket: Ticket) -> None:
        if not ticket.charged:
            return
        ticket.charged = False
        now = self._clock()
        if ticket.tenant.requests is not None:
            ticket.tenant.requests.give(1, now)
        if ticket.tenant.tokens is not None:
            ticket.tenant.tokens.give(ticket.cost, now)

    def _unqueue(self, ticket: Ticket) -> None:
        queue = ticket.tenant.queued.get(ticket.priority)
        if queue is not None:
            try:
                queue.remove(ticket)
            except ValueError:
                return
            self._waiting[ticket.priority] -= 1
        if ticket.turn is not None and not ticket.turn.done():
            ticket.turn.cancel()

    # ---- dispatching ------------------------------------------------------------------------------

    def _dispatch(self, ticket: Ticket) -> None:
        ticket.tenant.queued[ticket.priority].popleft()
        self._waiting[ticket.priority] -= 1
        ticket.state = State.TRYING
        ticket.tenant.activate(ticket, 1)
        if ticket.turn is not None and not ticket.turn.done():
            ticket.turn.set_result(None)

    def _pump(self, may_probe: bool = False) -> None:
        if not self._blocked:
            while (ticket := _next_ticket(self._tenants.values(), self._waiting, self._vtime)) is not None:
                self._dispatch(ticket)
        elif may_probe and self._probe is None:
            ticket = _next_ticket(self._tenants.values(), self._waiting, self._vtime)
            if ticket is not None:
                self._probe = ticket
                self._dispatch(ticket)
        if may_probe and sum(self._waiting) == 0 and self._probe is None:
            # Capacity moved and nothing waits: the next request tries at once. (Requests that
            # merely left, by deadline or disconnect, free no slot: the queue stays blocked.)
            self._blocked = False
        self._arm_timer()

    def _arm_timer(self) -> None:
        """A blocked queue with waiting requests and no probe out always has a timer pending:
        slots freed elsewhere (other routers, new decodes) are found without an event of ours."""
        needed = self._blocked and self._probe is None and sum(self._waiting) > 0
        if needed and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._backoff, self._on_timer)
        elif not needed and self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timer(self) -> None:
        self._timer = None
        self._pump(may_probe=True)

    # ---- reading ----------------------------------------------------------------------------------

    def waiting(self, priority: Priority | None = None) -> int:
        if priority is None:
            return sum(self._waiting)
        return self._waiting[PRIORITIES.index(priority)]

    @property
    def running(self) -> int:
        return self._running

    def snapshot(self) -> dict[str, object]:
        """For /health: counts only (tenant names are not for unauthenticated readers)."""
        rate = self.drain.per_second(self._clock())
        return {
            "waiting": {name: self._waiting[i] for i, name in enumerate(PRIORITIES)},
            "running": self._running,
            "grammars_running": sum(t.grammars for t in self._tenants.values()),
            "blocked": self._blocked,
            "drain_per_s": None if rate is None else round(rate, 3),
            "capacity": self.config.capacity,
        }


def _rate_refusal(state: _TenantState, prompt_tokens: int, reserve: int, now: float) -> Rejected | None:
    """`reserve`: prompt plus max_tokens. One bigger than a minute's budget goes when the
    bucket is full (it may overdraw it once); a prompt alone bigger than that never goes."""
    if state.requests is not None:
        wait = state.requests.wait_s(1, now)
        if wait > 0:
            return Rejected(
                Reason.REQUESTS_PER_MINUTE,
                f"tenant {state.name!r} is over its limit of {state.limits.requests_per_minute} requests per minute",
                wait,
            )
    if state.tokens is not None:
        if state.tokens.wait_s(max(prompt_tokens, 1), now) == INF:
            return Rejected(
                Reason.TOKENS_PER_MINUTE,
                f"the prompt's {prompt_tokens} tokens are more than tenant "
                f"{state.name!r}'s limit of {state.limits.tokens_per_minute} tokens per minute",
                60.0,
            )
        wait = state.tokens.wait_s(min(max(reserve, 1), state.tokens.capacity), now)
        if wait > 0:
            return Rejected(
                Reason.TOKENS_PER_MINUTE,
                f"tenant {state.name!r} is over its limit of {state.limits.tokens_per_minute} tokens per minute",
                wait,
            )
    return None


def _ahead(tenants: Iterable[_TenantState], waiting: list[int], state: _TenantState, rank: int) -> int:
    """Requests likely served before a new one of `state` in class `rank`: every waiting one of
    a higher class, and in its own class, fair shares: each other tenant gets about as many
    turns as this tenant has requests before the new one."""
    higher = sum(waiting[:rank])
    own = len(state.queued.get(rank, ()))
    same = sum(min(len(t.queued.get(rank, ())), own + 1) for t in tenants if t is not state)
    return higher + own + same


def _next_ticket(tenants: Iterable[_TenantState], waiting: list[int], vtime: list[float]) -> Ticket | None:
    """The next ticket by class, then a tenant under its share of the running requests
    (`_over_share`), then the smallest SFQ start tag, then arrival."""
    over = _over_share(tenants)
    for rank in range(len(PRIORITIES)):
        if not waiting[rank]:
            continue
        best: tuple[bool, float, int, Ticket] | None = None
        for tenant in tenants:
            queue = tenant.queued.get(rank)
            if not queue or not tenant.eligible(queue[0]):
                continue
            tag = max(tenant.finish[rank], vtime[rank])
            key = (tenant.name in over, tag, queue[0].seq, queue[0])
            if best is None or key[:3] < best[:3]:
                best = key
        if best is not None:
            return best[3]
    return None


def _over_share(tenants: Iterable[_TenantState]) -> set[str]:
    """Tenants without a maxConcurrent of their own that hold at least their weighted share
    of the requests running here while another tenant has requests too: the share is
    `maxConcurrent`'s default. Work-conserving — such a tenant still goes next when nobody
    under their share waits — so one tenant cannot keep every slot it grabbed while the
    others were idle (docs/admission.md)."""
    contending = [t for t in tenants if t.active or t.waiting()]
    if len(contending) < 2:
        return set()
    running = sum(t.active for t in contending)
    weights = sum(t.limits.weight for t in contending)
    return {
        t.name
        for t in contending
        if t.limits.max_concurrent is None and t.active >= max(1, math.ceil(running * t.limits.weight / weights))
    }


def _loop_time(deadline: float, clock: Callable[[], float]) -> float:
    """`deadline` on `clock` as the event loop's time (they are both monotonic, maybe not the same)."""
    loop = asyncio.get_running_loop()
    return loop.time() + (deadline - clock())
