"""The request road in one process, over real gRPC and the host transfer engine: a broker, a
decode worker, a prefill worker (or a broken one) and the router's `PDBackend`.

Where `test_pd_serving.py` shows the happy road through real processes, this shows what each
failure becomes (no slot → NoCapacity, a prefill that never pushes → RequestTimeout, a prefill
that is down → BackendUnavailable, a draining decode is skipped) and that the decode slot is
given back on every one of them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
import pytest

from netutil import free_port
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve_common.membership import MemberInfo, Role
from pdserve_worker.api.backend import BackendUnavailable, InvalidPrompt, NoCapacity, RequestTimeout
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
from pdserve_worker.rpc.convert import sampling_to_proto
from pdserve_worker.transfer.registry import create_engine
from support.inprocess_stack import Stack

SVC, TOKEN, REVISION = "test/pd", "secret-token", "rev-1"
SLOTS, MAX_LEN = 2, 64


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    from pdserve_worker.model.loading.loader import load_model

    return load_model(str(tiny_model_dir), dtype="float32")


class StuckPrefill(worker_pb2_grpc.PrefillServicer):
    """Accepts a prefill and never pushes (a prefill that hangs)."""

    async def Prefill(self, request, context):
        await asyncio.Event().wait()


class _Died(BaseException):
    """A process death: not an error the prefill servicer could answer (it catches Exception)."""


class _DiesAfterOneChunk:
    """The model of a prefill process that is killed right after its first layer chunk was pushed."""

    def __init__(self, model) -> None:
        self._model = model

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def prefill(self, prompt, cache, slot, layers_per_chunk=None, on_chunk=None, **kwargs):
        def first_chunk_then_die(layers: range) -> None:
            on_chunk(layers)
            raise _Died(f"killed after pushing layers {layers.start}..{layers.stop - 1}")

        return self._model.prefill(prompt, cache, slot, layers_per_chunk, on_chunk=first_chunk_then_die, **kwargs)


class _SlowChunks:
    """A model whose prefill takes `delay_s` per layer chunk: a long prompt, to cancel midway."""

    def __init__(self, model, delay_s: float = 0.15) -> None:
        self._model, self._delay_s = model, delay_s

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def prefill(self, prompt, cache, slot, layers_per_chunk=None, on_chunk=None, **kwargs):
        import time

        def slowly(layers: range) -> None:
            time.sleep(self._delay_s)
            on_chunk(layers)

        return self._model.prefill(prompt, cache, slot, layers_per_chunk, on_chunk=slowly, **kwargs)


class DyingPrefill(PrefillServicer):
    """A real prefill whose process dies mid-push: the router sees what a dead peer looks like."""

    async def Prefill(self, request, context):
        try:
            return await super().Prefill(request, context)
        except _Died as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"connection reset: {exc}")


class ShortPrefill(PrefillServicer):
    """A real prefill that leaves out the prompt's last token: its push and ready notification
    are complete but for another prompt than the decode's Generate."""

    async def Prefill(self, request, context):
        short = worker_pb2.PrefillRequest()
        short.CopyFrom(request)
        del short.prompt_token_ids[-1]
        return await super().Prefill(short, context)


class FreezingDecode(worker_pb2_grpc.DecodeServicer):
    """A decode that stops answering after `after` tokens, without closing its connections (a
    frozen process): it relays a real decode's calls, then goes silent, Status included."""

    def __init__(self, real: worker_pb2_grpc.DecodeStub, after: int) -> None:
        self.real, self.after = real, after
        self.frozen = asyncio.Event()

    async def Reserve(self, request, context):
        return await self.real.Reserve(request)

    async def Release(self, request, context):
        return await self.real.Release(request)

    async def Generate(self, request, context):
        upstream = self.real.Generate(request)
        relayed = 0
        async for event in upstream:
            yield event
            relayed += 1
            if relayed == self.after:
                break
        upstream.cancel()  # the real decode frees the slot; the router is left waiting
        self.frozen.set()
        await asyncio.Event().wait()

    async def Status(self, request, context):
        await asyncio.Event().wait()


@dataclass
class Cluster:
    backend: PDBackend
    decode: DecodeWorker
    decode_stub: worker_pb2_grpc.DecodeStub
    prefill_stubs: list[worker_pb2_grpc.PrefillStub]
    freezing: FreezingDecode | None = None
    freezing_member: BrokerClient | None = None
    prefill_workers: list[PrefillWorker] = dataclasses.field(default_factory=list)


@asynccontextmanager
async def cluster(
    loaded,
    prefill: str | tuple[str, ...] = "real",
    readiness_ms: int = 10_000,
    freeze_after: int | None = None,
    settle_s: float = 5.0,
) -> AsyncIterator[Cluster]:
    """prefill: "real", "stuck" (never pushes), "dies" (killed after its first pushed layer chunk),
    "slow" (a real prefill taking 0.15 s per layer chunk), "short" (pushes the prompt less its last
    token) or "down" (registered, nobody listening); a tuple
    starts one prefill of each kind, prefill-0 first (the one the router tries first)."""
    kinds = (prefill,) if isinstance(prefill, str) else prefill
    stack = Stack(SVC, TOKEN, max_len=MAX_LEN, slots=SLOTS)
    try:
        d_settings = stack.settings("decode")
        decode = stack.worker(DecodeWorker(d_settings, NativeEngine(loaded), stack.engine(d_settings), REVISION))
        await decode.start()
        await stack.serve(
            d_settings.grpc_port, lambda s: worker_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(decode), s)
        )
        await stack.join(decode.member_info(), decode.load)

        p_endpoints = []
        for index, kind in enumerate(kinds):
            p_settings = stack.settings("prefill", index)
            p_endpoints.append(p_settings.grpc_endpoint)
            if kind in ("real", "dies", "slow", "short"):
                wrapped = {"dies": _DiesAfterOneChunk, "slow": _SlowChunks}.get(kind)
                model = loaded if wrapped is None else dataclasses.replace(loaded, model=wrapped(loaded.model))
                worker = stack.worker(
                    PrefillWorker(p_settings, NativeEngine(model), stack.engine(p_settings), REVISION)
                )
                servicer = {"dies": DyingPrefill, "short": ShortPrefill}.get(kind, PrefillServicer)(worker)
                await stack.serve(
                    p_settings.grpc_port, lambda s, v=servicer: worker_pb2_grpc.add_PrefillServicer_to_server(v, s)
                )
            elif kind == "stuck":
                await stack.serve(
                    p_settings.grpc_port, lambda s: worker_pb2_grpc.add_PrefillServicer_to_server(StuckPrefill(), s)
                )
            await stack.join(
                MemberInfo(
                    worker_id=f"prefill-{index}",
                    role=Role.PREFILL,
                    grpc_endpoint=p_settings.grpc_endpoint,
                    revision=REVISION,
                )
            )

        freezing = freezing_member = None
        if freeze_after is not None:  # decode-9, in front of decode-0 (it claims more free slots)
            f_port = free_port()
            real = worker_pb2_grpc.DecodeStub(stack.channel(d_settings.grpc_endpoint))
            freezing = FreezingDecode(real, freeze_after)
            await stack.serve(f_port, lambda s: worker_pb2_grpc.add_DecodeServicer_to_server(freezing, s))
            # The real decode's engine and pool, but more slots claimed: the router tries it first.
            real_info = decode.member_info()
            freezing_member = await stack.join(
                dataclasses.replace(
                    real_info,
                    worker_id="decode-9",
                    grpc_endpoint=f"127.0.0.1:{f_port}",
                    kv_layout=dataclasses.replace(real_info.kv_layout, num_slots=64),
                    slots_total=64,
                    slots_free=64,
                )
            )

        backend = PDBackend(
            RouterConfig(
                model_name="tiny",
                max_model_len=MAX_LEN,
                revision=REVISION,
                disaggregation="always",  # (the push road: conftest.py)
                token=TOKEN,
                timeouts=Timeouts(
                    rpc_s=2.0,
                    lease_ms=5000,
                    readiness_ms=readiness_ms,
                    prefill_s=30,
                    settle_s=settle_s,
                    return_wait_s=2.0,
                ),
            ),
            tokenizer=loaded.tokenizer,
            broker=stack.client(),
        )
        await backend.start()
        await backend.view.wait_for(lambda v: len(v.members) == 1 + len(kinds) + (freezing is not None), 5)
        decode_stub = worker_pb2_grpc.DecodeStub(stack.channel(d_settings.grpc_endpoint))
        prefill_stubs = [worker_pb2_grpc.PrefillStub(stack.channel(e)) for e in p_endpoints]
        try:
            yield Cluster(
                backend,
                decode,
                decode_stub,
                prefill_stubs,
                freezing,
                freezing_member,
                [w for w in stack.workers if isinstance(w, PrefillWorker)],
            )
        finally:
            await backend.close()
    finally:
        await stack.close()


async def collect(backend: PDBackend, prompt: list[int], params: SamplingParams) -> tuple[list[int], list]:
    events = [e async for e in backend.generate(prompt, params, "req-1", cache_scope="")]
    return [e.token_id for e in events], events


async def eventually(condition, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.02)


@pytest.mark.asyncio
async def test_the_road_streams_colocated_tokens_and_frees_the_slot(loaded):
    prompt = loaded.tokenizer.encode("Paris is the capital of")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    [expected] = generate(loaded.model, loaded.tokenizer, [prompt], params, max_len=MAX_LEN)
    async with cluster(loaded) as c:
        tokens, events = await collect(c.backend, prompt, params)
        assert tokens == expected.output_ids
        assert "".join(e.text for e in events) == expected.text
        assert events[-1].finish_reason == "length" and all(e.finish_reason is None for e in events[:-1])
        info = [e.info for e in events if e.info is not None][-1]
        assert info.disaggregated and info.kv_bytes == c.decode.kv_bytes(len(prompt))
        assert info.prefill == "prefill-0" and info.decode == "decode-0" and info.kv_transfer_s is not None
        await eventually(lambda: c.decode.slots.usage().free == SLOTS)


@pytest.mark.asyncio
async def test_no_free_slot_is_no_capacity(loaded):
    async with cluster(loaded) as c:
        grants = [
            await c.decode_stub.Reserve(
                worker_pb2.ReserveRequest(request_id=f"hold-{i}", num_prompt_tokens=4, max_tokens=4)
            )
            for i in range(SLOTS)
        ]
        with pytest.raises(NoCapacity) as raised:
            await collect(c.backend, [1, 2, 3], SamplingParams(max_tokens=2))
        assert raised.value.retry_after_s > 0
        for g in grants:
            reply = await c.decode_stub.Release(worker_pb2.ReleaseRequest(slot=g.slot, generation=g.generation))
            assert reply.released
        again = await c.decode_stub.Release(
            worker_pb2.ReleaseRequest(slot=grants[0].slot, generation=grants[0].generation)
        )
        assert not again.released  # idempotent: a stale grant is a no-op


@pytest.mark.asyncio
async def test_a_prompt_beyond_the_slots_is_invalid(loaded):
    async with cluster(loaded) as c:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await c.decode_stub.Reserve(
                worker_pb2.ReserveRequest(request_id="x", num_prompt_tokens=MAX_LEN, max_tokens=1)
            )
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(InvalidPrompt, match="max_len"):
            await collect(c.backend, [1] * (MAX_LEN - 2), SamplingParams(max_tokens=5))


@pytest.mark.asyncio
async def test_a_prefill_that_never_pushes_times_out_and_the_slot_is_quarantined(loaded):
    async with cluster(loaded, prefill="stuck", readiness_ms=300) as c:
        with pytest.raises(RequestTimeout):
            await collect(c.backend, [1, 2, 3, 4], SamplingParams(max_tokens=3))
        usage = c.decode.slots.usage()
        # Not free at once: a late write of the abandoned push must land where nobody reads.
        assert usage.reserved == usage.committed == 0 and usage.quarantined == 1


@pytest.mark.asyncio
async def test_a_prefill_that_is_down_fails_the_request_and_releases_the_grant(loaded):
    async with cluster(loaded, prefill="down") as c:
        # prefill-0 is unreachable: the router waits for a prefill to come back (2 s here), then
        # names the wait (no worker's name reaches the client: the log names prefill-0).
        with pytest.raises(BackendUnavailable, match="a prefill worker went away and none came back"):
            await collect(c.backend, [1, 2, 3, 4], SamplingParams(max_tokens=3))
        await eventually(lambda: c.decode.busy() == 0)


@pytest.mark.asyncio
async def test_a_draining_decode_takes_no_new_request(loaded):
    async with cluster(loaded) as c:
        assert await c.decode.drain(0.0)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await c.decode_stub.Reserve(worker_pb2.ReserveRequest(request_id="x", num_prompt_tokens=2, max_tokens=2))
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(BackendUnavailable, match="draining"):
            await collect(c.backend, [1, 2], SamplingParams(max_tokens=2))


@pytest.mark.asyncio
async def test_generate_needs_the_live_generation(loaded):
    async with cluster(loaded) as c:
        grant = await c.decode_stub.Reserve(
            worker_pb2.ReserveRequest(request_id="g", num_prompt_tokens=2, max_tokens=2)
        )
        stale = worker_pb2.GenerateRequest(
            request_id="g",
            slot=grant.slot,
            generation=grant.generation + 1,
            prompt_token_ids=[1, 2],
            readiness_timeout_ms=200,
        )
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            async for _ in c.decode_stub.Generate(stale):
                pass
        assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert c.decode.slots.is_reserved(grant.slot, grant.generation)  # the live grant is untouched


@pytest.mark.asyncio
async def test_a_client_that_leaves_mid_stream_frees_the_slot(loaded):
    async with cluster(loaded) as c:
        stream = c.backend.generate(
            [5, 6, 7], SamplingParams(max_tokens=MAX_LEN - 4, ignore_eos=True), "leaver", cache_scope=""
        )
        first = await anext(stream)
        assert first.finish_reason is None
        assert c.decode.busy() == 1
        await stream.aclose()
        await eventually(lambda: c.decode.busy() == 0 and c.decode.loop.active == 0)
        assert c.decode.slots.usage().free == SLOTS  # committed slots come back free, not quarantined


def _reference(loaded, prompt: list[int], params: SamplingParams):
    """The colocated stream, event by event (token and text delta)."""
    from pdserve_worker.model.engine import Generator, colocated_cache, prefill_first_token

    gen = Generator(loaded.model, loaded.tokenizer, colocated_cache(loaded.model, 1, MAX_LEN))
    first = prefill_first_token(loaded.model, gen.cache, 0, prompt, params)
    _, out = gen.add_prefilled(prompt, 0, first, params)
    return [(o.token_id, o.text) for o in [out, *gen.stream()]]


@pytest.mark.asyncio
async def test_generate_resumes_a_stream_at_num_generated(loaded):
    """What the router does after a decode died: prompt + emitted tokens re-prefilled, stream goes on."""
    prompt = loaded.tokenizer.encode("The quick brown fox")
    params = SamplingParams(max_tokens=12, temperature=0.7, seed=3, ignore_eos=True)
    expected = _reference(loaded, prompt, params)
    k = 5
    emitted = [t for t, _ in expected[:k]]
    async with cluster(loaded) as c:
        grant = await c.decode_stub.Reserve(
            worker_pb2.ReserveRequest(
                request_id="r", num_prompt_tokens=len(prompt) + k, max_tokens=params.max_tokens - k
            )
        )
        sampling = sampling_to_proto(params)
        call = c.decode_stub.Generate(
            worker_pb2.GenerateRequest(
                request_id="r",
                slot=grant.slot,
                generation=grant.generation,
                prompt_token_ids=prompt + emitted,
                sampling=sampling,
                readiness_timeout_ms=5000,
                num_generated=k,
            )
        )
        await c.prefill_stubs[0].Prefill(
            worker_pb2.PrefillRequest(
                request_id="r", prompt_token_ids=prompt + emitted, sampling=sampling, targets=[grant], num_generated=k
            )
        )
        events = [e async for e in call]
        assert [e.index for e in events] == list(range(k, params.max_tokens))
        assert [(e.token_id, e.text) for e in events] == expected[k:]
        assert events[-1].finish_reason == worker_pb2.FINISH_REASON_LENGTH
        await eventually(lambda: c.decode.slots.usage().free == SLOTS)


@pytest.mark.asyncio
async def test_generate_refuses_a_resume_with_nothing_before_it(loaded):
    async with cluster(loaded) as c:
        grant = await c.decode_stub.Reserve(
            worker_pb2.ReserveRequest(request_id="r", num_prompt_tokens=2, max_tokens=2)
        )
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            async for _ in c.decode_stub.Generate(
                worker_pb2.GenerateRequest(
                    request_id="r",
                    slot=grant.slot,
                    generation=grant.generation,
                    prompt_token_ids=[1, 2],
                    num_generated=2,
                    readiness_timeout_ms=200,
                )
            ):
                pass
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "num_generated" in raised.value.details()


@pytest.mark.asyncio
async def test_a_stuck_prefill_is_replaced_by_another(loaded):
    prompt = loaded.tokenizer.encode("Paris is the capital of")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    async with cluster(loaded, prefill=("stuck", "real"), readiness_ms=300) as c:
        tokens, events = await collect(c.backend, prompt, params)
        assert [(e.token_id, e.text) for e in events] == _reference(loaded, prompt, params)
        info = [e.info for e in events if e.info is not None][-1]
        assert info.prefill == "prefill-1" and info.retries == 1
        usage = c.decode.slots.usage()
        assert usage.quarantined == 1 and usage.reserved == usage.committed == 0  # the abandoned slot


@pytest.mark.asyncio
async def test_a_draining_prefill_finishes_what_it_holds_and_new_prompts_go_elsewhere(loaded):
    """#29: a prefill's drain (its pod's stop on a scale-down) waited for nothing. Now it
    refuses new prompts (the router takes them to another prefill) and returns once the ones it
    was computing are answered, which they are, unchanged."""
    prompt = loaded.tokenizer.encode("Paris is the capital of")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    expected = _reference(loaded, prompt, params)
    async with cluster(loaded, prefill=("slow", "real")) as c:
        draining = c.prefill_workers[0]
        running = asyncio.create_task(collect(c.backend, prompt, params))
        await eventually(lambda: draining.queued == 1)
        drain = asyncio.create_task(draining.drain(30.0))
        await eventually(lambda: draining.draining)
        _, later = await collect(c.backend, prompt, params)  # arrives while prefill-0 drains
        assert [(e.token_id, e.text) for e in later] == expected
        assert [e.info for e in later if e.info is not None][-1].prefill == "prefill-1"
        with pytest.raises(grpc.aio.AioRpcError) as refused:  # asked directly, prefill-0 says no
            await c.prefill_stubs[0].Prefill(worker_pb2.PrefillRequest(request_id="r", prompt_token_ids=prompt))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in refused.value.details()
        _, first = await running
        assert [(e.token_id, e.text) for e in first] == expected  # finished where it was
        assert [e.info for e in first if e.info is not None][-1].prefill == "prefill-0"
        assert await drain is True and draining.queued == 0
        await eventually(lambda: c.decode.busy() == 0)


@pytest.mark.asyncio
async def test_when_every_prefill_fails_the_error_says_no_worker_was_left(loaded):
    async with cluster(loaded, prefill=("stuck", "down"), readiness_ms=300) as c:
        # prefill-1 went away (unreachable): the router waits for a prefill to come back
        # (Timeouts.return_wait_s, 2 s here), then names the wait.
        with pytest.raises(BackendUnavailable, match="a prefill worker went away and none came back") as raised:
            await collect(c.backend, [1, 2, 3, 4], SamplingParams(max_tokens=3))
        assert "prefill-1" not in str(raised.value)  # (no worker's name reaches the client)
        await eventually(lambda: c.decode.busy() == 0)


@pytest.mark.asyncio
async def test_a_decode_that_freezes_mid_stream_is_given_up_when_it_leaves_the_membership(loaded):
    """No connection breaks: once the broker drops the member, the router probes it, gets no
    answer, and resumes the request on another decode after the tokens already streamed."""
    prompt = loaded.tokenizer.encode("A language model predicts")
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    async with cluster(loaded, freeze_after=4) as c:
        assert c.freezing is not None and c.freezing_member is not None
        task = asyncio.ensure_future(collect(c.backend, prompt, params))
        await asyncio.wait_for(c.freezing.frozen.wait(), 10)
        assert not task.done()  # the stream hangs on the frozen decode
        await c.freezing_member.deregister()  # what its lapsed lease does
        tokens, events = await asyncio.wait_for(task, 15)
        assert [(e.token_id, e.text) for e in events] == _reference(loaded, prompt, params)
        info = [e.info for e in events if e.info is not None][-1]
        assert info.decode == "decode-0" and info.retries == 1
        await eventually(lambda: c.decode.slots.usage().free == SLOTS)


@pytest.mark.asyncio
async def test_a_prefill_that_dies_mid_push_is_replaced_and_its_partial_kv_never_read(loaded):
    prompt = loaded.tokenizer.encode("Numbers like 12345 and")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    async with cluster(loaded, prefill=("dies", "real")) as c:
        tokens, events = await collect(c.backend, prompt, params)
        assert [(e.token_id, e.text) for e in events] == _reference(loaded, prompt, params)
        info = [e.info for e in events if e.info is not None][-1]
        assert info.prefill == "prefill-1" and info.retries == 1
        usage = c.decode.slots.usage()
        assert usage.quarantined == 1 and usage.reserved == usage.committed == 0  # the half-written slot


# ---- grants given back (issue 13, D2/D3): every way out releases or hands to the lease -------------


async def _cancel_midway(backend: PDBackend, prompt: list[int], params: SamplingParams, after_s: float) -> None:
    task = asyncio.create_task(collect(backend, prompt, params))
    await asyncio.sleep(after_s)
    assert not task.done(), "the request ended before it could be cancelled"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.asyncio
async def test_a_grant_answered_after_its_request_was_cancelled_is_given_back_free(loaded, monkeypatch):
    """The client left while the Reserve was in flight: the grant that arrives anyway is not
    lost (it held its slot for the lease and then a quarantine); no push started, so it is free."""
    reserve = DecodeServicer.Reserve
    granted: list[int] = []

    async def slow_reserve(self, request, context):
        await asyncio.sleep(0.3)
        grant = await reserve(self, request, context)
        granted.append(grant.slot)
        return grant

    monkeypatch.setattr(DecodeServicer, "Reserve", slow_reserve)
    async with cluster(loaded) as c:
        await _cancel_midway(c.backend, [1, 2, 3, 4], SamplingParams(max_tokens=3), after_s=0.1)
        await eventually(lambda: granted, 2)  # the decode did grant it, after the cancel
        await eventually(lambda: c.decode.slots.usage().free == SLOTS, 2)
        assert c.decode.slots.usage().quarantined == 0
        assert c.backend.in_flight() == {"decode": 0, "prefill": 0}


@pytest.mark.asyncio
async def test_a_request_cancelled_while_its_prefill_runs_stops_the_push_and_frees_the_slot(loaded):
    """The router asks the prefill to stop; it stops before its next layer chunk, waits for the
    puts it issued and says its push is over: the slot is free at once, not quarantined."""
    prompt = loaded.tokenizer.encode("A prompt long enough to be cancelled in the middle of its prefill")
    async with cluster(loaded, prefill="slow") as c:
        await _cancel_midway(c.backend, prompt, SamplingParams(max_tokens=4), after_s=0.2)
        assert c.backend.in_flight() == {"decode": 0, "prefill": 0}  # the counters go back with the cancel
        await eventually(lambda: c.decode.slots.usage().free == SLOTS, 2)
        assert c.decode.slots.usage().quarantined == 0
        # It was stopped, not run to the end: nothing was served, and a new request is.
        tokens, _ = await collect(c.backend, [1, 2, 3], SamplingParams(max_tokens=2, temperature=0))
        assert len(tokens) == 2


@pytest.mark.asyncio
async def test_a_prefill_that_cannot_say_its_push_is_over_leaves_the_slot_quarantined(loaded):
    """A prefill that answers neither the Cancel nor its Prefill: a write may still land, so the
    slot is quarantined (after `settle_s`), never handed to the next request early."""
    async with cluster(loaded, prefill="stuck", settle_s=0.3) as c:
        await _cancel_midway(c.backend, [1, 2, 3, 4], SamplingParams(max_tokens=3), after_s=0.2)
        await eventually(lambda: c.decode.slots.usage().quarantined == 1, 3)
        usage = c.decode.slots.usage()
        assert usage.reserved == usage.committed == 0


@pytest.mark.asyncio
async def test_a_prefill_cancelled_before_its_request_arrives_refuses_it(loaded):
    """Cancel and Prefill race on the wire: a Cancel that comes first is remembered, and the
    Prefill is refused as settled (nothing was pushed)."""
    from pdserve_worker.rpc.trailers import push_settled

    async with cluster(loaded) as c:
        grant = await c.decode_stub.Reserve(
            worker_pb2.ReserveRequest(request_id="early", num_prompt_tokens=3, max_tokens=2)
        )
        reply = await c.prefill_stubs[0].Cancel(
            worker_pb2.CancelPrefillRequest(request_id="early", slot=grant.slot, generation=grant.generation)
        )
        assert not reply.found
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await c.prefill_stubs[0].Prefill(
                worker_pb2.PrefillRequest(
                    request_id="early",
                    prompt_token_ids=[1, 2, 3],
                    sampling=sampling_to_proto(SamplingParams()),
                    targets=[grant],
                )
            )
        assert refused.value.code() == grpc.StatusCode.ABORTED and push_settled(refused.value)
        released = await c.decode_stub.Release(
            worker_pb2.ReleaseRequest(slot=grant.slot, generation=grant.generation, push_settled=True)
        )
        assert released.released and c.decode.slots.usage().free == SLOTS


class _CountsPasses:
    """The model, recording how many prompts each packed prefill pass held."""

    def __init__(self, model) -> None:
        self._model = model
        self.passes: list[int] = []

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def prefill(self, prompt, *args, **kwargs):
        self.passes.append(1)
        return self._model.prefill(prompt, *args, **kwargs)

    def prefill_batch(self, prompts, *args, **kwargs):
        self.passes.append(len(prompts))
        return self._model.prefill_batch(prompts, *args, **kwargs)


async def _queued_prefills(c: Cluster, loaded, requests: list[worker_pb2.PrefillRequest], while_queued=None):
    """Send `requests` to prefill-0 while its compute thread is held, so they all wait together
    (then `while_queued(worker)` runs); returns the pass counter and the calls' outcomes."""
    worker = c.prefill_workers[0]
    counter = _CountsPasses(loaded.model)
    worker.engine = NativeEngine(dataclasses.replace(loaded, model=counter))
    gate = threading.Event()
    worker._compute.submit(gate.wait)
    calls = [asyncio.ensure_future(c.prefill_stubs[0].Prefill(r)) for r in requests]
    await eventually(lambda: worker.queued == len(requests))
    if while_queued is not None:
        while_queued(worker)
    gate.set()
    return counter, await asyncio.gather(*calls, return_exceptions=True)


@pytest.mark.asyncio
async def test_prompts_waiting_together_share_one_pass_and_each_reaches_its_own_slot(loaded):
    prompts = [loaded.tokenizer.encode("Paris is the capital of"), loaded.tokenizer.encode("The quick brown fox")]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    expected = [_reference(loaded, p, params) for p in prompts]
    async with cluster(loaded) as c:
        sampling = sampling_to_proto(params)
        grants = [
            await c.decode_stub.Reserve(
                worker_pb2.ReserveRequest(request_id=f"b{i}", num_prompt_tokens=len(p), max_tokens=params.max_tokens)
            )
            for i, p in enumerate(prompts)
        ]
        streams = [
            c.decode_stub.Generate(
                worker_pb2.GenerateRequest(
                    request_id=f"b{i}",
                    slot=g.slot,
                    generation=g.generation,
                    prompt_token_ids=p,
                    sampling=sampling,
                    readiness_timeout_ms=10_000,
                )
            )
            for i, (p, g) in enumerate(zip(prompts, grants))
        ]
        counter, replies = await _queued_prefills(
            c,
            loaded,
            [
                worker_pb2.PrefillRequest(request_id=f"b{i}", prompt_token_ids=p, sampling=sampling, targets=[g])
                for i, (p, g) in enumerate(zip(prompts, grants))
            ],
        )
        assert counter.passes == [2]  # one forward pass for both
        assert [r.num_tokens for r in replies] == [len(p) for p in prompts]
        for stream, want in zip(streams, expected):
            events = [e async for e in stream]
            assert [(e.token_id, e.text) for e in events] == want  # each prompt's KV in its own decode slot
        await eventually(lambda: c.decode.slots.usage().free == SLOTS)


@pytest.mark.asyncio
async def test_a_prompt_whose_push_fails_fails_alone(loaded):
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompt = loaded.tokenizer.encode("Paris is the capital of")
    async with cluster(loaded) as c:
        sampling = sampling_to_proto(params)
        grant = await c.decode_stub.Reserve(
            worker_pb2.ReserveRequest(request_id="ok", num_prompt_tokens=len(prompt), max_tokens=params.max_tokens)
        )
        stream = c.decode_stub.Generate(
            worker_pb2.GenerateRequest(
                request_id="ok",
                slot=grant.slot,
                generation=grant.generation,
                prompt_token_ids=prompt,
                sampling=sampling,
                readiness_timeout_ms=10_000,
            )
        )
        nowhere = worker_pb2.Grant()
        nowhere.CopyFrom(grant)
        nowhere.engine_id = f"127.0.0.1:{free_port()}"  # no transfer engine listens there
        counter, (bad, good) = await _queued_prefills(
            c,
            loaded,
            [
                worker_pb2.PrefillRequest(
                    request_id="bad", prompt_token_ids=prompt, sampling=sampling, targets=[nowhere]
                ),
                worker_pb2.PrefillRequest(request_id="ok", prompt_token_ids=prompt, sampling=sampling, targets=[grant]),
            ],
        )
        assert isinstance(bad, grpc.aio.AioRpcError) and bad.code() == grpc.StatusCode.UNAVAILABLE
        assert good.num_tokens == len(prompt)
        assert counter.passes == [1]  # the unreachable prompt never entered the pass
        assert [(e.token_id, e.text) for e in [e async for e in stream]] == _reference(loaded, prompt, params)


@pytest.mark.asyncio
async def test_a_prompt_cancelled_while_queued_leaves_the_pass_to_the_others(loaded):
    from pdserve_worker.rpc.trailers import push_settled

    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompts = [loaded.tokenizer.encode("Paris is the capital of"), loaded.tokenizer.encode("The quick brown fox")]
    async with cluster(loaded) as c:
        sampling = sampling_to_proto(params)
        grants = [
            await c.decode_stub.Reserve(
                worker_pb2.ReserveRequest(request_id=f"c{i}", num_prompt_tokens=len(p), max_tokens=params.max_tokens)
            )
            for i, p in enumerate(prompts)
        ]
        stream = c.decode_stub.Generate(
            worker_pb2.GenerateRequest(
                request_id="c1",
                slot=grants[1].slot,
                generation=grants[1].generation,
                prompt_token_ids=prompts[1],
                sampling=sampling,
                readiness_timeout_ms=10_000,
            )
        )
        counter, (cancelled, kept) = await _queued_prefills(
            c,
            loaded,
            [
                worker_pb2.PrefillRequest(request_id=f"c{i}", prompt_token_ids=p, sampling=sampling, targets=[g])
                for i, (p, g) in enumerate(zip(prompts, grants))
            ],
            while_queued=lambda w: w.cancel(("c0", grants[0].slot, grants[0].generation)),
        )
        assert isinstance(cancelled, grpc.aio.AioRpcError) and cancelled.code() == grpc.StatusCode.ABORTED
        assert push_settled(cancelled)  # nothing of it was put: its slot may be given back free
        assert kept.num_tokens == len(prompts[1]) and counter.passes == [1]
        assert [(e.token_id, e.text) for e in [e async for e in stream]] == _reference(loaded, prompts[1], params)


@pytest.mark.asyncio
async def test_a_ready_message_that_cannot_be_used_is_aborted_not_unknown(loaded):
    """A notify with the grant's nonce but no first token (a broken prefill): the decode cannot
    decode from it and says ABORTED (was: a ValueError escaping as UNKNOWN, which the router
    does not retry); the slot is quarantined, as for any Generate that never committed."""
    import json

    async with cluster(loaded) as c:
        c.decode.readiness.check = None  # (else its missing KV digest is refused first: test_kv_digest_serving.py)
        grant = await c.decode_stub.Reserve(
            worker_pb2.ReserveRequest(request_id="m", num_prompt_tokens=2, max_tokens=2)
        )
        call = c.decode_stub.Generate(
            worker_pb2.GenerateRequest(
                request_id="m",
                slot=grant.slot,
                generation=grant.generation,
                prompt_token_ids=[1, 2],
                readiness_timeout_ms=5000,
            )
        )
        client = create_engine("cpu")
        assert client.engine.initialize("127.0.0.1") == client.api.SUCCESS
        try:
            client.ensure_connected(grant.engine_id, 2000)
            body = json.dumps(
                {
                    "request_id": "m",
                    "slot": grant.slot,
                    "generation": grant.generation,
                    "nonce": grant.nonce.hex(),
                    "num_tokens": 2,
                }
            )
            assert client.engine.send_notify(grant.engine_id, client.api.NotifyDesc("kv_ready", body)) == 0
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                async for _ in call:
                    pass
        finally:
            client.engine.finalize()
        assert raised.value.code() == grpc.StatusCode.ABORTED
        assert "lacks an integer num_tokens or first_token" in raised.value.details()
        assert grant.nonce.hex() not in raised.value.details()
        assert c.decode.slots.usage().quarantined == 1


@pytest.mark.asyncio
async def test_a_push_for_another_prompt_is_retried_with_another_prefill(loaded):
    prompt = loaded.tokenizer.encode("Paris is the capital of")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    [expected] = generate(loaded.model, loaded.tokenizer, [prompt], params, max_len=MAX_LEN)
    async with cluster(loaded, prefill=("short", "real")) as c:
        tokens, events = await collect(c.backend, prompt, params)
        assert tokens == expected.output_ids
        info = [e.info for e in events if e.info is not None][-1]
        assert info.retries == 1 and info.prefill == "prefill-1"
        await eventually(lambda: c.decode.slots.usage().free == SLOTS)  # the aborted grant came back too


class _RecordsPasses:
    """The model, recording when each prefill pass starts and ends; the long prompt's pass first
    waits (on the compute thread) until another prompt is queued behind it."""

    def __init__(self, model, worker: PrefillWorker, long_len: int) -> None:
        self._model, self._worker, self._long_len = model, worker, long_len
        self.events: list[tuple[str, int]] = []
        self.long_started = threading.Event()

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def prefill(self, prompt, *args, **kwargs):
        self.events.append(("start", len(prompt)))
        if len(prompt) == self._long_len:
            self.long_started.set()
            deadline = time.monotonic() + 10
            while not self._worker._pending and time.monotonic() < deadline:
                time.sleep(0.005)
        try:
            return self._model.prefill(prompt, *args, **kwargs)
        finally:
            self.events.append(("end", len(prompt)))


@pytest.mark.asyncio
@pytest.mark.parametrize("overtake", [12, 0])
async def test_a_short_prompt_overtakes_a_long_pass_between_its_layer_chunks(loaded, overtake):
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    long_prompt = loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 2)
    short_prompt = loaded.tokenizer.encode("Paris is the capital of")
    assert len(short_prompt) <= 12 < len(long_prompt) <= MAX_LEN - params.max_tokens
    async with cluster(loaded) as c:
        worker = c.prefill_workers[0]
        worker.settings = worker.settings.model_copy(
            update={"prefill_overtake_tokens": overtake, "layers_per_chunk": 1}
        )
        recorder = _RecordsPasses(loaded.model, worker, len(long_prompt))
        worker.engine = NativeEngine(dataclasses.replace(loaded, model=recorder))
        sampling = sampling_to_proto(params)
        prompts = [long_prompt, short_prompt]
        grants = [
            await c.decode_stub.Reserve(
                worker_pb2.ReserveRequest(request_id=f"o{i}", num_prompt_tokens=len(p), max_tokens=params.max_tokens)
            )
            for i, p in enumerate(prompts)
        ]
        streams = [
            c.decode_stub.Generate(
                worker_pb2.GenerateRequest(
                    request_id=f"o{i}",
                    slot=g.slot,
                    generation=g.generation,
                    prompt_token_ids=p,
                    sampling=sampling,
                    readiness_timeout_ms=10_000,
                )
            )
            for i, (p, g) in enumerate(zip(prompts, grants))
        ]
        requests = [
            worker_pb2.PrefillRequest(request_id=f"o{i}", prompt_token_ids=p, sampling=sampling, targets=[g])
            for i, (p, g) in enumerate(zip(prompts, grants))
        ]
        long_call = asyncio.ensure_future(c.prefill_stubs[0].Prefill(requests[0]))
        await eventually(recorder.long_started.is_set)
        replies = await asyncio.gather(long_call, c.prefill_stubs[0].Prefill(requests[1]))
        n_long, n_short = len(long_prompt), len(short_prompt)
        if overtake:  # the short pass ran inside the long one's, in another scratch slot
            assert recorder.events == [("start", n_long), ("start", n_short), ("end", n_short), ("end", n_long)]
        else:
            assert recorder.events == [("start", n_long), ("end", n_long), ("start", n_short), ("end", n_short)]
        assert [r.num_tokens for r in replies] == [n_long, n_short]
        for stream, prompt in zip(streams, prompts):
            events = [e async for e in stream]
            assert [(e.token_id, e.text) for e in events] == _reference(loaded, prompt, params)
        await eventually(lambda: c.decode.slots.usage().free == SLOTS)
