"""Grammar compiling off the router's event loop: bounded, budgeted per request, charged per tenant, cached.

A structured-output field or a tool's `parameters` schema becomes an llguidance grammar
(model/sampling/grammar.py). Compiling one costs up to about half a second of CPU, and a chat
request may carry 128 tool schemas (one such held the event loop for 49 s, #58 A1). So here:
- compiles run in a few worker threads (llguidance releases the GIL while it compiles, so the
  loop keeps serving), and past a bound of compiles waiting the request is a 429;
- a tenant compiles one grammar at a time, so one tenant holds at most one thread;
- a request's compiles share a budget of seconds, checked before each one (a compile cannot be
  interrupted); past it the request is a 400 naming the budget;
- compile time is taken from the tenant's bucket of compile seconds per minute (refused
  compiles too: a 400 is no free retry); an empty bucket is a 429 with Retry-After;
- results, grammars and refusals alike, are kept by the SHA-256 of what was asked (bounded
  LRU): an agent that sends the same tools every turn compiles them once.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import anyio

from pdserve_worker.api.admission import TokenBucket
from pdserve_worker.api.backend import Backend, NoCapacity
from pdserve_worker.model.sampling import grammar as grammars
from pdserve_worker.model.sampling.grammar import Ask, GrammarError

BUSY_RETRY_S = 1.0


@dataclass(frozen=True)
class GrammarLimits:
    """What compiling may cost the router (README "Limits")."""

    threads: int = 2  # compiles running at once
    queue: int = 64  # compiles running or waiting; past it, 429
    request_budget_s: float = 2.0  # one request's compiles together
    tenant_seconds_per_minute: float = 30.0  # one tenant's compiles, on this router
    cache_entries: int = 1024
    cache_chars: int = 16 << 20  # grammars' and refusals' characters kept

    def __post_init__(self) -> None:
        if self.threads < 1 or self.queue < self.threads:
            raise ValueError(f"need threads >= 1 and queue >= threads, got threads={self.threads} queue={self.queue}")
        if self.request_budget_s <= 0 or self.tenant_seconds_per_minute <= 0:
            raise ValueError(
                f"grammar budgets must be positive, got request_budget_s={self.request_budget_s} "
                f"tenant_seconds_per_minute={self.tenant_seconds_per_minute}"
            )


class BudgetSpent(Exception):
    """A request (status 400) or its tenant (429, with `retry_after_s`) is out of compile time."""

    def __init__(self, status: int, message: str, field: str, retry_after_s: float = 0.0) -> None:
        super().__init__(message)
        self.status, self.field, self.retry_after_s = status, field, retry_after_s


class FieldGrammarError(GrammarError):
    """A GrammarError with the request field it is about."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


class _Cache:
    """LRU of key -> (grammar or None, refusal or None), bounded in entries and characters."""

    def __init__(self, entries: int, chars: int) -> None:
        self._items: OrderedDict[str, tuple[str | None, str | None]] = OrderedDict()
        self._entries, self._chars, self.chars = entries, chars, 0

    def get(self, key: str) -> tuple[str | None, str | None] | None:
        found = self._items.get(key)
        if found is not None:
            self._items.move_to_end(key)
        return found

    def put(self, key: str, value: tuple[str | None, str | None]) -> None:
        size = len(value[0] or value[1] or "")
        if size > self._chars or key in self._items:
            return
        self._items[key] = value
        self.chars += size
        while len(self._items) > self._entries or self.chars > self._chars:
            _, (grammar, refusal) = self._items.popitem(last=False)
            self.chars -= len(grammar or refusal or "")

    def __len__(self) -> int:
        return len(self._items)


class GrammarCompiler:
    """Compiles a request's grammars (see the module doc); one per router."""

    def __init__(
        self,
        limits: GrammarLimits = GrammarLimits(),
        clock: Callable[[], float] = time.monotonic,
        compile_one: Callable[[Ask], str] = grammars.to_grammar,
    ) -> None:
        self.limits = limits
        self._clock = clock
        self._compile = compile_one
        self._threads = anyio.CapacityLimiter(limits.threads)
        self._cache = _Cache(limits.cache_entries, limits.cache_chars)
        self._buckets: dict[str, TokenBucket] = {}
        self._tenant_locks: dict[str, tuple[anyio.Lock, int]] = {}  # (lock, users)
        self.in_progress = 0
        self.compiled = 0  # compiles run (cache misses)

    async def compile(self, asks: Sequence[Ask], tenant: str) -> list[str]:
        """Each ask's grammar, in order; FieldGrammarError for one llguidance refuses,
        BudgetSpent past a budget, NoCapacity when too many compiles wait."""
        spent = 0.0
        out = []
        for asked in asks:
            grammar, took = await self._one(asked, tenant, self.limits.request_budget_s - spent)
            spent += took
            out.append(grammar)
        return out

    async def _one(self, asked: Ask, tenant: str, budget_left: float) -> tuple[str, float]:
        key = asked.key
        found = self._cache.get(key)
        if found is None:
            if budget_left <= 0:
                raise BudgetSpent(
                    400,
                    f"compiling this request's grammars took more than its budget of "
                    f"{self.limits.request_budget_s:g} s; {asked.field} was not compiled: send fewer or simpler schemas",
                    asked.field,
                )
            found, took = await self._compile_for(asked, key, tenant)
        else:
            took = 0.0
        grammar, refusal = found
        if refusal is not None:
            raise FieldGrammarError(refusal, asked.field)
        assert grammar is not None
        return grammar, took

    async def _compile_for(self, asked: Ask, key: str, tenant: str) -> tuple[tuple[str | None, str | None], float]:
        if self.in_progress >= self.limits.queue:
            raise NoCapacity(BUSY_RETRY_S, f"grammar compiler busy: {self.in_progress} compiles in progress")
        self.in_progress += 1
        lock = self._enter(tenant)
        try:
            async with lock:  # one compile at a time per tenant
                found = self._cache.get(key)  # (another request of the tenant may have compiled it meanwhile)
                if found is not None:
                    return found, 0.0
                bucket = self._bucket(tenant)
                wait = bucket.wait_s(0.0, self._clock())
                if wait > 0:
                    raise BudgetSpent(
                        429,
                        f"tenant {tenant!r} spent its grammar compile time of "
                        f"{self.limits.tenant_seconds_per_minute:g} s per minute; retry in {wait:.1f} s",
                        asked.field,
                        wait,
                    )
                result, took = await anyio.to_thread.run_sync(self._run, asked, limiter=self._threads)
                bucket.take(took, self._clock())
                self.compiled += 1
                self._cache.put(key, result)
                return result, took
        finally:
            self._leave(tenant)
            self.in_progress -= 1

    def _run(self, asked: Ask) -> tuple[tuple[str | None, str | None], float]:
        """(grammar or refusal) and the seconds the compile itself took, timed in its thread: a
        wait for a free thread (other tenants' compiles) is charged to nobody."""
        started = self._clock()
        try:
            found: tuple[str | None, str | None] = (self._compile(asked), None)
        except GrammarError as exc:
            found = (None, str(exc))
        return found, max(0.0, self._clock() - started)

    def _bucket(self, tenant: str) -> TokenBucket:
        bucket = self._buckets.get(tenant)
        if bucket is None:  # (one per tenant of the key file, and the anonymous one: bounded)
            bucket = self._buckets[tenant] = TokenBucket(self.limits.tenant_seconds_per_minute, self._clock())
        return bucket

    def _enter(self, tenant: str) -> anyio.Lock:
        lock, users = self._tenant_locks.get(tenant, (None, 0))
        if lock is None:
            lock = anyio.Lock()
        self._tenant_locks[tenant] = (lock, users + 1)
        return lock

    def _leave(self, tenant: str) -> None:
        lock, users = self._tenant_locks[tenant]
        if users <= 1:
            del self._tenant_locks[tenant]  # no lock kept for a tenant with nothing compiling
        else:
            self._tenant_locks[tenant] = (lock, users - 1)


def grammar_check(backend: Backend) -> Callable[[Ask], str]:
    """How the router compiles for `backend`: with its model's tokenizer where it holds one
    (`Backend.grammar_tokenizer`, built on first use in a compile thread), so a grammar the
    workers' matcher would refuse is a 400 here, before a slot is reserved."""
    build = backend.grammar_tokenizer
    if build is None:
        return grammars.to_grammar
    return lambda asked: grammars.to_grammar(asked, build())
