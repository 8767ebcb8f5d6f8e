"""The router's grammar compiler (api/grammar_compiler.py, issue #58 A1): off the event loop,
a budget per request, compile seconds per tenant, one compile at a time per tenant, a bounded
queue and a cache of grammars and refusals."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pdserve_worker.api.backend import NoCapacity
from pdserve_worker.api.grammar_compiler import BudgetSpent, FieldGrammarError, GrammarCompiler, GrammarLimits
from pdserve_worker.model.sampling import grammar as grammars


def slow_schema(salt: str) -> dict:
    """Small (1.6 KB) and slow to compile: six anyOf of four objects under one allOf (llguidance
    intersects them; 0.35-0.8 s on a 2-vCPU EPYC, 2026-12-07)."""
    return {
        "allOf": [
            {"anyOf": [{"type": "object", "properties": {f"{salt}a{i}{j}": {"type": "integer"}}} for j in range(4)]}
            for i in range(6)
        ]
    }


def asks(*values: object) -> list[grammars.Ask]:
    return [grammars.ask("json_schema", v, f"tools[{i}].function.parameters") for i, v in enumerate(values)]


class Clocked:
    """compile_one that takes `seconds` of a fake clock per call (and records its calls and overlap)."""

    def __init__(self, seconds: float) -> None:
        self.now = 0.0
        self.seconds = seconds
        self.calls: list[str] = []
        self.running = 0
        self.most = 0
        self._lock = threading.Lock()

    def clock(self) -> float:
        return self.now

    def __call__(self, asked: grammars.Ask) -> str:
        with self._lock:
            self.running += 1
            self.most = max(self.most, self.running)
        time.sleep(0.02)
        with self._lock:
            self.running -= 1
            self.now += self.seconds
            self.calls.append(asked.field)
        return grammars.to_grammar(asked)


def test_a_slow_schema_compiles_off_the_event_loop():
    compiler = GrammarCompiler()

    async def main() -> tuple[list[str], float]:
        gaps = []

        async def ticker() -> None:
            last = time.perf_counter()
            while True:
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        task = asyncio.create_task(ticker())
        started = time.perf_counter()
        out = await compiler.compile(asks(slow_schema("x")), "t")
        took = time.perf_counter() - started
        task.cancel()
        assert took > 0.1, f"the schema compiled in {took:.3f} s: not a slow one on this CPU"
        return out, max(gaps)

    [grammar], worst_gap = asyncio.run(main())
    assert grammar == grammars.build("json_schema", slow_schema("x"))
    assert worst_gap < 0.1, f"the event loop stalled {worst_gap:.3f} s while compiling"


def test_a_request_past_its_budget_is_refused_naming_the_budget_and_the_field():
    fake = Clocked(seconds=0.8)
    compiler = GrammarCompiler(GrammarLimits(request_budget_s=2.0), clock=fake.clock, compile_one=fake)
    schemas = [{"type": "object", "properties": {f"p{i}": {"type": "integer"}}} for i in range(10)]
    with pytest.raises(BudgetSpent) as caught:
        asyncio.run(compiler.compile(asks(*schemas), "t"))
    # 0.8 + 0.8 + 0.8 = 2.4 s spent after the third: the fourth is not compiled
    assert len(fake.calls) == 3
    assert caught.value.status == 400 and caught.value.field == "tools[3].function.parameters"
    assert "budget of 2 s" in str(caught.value)


def test_a_tenants_compile_seconds_run_out_then_refill_and_other_tenants_are_untouched():
    fake = Clocked(seconds=4.0)
    limits = GrammarLimits(request_budget_s=100.0, tenant_seconds_per_minute=6.0)
    compiler = GrammarCompiler(limits, clock=fake.clock, compile_one=fake)
    one = [{"type": "object", "properties": {f"q{i}": {"type": "integer"}}} for i in range(3)]
    asyncio.run(compiler.compile(asks(one[0]), "greedy"))  # at t=4: 6 - 4 = 2 s left
    asyncio.run(compiler.compile(asks(one[1]), "greedy"))  # at t=8: 2 + 0.4 refilled - 4 = -1.6
    with pytest.raises(BudgetSpent) as caught:
        asyncio.run(compiler.compile(asks(one[2]), "greedy"))
    assert caught.value.status == 429 and caught.value.retry_after_s == pytest.approx(16.0)  # 1.6 s at 0.1 s/s
    assert "'greedy' spent its grammar compile time of 6 s per minute" in str(caught.value)
    asyncio.run(compiler.compile(asks(one[2]), "other"))  # another tenant compiles at once
    fake.now += 21.0
    asyncio.run(compiler.compile(asks({"type": "string"}), "greedy"))  # refilled
    assert len(fake.calls) == 4


def test_grammars_and_refusals_are_cached_by_what_was_asked():
    fake = Clocked(seconds=0.1)
    compiler = GrammarCompiler(clock=fake.clock, compile_one=fake)
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    first = asyncio.run(compiler.compile(asks(schema), "a"))
    again = asyncio.run(compiler.compile(asks(dict(schema)), "b"))
    assert first == again and compiler.compiled == 1
    for _ in range(2):
        with pytest.raises(FieldGrammarError, match="objectx") as caught:
            asyncio.run(compiler.compile(asks(schema, {"type": "objectx"}), "a"))
        assert caught.value.field == "tools[1].function.parameters"
    assert compiler.compiled == 2  # the refusal was compiled once too


def test_the_cache_is_bounded_in_entries():
    compiler = GrammarCompiler(GrammarLimits(cache_entries=3))
    for i in range(5):
        asyncio.run(compiler.compile(asks({"type": "object", "properties": {f"k{i}": {"type": "string"}}}), "a"))
    assert compiler.compiled == 5 and len(compiler._cache) == 3
    asyncio.run(compiler.compile(asks({"type": "object", "properties": {"k0": {"type": "string"}}}), "a"))
    assert compiler.compiled == 6  # the oldest had been dropped


def test_one_tenant_compiles_one_at_a_time_and_the_queue_is_bounded():
    fake = Clocked(seconds=0.0)
    compiler = GrammarCompiler(GrammarLimits(threads=2, queue=4), clock=fake.clock, compile_one=fake)

    async def many(tenant: str, n: int) -> list[object]:
        calls = [
            compiler.compile(asks({"type": "object", "properties": {f"{tenant}{i}": {"type": "string"}}}), tenant)
            for i in range(n)
        ]
        return await asyncio.gather(*calls, return_exceptions=True)

    results = asyncio.run(many("solo", 4))
    assert all(isinstance(r, list) for r in results) and fake.most == 1
    results = asyncio.run(many("flood", 6))
    busy = [r for r in results if isinstance(r, NoCapacity)]
    assert len(busy) == 2 and "4 compiles in progress" in str(busy[0])
    assert compiler.in_progress == 0 and not compiler._tenant_locks  # every path released what it held


def test_limits_are_checked():
    with pytest.raises(ValueError, match="threads >= 1"):
        GrammarLimits(threads=0)
    with pytest.raises(ValueError, match="budgets must be positive"):
        GrammarLimits(request_budget_s=0)
