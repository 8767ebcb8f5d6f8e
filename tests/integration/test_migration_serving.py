"""Live migration in one process, over real gRPC and the host transfer engine (issue #17): a
broker, two decode workers, a prefill worker and the router's `PDBackend`.

Requests stream on decode-0; decode-0 drains; each request moves to decode-1 with its KV
(no prefill call), and its tokens are exactly those of an undisturbed colocated run (greedy
and seeded sampling), with no token lost or repeated. Where the move cannot happen (no room
on another decode, a push that fails), the request resumes by re-prefilling, with the same
text. decode-0's KV is all free afterwards. `test_migration_processes.py` does the same with
real processes (`pdserve local`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import grpc
import pytest

from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve_common.membership import MemberInfo, Role
from pdserve_worker.api.metrics import RouterMetrics
from pdserve_worker.decode.service import DecodeServicer
from pdserve_worker.decode.worker import DecodeWorker
from pdserve_worker.engines.native import NativeEngine
from pdserve_worker.model.engine import generate
from pdserve_worker.model.sampling.params import SamplingParams
from pdserve_worker.prefill.service import PrefillServicer
from pdserve_worker.prefill.worker import PrefillWorker
from pdserve_worker.router.config import RouterConfig, Timeouts
from pdserve_worker.router.pd_backend import PDBackend
from pdserve_worker.rpc.broker_client import BrokerClient
from pdserve_worker.rpc.trailers import settled_trailer
from support.inprocess_stack import Stack

SVC, TOKEN, REVISION = "test/migrate", "secret-token", "rev-1"
SLOTS, MAX_LEN, MAX_TOKENS = 6, 128, 96
PROMPTS = [
    "The quick brown fox",
    "Paris is the capital of",
    "A language model predicts",
    "Berlin is",
    "Once upon a time",
    "In a galaxy far away",
]


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    from pdserve_worker.model.loading.loader import load_model

    return load_model(str(tiny_model_dir), dtype="float32")


class _SlowSteps:
    """A model whose decode steps take `delay_s` each: streams last long enough to be drained midway."""

    def __init__(self, model, delay_s: float = 0.02) -> None:
        self._model, self._delay_s = model, delay_s

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def decode_step(self, *args, **kwargs):
        time.sleep(self._delay_s)
        return self._model.decode_step(*args, **kwargs)


class CountingPrefill(PrefillServicer):
    calls = 0

    async def Prefill(self, request, context):
        CountingPrefill.calls += 1
        return await super().Prefill(request, context)


@dataclass
class Cluster:
    backend: PDBackend
    decodes: list[DecodeWorker]
    members: list[BrokerClient]
    metrics: RouterMetrics
    stubs: list[worker_pb2_grpc.DecodeStub] = field(default_factory=list)

    async def drain(self, index: int, timeout_s: float = 10.0) -> tuple[bool, float]:
        """What worker_main's drain does: draining in the broker, then the decode's drain."""
        started = time.monotonic()
        await self.members[index].set_draining(True)
        drained = await self.decodes[index].drain(timeout_s)
        return drained, time.monotonic() - started


@asynccontextmanager
async def cluster(
    loaded,
    decode_extra: tuple[dict, ...] = ({}, {}),
    slow: tuple[float, ...] = (0.02, 0.0),
    servicers: tuple[type, ...] = (DecodeServicer, DecodeServicer),
) -> AsyncIterator[Cluster]:
    stack = Stack(SVC, TOKEN, max_len=MAX_LEN, slots=SLOTS)
    try:
        decodes, members, stubs = [], [], []
        for index, (extra, delay, servicer) in enumerate(zip(decode_extra, slow, servicers, strict=True)):
            s = stack.settings("decode", index, transfer_timeout_ms=2000, **extra)
            model = loaded if not delay else dataclasses.replace(loaded, model=_SlowSteps(loaded.model, delay))
            d = stack.worker(DecodeWorker(s, NativeEngine(model), stack.engine(s), REVISION))
            await d.start()
            await stack.serve(
                s.grpc_port, lambda srv, d=d, v=servicer: worker_pb2_grpc.add_DecodeServicer_to_server(v(d), srv)
            )
            members.append(await stack.join(d.member_info(), d.load))
            decodes.append(d)
            stubs.append(worker_pb2_grpc.DecodeStub(stack.channel(s.grpc_endpoint)))
        p = stack.settings("prefill", 0, transfer_timeout_ms=2000)
        prefill = stack.worker(PrefillWorker(p, NativeEngine(loaded), stack.engine(p), REVISION))
        await stack.serve(
            p.grpc_port, lambda srv: worker_pb2_grpc.add_PrefillServicer_to_server(CountingPrefill(prefill), srv)
        )
        await stack.join(
            MemberInfo(worker_id="prefill-0", role=Role.PREFILL, grpc_endpoint=p.grpc_endpoint, revision=REVISION)
        )
        metrics = RouterMetrics()
        backend = PDBackend(
            RouterConfig(
                model_name="tiny",
                max_model_len=MAX_LEN,
                revision=REVISION,
                disaggregation="always",  # (the push road: conftest.py)
                token=TOKEN,
                timeouts=Timeouts(rpc_s=2.0, lease_ms=5000, readiness_ms=10_000, prefill_s=30, resume_wait_s=5.0),
            ),
            tokenizer=loaded.tokenizer,
            broker=stack.client(),
            metrics=metrics,
        )
        await backend.start()
        await backend.view.wait_for(lambda v: len(v.members) == len(decodes) + 1, 5)
        try:
            yield Cluster(backend, decodes, members, metrics, stubs)
        finally:
            await backend.close()
    finally:
        await stack.close()


def requests(loaded) -> list[tuple[list[int], SamplingParams]]:
    """4 greedy streams and 2 seeded sampled ones, none ending early."""
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return [(loaded.tokenizer.encode(p), greedy) for p in PROMPTS[:4]] + [
        (
            loaded.tokenizer.encode(p),
            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=11 + i, ignore_eos=True),
        )
        for i, p in enumerate(PROMPTS[4:])
    ]


def reference(loaded, reqs) -> list[tuple[list[int], str]]:
    out = []
    for prompt, params in reqs:
        [c] = generate(loaded.model, loaded.tokenizer, [prompt], params, max_len=MAX_LEN)
        out.append((c.output_ids, c.text))
    return out


async def run_with(c: Cluster, reqs, on_tokens, when: int = 8):
    """Stream every request through the router; once each has `when` tokens, await `on_tokens()`."""
    results: list[list] = [[] for _ in reqs]
    started = [asyncio.Event() for _ in reqs]

    async def one(i: int) -> None:
        async for event in c.backend.generate(reqs[i][0], reqs[i][1], f"req-{i}", cache_scope=""):
            results[i].append(event)
            if len(results[i]) == when:
                started[i].set()
        started[i].set()

    tasks = [asyncio.create_task(one(i)) for i in range(len(reqs))]
    async with asyncio.timeout(60):
        for e in started:
            await e.wait()
        fault_result = await on_tokens()
        await asyncio.gather(*tasks)
    return results, fault_result


def check_identical(results, expected) -> None:
    for i, (events, (tokens, text)) in enumerate(zip(results, expected, strict=True)):
        assert [e.token_id for e in events] == tokens, f"request {i}: tokens differ from the undisturbed run"
        assert "".join(e.text for e in events) == text, f"request {i}: text differs"
        assert events[-1].finish_reason == "length" and all(e.finish_reason is None for e in events[:-1])


async def eventually(condition, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.02)


def sample(metrics, name: str, labels: dict | None = None) -> float:
    return metrics.registry.get_sample_value(name, labels or {}) or 0.0


@pytest.mark.asyncio
async def test_a_drain_moves_every_stream_with_its_kv_and_no_prefill(loaded):
    reqs = requests(loaded)
    expected = reference(loaded, reqs)
    async with cluster(loaded) as c:
        # Only decode-0 takes the requests: decode-1 is marked draining in the broker until they run.
        await c.members[1].set_draining(True)
        await c.backend.view.wait_for(lambda v: v.members["decode-1"].draining, 5)

        async def drain_decode_0():
            await c.members[1].set_draining(False)
            await c.backend.view.wait_for(lambda v: not v.members["decode-1"].draining, 5)
            assert c.decodes[0].loop.active == len(reqs)
            prefills = CountingPrefill.calls
            drained, seconds = await c.drain(0)
            return drained, seconds, CountingPrefill.calls - prefills

        results, (drained, seconds, prefills) = await run_with(c, reqs, drain_decode_0)
        check_identical(results, expected)
        assert drained and seconds < 2.0, f"drain took {seconds:.2f}s"
        assert prefills == 0, "a prefill was called during the drain"
        for events in results:
            info = [e.info for e in events if e.info is not None][-1]
            assert info.migrations == 1 and info.decode == "decode-1" and info.retries == 0
        usage = c.decodes[0].slots.usage()
        assert usage.free == SLOTS and usage.tokens_used == 0 and c.decodes[0].handoffs.pending() == 0
        await eventually(lambda: c.decodes[1].slots.usage().free == SLOTS)
        dm = c.decodes[0].metrics.registry
        assert dm.get_sample_value("pdserve_decode_migrations_total", {"outcome": "migrated"}) == len(reqs)
        assert dm.get_sample_value("pdserve_decode_migration_bytes_total") > 0
        assert c.decodes[1].metrics.registry.get_sample_value("pdserve_decode_migrations_received_total") == len(reqs)
        assert sample(c.metrics, "pdserve_router_migrations_total", {"outcome": "migrated"}) == len(reqs)
        assert sample(c.metrics, "pdserve_router_migrations_total", {"outcome": "fallback"}) == 0
        assert sample(c.metrics, "pdserve_router_request_retries_total") == 0


@pytest.mark.asyncio
async def test_with_no_room_elsewhere_the_request_resumes_by_prefill_with_the_same_text(loaded):
    reqs = requests(loaded)[3:5]  # one greedy, one seeded
    expected = reference(loaded, reqs)
    async with cluster(loaded) as c:
        await c.members[1].set_draining(True)
        await c.backend.view.wait_for(lambda v: v.members["decode-1"].draining, 5)

        async def fill_decode_1_then_drain_decode_0():
            await c.members[1].set_draining(False)
            await c.backend.view.wait_for(lambda v: not v.members["decode-1"].draining, 5)
            held = [
                await c.stubs[1].Reserve(
                    worker_pb2.ReserveRequest(
                        request_id=f"hold-{i}", num_prompt_tokens=4, max_tokens=4, lease_ms=60_000
                    )
                )
                for i in range(SLOTS)
            ]
            prefills = CountingPrefill.calls
            drain = asyncio.create_task(c.drain(0))
            await asyncio.sleep(1.0)  # the migrations found no room and the requests wait to resume
            for g in held:
                await c.stubs[1].Release(
                    worker_pb2.ReleaseRequest(slot=g.slot, generation=g.generation, push_settled=True)
                )
            drained, _ = await drain
            return drained, prefills

        results, (drained, prefills) = await run_with(c, reqs, fill_decode_1_then_drain_decode_0)
        check_identical(results, expected)
        assert drained and CountingPrefill.calls - prefills == len(reqs)  # each resumed by re-prefilling
        for events in results:
            info = [e.info for e in events if e.info is not None][-1]
            assert info.retries == 1 and info.decode == "decode-1" and not info.migrations
        assert sample(c.metrics, "pdserve_router_migrations_total", {"outcome": "fallback"}) == len(reqs)
        assert c.decodes[0].slots.usage().free == SLOTS and c.decodes[0].handoffs.pending() == 0


class RefusingPushDecode(DecodeServicer):
    """A decode whose Migrate fails after claiming the handoff, before any put (its link broke)."""

    async def Migrate(self, request, context):
        handoff = self.w.handoffs.take(request.request_id, request.slot, request.generation)
        handoff.finish(migrated=False)
        context.set_trailing_metadata(settled_trailer(True))
        await context.abort(grpc.StatusCode.UNAVAILABLE, "migration failed: the link broke")


@pytest.mark.asyncio
async def test_a_failed_push_falls_back_to_resume_and_frees_both_sides(loaded):
    reqs = requests(loaded)[4:6]
    expected = reference(loaded, reqs)
    async with cluster(loaded, servicers=(RefusingPushDecode, DecodeServicer)) as c:
        await c.members[1].set_draining(True)
        await c.backend.view.wait_for(lambda v: v.members["decode-1"].draining, 5)

        async def drain_decode_0():
            await c.members[1].set_draining(False)
            await c.backend.view.wait_for(lambda v: not v.members["decode-1"].draining, 5)
            return await c.drain(0)

        results, (drained, _) = await run_with(c, reqs, drain_decode_0)
        check_identical(results, expected)
        assert drained
        for events in results:
            info = [e.info for e in events if e.info is not None][-1]
            assert info.retries == 1 and not info.migrations
        assert sample(c.metrics, "pdserve_router_migrations_total", {"outcome": "fallback"}) == len(reqs)
        assert c.decodes[0].slots.usage().free == SLOTS
        # The target's grants went back settled (no put was made): free at once, not quarantined.
        await eventually(lambda: c.decodes[1].slots.usage().free == SLOTS, 2.0)


@pytest.mark.asyncio
async def test_drain_mode_resume_ends_streams_at_once_and_the_router_reprefills(loaded):
    reqs = requests(loaded)[:2]
    expected = reference(loaded, reqs)
    async with cluster(loaded, decode_extra=({"drain_mode": "resume"}, {})) as c:
        await c.members[1].set_draining(True)
        await c.backend.view.wait_for(lambda v: v.members["decode-1"].draining, 5)

        async def drain_decode_0():
            await c.members[1].set_draining(False)
            await c.backend.view.wait_for(lambda v: not v.members["decode-1"].draining, 5)
            prefills = CountingPrefill.calls
            drained, _ = await c.drain(0)
            return drained, prefills

        results, (drained, prefills) = await run_with(c, reqs, drain_decode_0)
        check_identical(results, expected)
        assert drained and CountingPrefill.calls - prefills == len(reqs)
        assert c.decodes[0].slots.usage().free == SLOTS


class TargetDiesAfterTheKV(DecodeServicer):
    """A decode killed right after a migration's KV and notify reached it (before its first token)."""

    async def Generate(self, request, context):
        if not request.migrated:
            async for event in super().Generate(request, context):
                yield event
            return
        await asyncio.sleep(0.3)  # the Migrate has pushed and notified meanwhile
        await context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset by peer (killed)")


class SourceDiesMidPush(DecodeServicer):
    """A decode killed in the middle of a migration's push: one layer chunk is out, no notify."""

    async def Migrate(self, request, context):
        from pdserve_worker.decode.migration import MigrationPusher
        from pdserve_worker.rpc.convert import push_targets_from_proto
        from pdserve_worker.transfer.push import PushSource

        w = self.w
        handoff = w.handoffs.take(request.request_id, request.slot, request.generation)
        source = PushSource(w.pool.base_addr, w.layout, handoff.slot)
        pusher = MigrationPusher(
            w.backend,
            source,
            w.slots.blocks_of(handoff.slot),
            push_targets_from_proto(request),
            handoff.detached.kv_tokens,
        )
        pusher.push_chunk(range(0, 1))
        pusher.abort()
        handoff.finish(migrated=False)
        await context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset by peer (killed)")  # no trailers


async def drain_after_parking_others(c: Cluster, others: tuple[int, ...], then: tuple[int, ...] = ()):
    """Open `others` to new requests, drain decode 0 (its requests migrate to `others`: a burst
    of migrations spreads over them), then open `then` too (where the resumes may go)."""
    for i in others:
        await c.members[i].set_draining(False)
    await c.backend.view.wait_for(lambda v: not any(v.members[f"decode-{i}"].draining for i in others), 5)
    drained = await c.drain(0)
    for i in then:
        await c.members[i].set_draining(False)
    return drained


@pytest.mark.asyncio
@pytest.mark.parametrize("fault", ["target dies after the KV", "source dies mid-push"])
async def test_a_migration_cut_short_resumes_with_the_same_text(loaded, fault):
    reqs = requests(loaded)[2:6]  # two greedy, two seeded
    expected = reference(loaded, reqs)
    servicers = (
        (DecodeServicer, TargetDiesAfterTheKV, DecodeServicer)
        if fault.startswith("target")
        else (SourceDiesMidPush, DecodeServicer, DecodeServicer)
    )
    async with cluster(loaded, decode_extra=({}, {}, {}), slow=(0.02, 0.0, 0.0), servicers=servicers) as c:
        for i in (1, 2):
            await c.members[i].set_draining(True)
        await c.backend.view.wait_for(lambda v: v.members["decode-1"].draining and v.members["decode-2"].draining, 5)
        prefills = CountingPrefill.calls
        # Every migration goes to decode 1 when it is the only one open; decode 2 opens for the resumes.
        first, then = ((1,), (2,)) if fault.startswith("target") else ((1, 2), ())
        results, (drained, _) = await run_with(c, reqs, lambda: drain_after_parking_others(c, first, then))
        check_identical(results, expected)
        assert drained
        for events in results:
            info = [e.info for e in events if e.info is not None][-1]
            assert info.retries == 1, info  # resumed once
            if fault.startswith("target"):
                assert info.decode == "decode-2"  # not the dead target, not the drained source
        assert CountingPrefill.calls - prefills == 2 * len(reqs)  # first road + the resume
        fallbacks = sample(c.metrics, "pdserve_router_migrations_total", {"outcome": "fallback"})
        assert fallbacks == (len(reqs) if fault.startswith("source") else 0)
        assert c.decodes[0].slots.usage().free == SLOTS and c.decodes[0].handoffs.pending() == 0
        if fault.startswith("source"):
            # The target grants of the cut push are quarantined (a write may still land), then free.
            usage = c.decodes[1].slots.usage()
            assert usage.quarantined + usage.free == SLOTS


@pytest.mark.asyncio
async def test_a_migration_is_traced_in_the_request_s_trace(loaded, tmp_path):
    import json

    from pdserve_common import pod_env as E
    from pdserve_common import tracing

    path = tmp_path / "spans.jsonl"
    assert tracing.setup("pdserve-test", "t-migrate", env={E.TRACE_FILE: str(path)})
    try:
        reqs = requests(loaded)[:1]
        expected = reference(loaded, reqs)
        async with cluster(loaded) as c:
            await c.members[1].set_draining(True)
            await c.backend.view.wait_for(lambda v: v.members["decode-1"].draining, 5)

            async def drain_decode_0():
                await c.members[1].set_draining(False)
                await c.backend.view.wait_for(lambda v: not v.members["decode-1"].draining, 5)
                return await c.drain(0)

            results, _ = await run_with(c, reqs, drain_decode_0)
            check_identical(results, expected)
    finally:
        tracing.shutdown()
    spans = [json.loads(line) for line in path.read_text().splitlines() if line]
    by_name = {s["name"]: s for s in spans}
    assert {"router.migrate", "decode.migrate", "router.attempt"} <= set(by_name), sorted(by_name)
    moved = by_name["router.migrate"]
    assert moved["attributes"]["pdserve.source.member"] == "decode-0"
    assert moved["attributes"]["pdserve.decode.member"] == "decode-1"
    # The source's push is in the request's trace, under the router's migrate span.
    assert by_name["decode.migrate"]["trace_id"] == moved["trace_id"] == by_name["router.attempt"]["trace_id"]
    assert by_name["decode.migrate"]["attributes"]["pdserve.kv_bytes"] > 0
