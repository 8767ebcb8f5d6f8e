"""KV digests on the request road (transfer/digest.py), in one process over real gRPC and host
engines: the prefill pushes over TCP through the fault proxy into the decode. A byte flipped in
flight is caught before the decode uses the KV, counted (`pdserve_decode_kv_digest_failures`,
reason mismatch), and the router tries again on the same workers (DATA_LOSS names no culprit):
the client gets the text a clean run gives. Without flips nothing is counted and every ready
message was checked; a ready without a digest is refused by name (ABORTED)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from netutil import free_port
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve_worker.decode.worker import DecodeWorker
from pdserve_worker.engines.native import NativeEngine
from pdserve_worker.model.engine import generate
from pdserve_worker.model.sampling.params import SamplingParams
from pdserve_worker.prefill.worker import PrefillWorker
from pdserve_worker.router.config import Timeouts
from pdserve_worker.router.pd_backend import PDBackend
from pdserve_worker.transfer.registry import create_engine
from support.fault_proxy import FaultProxy
from support.inprocess_stack import Stack

SVC, TOKEN, REVISION = "test/digest", "secret-token", "rev-1"
SLOTS, MAX_LEN = 2, 64


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Any) -> Any:
    from pdserve_worker.model.loading.loader import load_model

    return load_model(str(tiny_model_dir), dtype="float32")


@dataclass
class Road:
    backend: PDBackend
    decode: DecodeWorker
    decode_stub: worker_pb2_grpc.DecodeStub
    proxy: FaultProxy
    checked: list[int]  # bytes each ready message's digest check covered


@asynccontextmanager
async def road(loaded: Any) -> AsyncIterator[Road]:
    """A decode whose advertised KV port is the fault proxy's (group "kv"), a prefill that pushes
    over TCP (not through shared memory, which the proxy would not see), and a router."""
    stack = Stack(SVC, TOKEN, max_len=MAX_LEN, slots=SLOTS)
    proxy = FaultProxy()
    try:
        listen_port = free_port()
        _, kv_port = proxy.link("kv", ("127.0.0.1", 0), ("127.0.0.1", listen_port))
        d_settings = stack.settings("decode", transfer_port=kv_port, decode_prefix_cache=False)  # (every push whole)
        d_backend = create_engine("cpu")
        assert d_backend.engine.initialize(f"127.0.0.1:{listen_port}") == d_backend.api.SUCCESS
        stack.engines.append(d_backend)
        decode = DecodeWorker(d_settings, NativeEngine(loaded), d_backend, REVISION)
        checked: list[int] = []
        check = decode.readiness.check
        assert check is not None  # (digests are on by default)

        def spy(slot: int, generation: int, message: dict[str, Any]) -> object:
            result = check(slot, generation, message)
            checked.append(result if isinstance(result, int) else -1)
            return result

        decode.readiness.check = spy
        await stack.serve_decode(decode)
        p_settings = stack.settings("prefill")
        p_backend = create_engine("cpu")
        assert p_backend.engine.initialize("127.0.0.1", {"pdserve.Transport": "tcp"}) == p_backend.api.SUCCESS
        stack.engines.append(p_backend)
        await stack.serve_prefill(PrefillWorker(p_settings, NativeEngine(loaded), p_backend, REVISION), REVISION)
        timeouts = Timeouts(rpc_s=5.0, lease_ms=5000, readiness_ms=10_000, prefill_s=30, settle_s=5.0)
        backend = await stack.pd_backend(loaded.tokenizer, REVISION, timeouts)
        try:
            stub = worker_pb2_grpc.DecodeStub(stack.channel(d_settings.grpc_endpoint))
            yield Road(backend, decode, stub, proxy, checked)
        finally:
            await backend.close()
    finally:
        await stack.close()
        proxy.close()


def _failures(decode: DecodeWorker, reason: str) -> float:
    value = decode.metrics.registry.get_sample_value("pdserve_decode_kv_digest_failures_total", {"reason": reason})
    return value or 0.0


async def _answer(r: Road, prompt: list[int], params: SamplingParams) -> list[int]:
    events = [e async for e in r.backend.generate(prompt, params, "req-1", cache_scope="")]
    return [e.token_id for e in events if e.token_id is not None]


@pytest.mark.asyncio
async def test_a_byte_flipped_in_flight_is_counted_and_the_request_still_gets_the_right_text(loaded: Any) -> None:
    prompt = loaded.tokenizer.encode("Paris is the capital of France, and Berlin is the capital of")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    [expected] = generate(loaded.model, loaded.tokenizer, [prompt], params, max_len=MAX_LEN)
    async with road(loaded) as r:
        assert await _answer(r, prompt, params) == expected.output_ids  # clean: nothing counted
        assert _failures(r.decode, "mismatch") == 0 and _failures(r.decode, "refused") == 0
        assert len(r.checked) == 1 and r.checked[0] > 0
        r.proxy.flip("kv", 1, min_read=1024)
        assert await _answer(r, prompt, params) == expected.output_ids
        assert r.proxy.counters()["kv"]["flipped"] == 1
        assert _failures(r.decode, "mismatch") == 1  # caught; the retry re-prefilled on the same workers
        assert len(r.checked) == 2  # the damaged one raised; the retry's passed
        assert r.decode.slots.usage().quarantined <= 1  # the damaged reservation's slot only


@pytest.mark.asyncio
async def test_a_ready_without_a_digest_is_refused_by_name(loaded: Any) -> None:
    """A peer holding the grant's capability sends a ready message without `kv_digest` (a
    prefill from before digests, or with them off): ABORTED, naming the field, and counted."""
    async with road(loaded) as r:
        grant = await r.decode_stub.Reserve(
            worker_pb2.ReserveRequest(request_id="m", num_prompt_tokens=2, max_tokens=2)
        )
        call = r.decode_stub.Generate(
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
            body = {"request_id": "m", "slot": grant.slot, "generation": grant.generation}
            body |= {"nonce": grant.nonce.hex(), "num_tokens": 2, "first_token": 3}
            desc = client.api.NotifyDesc("kv_ready", json.dumps(body))
            assert client.engine.send_notify(grant.engine_id, desc) == 0
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                async for _ in call:
                    pass
        finally:
            client.engine.finalize()
        assert raised.value.code() == grpc.StatusCode.ABORTED
        assert "carries no 'kv_digest'" in (raised.value.details() or "")
        assert _failures(r.decode, "refused") == 1 and _failures(r.decode, "mismatch") == 0
