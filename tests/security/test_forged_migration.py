"""A forged migration cannot take over a request (issue #17).

A migration's ready notify is a `kv_ready` like a prefill's, plus the generation state (seed,
tokens generated). The attacker here reaches the decode's transfer engine (as anyone can on
real HIXL, which has no link authentication) and knows the victim's slot and generation:
- a migration notify without the reservation's nonce is dropped and counted, and the migrated
  Generate never starts (it times out; its grant is quarantined, nothing decoded);
- even with the nonce (an insider, or a buggy source), a state that does not fit the request
  the router described (another seed, another token count) is refused (ABORTED), as is a
  migration's notify for a prefilled request and a prefill's notify for a migrated one;
- `Migrate` of a request that was never handed over is refused, and says its push is settled.
"""

from __future__ import annotations

import json
import os

import grpc
import pytest
import pytest_asyncio

from netutil import free_port
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve_common.auth import TokenTable
from pdserve_common.channels import aio_channel, aio_server, bind
from pdserve_worker.decode.service import DecodeServicer
from pdserve_worker.decode.worker import DecodeWorker
from pdserve_worker.engines.native import NativeEngine
from pdserve_worker.model.sampling.params import SamplingParams
from pdserve_worker.rpc.convert import sampling_to_proto
from pdserve_worker.rpc.trailers import push_settled
from pdserve_worker.serving.settings import WorkerSettings
from pdserve_worker.transfer.registry import create_engine

SVC, TOKEN = "test/forged-migration", "secret-token"
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]  # 7 prompt tokens + 3 streamed
SEED = 5


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    from pdserve_worker.model.loading.loader import load_model

    return load_model(str(tiny_model_dir), dtype="float32")


@pytest_asyncio.fixture(params=[False], ids=["digests-off"])
async def decode(loaded, request):
    """A decode with KV digests off by default: the state checks below come after the digest
    check, which a forged notify without a digest would fail first (tested on its own below)."""
    settings = WorkerSettings(
        role="decode",
        service=SVC,
        broker_address="127.0.0.1:1",
        broker_token=TOKEN,
        worker_id="decode-0",
        advertise_host="127.0.0.1",
        grpc_port=free_port(),
        transfer_port=free_port(),
        model_dtype="float32",
        max_length=64,
        slots=2,
        kv_digest=request.param,
    )
    backend = create_engine("cpu")
    if not settings.kv_digest:
        backend.digest = None  # as process/startup.py does for PDSERVE_KV_DIGEST=false
    assert backend.engine.initialize(settings.engine_id) == backend.api.SUCCESS
    worker = DecodeWorker(settings, NativeEngine(loaded), backend, "rev")
    await worker.start()
    server = aio_server(TokenTable({SVC: TOKEN}))
    worker_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(worker), server)
    bind(server, "127.0.0.1", settings.grpc_port)
    await server.start()
    attacker = create_engine("cpu")
    assert attacker.engine.initialize(f"127.0.0.1:{free_port()}") == attacker.api.SUCCESS
    attacker.ensure_connected(settings.engine_id, 2000)
    channel = aio_channel(settings.grpc_endpoint, TOKEN)
    try:
        yield worker, worker_pb2_grpc.DecodeStub(channel), attacker
    finally:
        await channel.close()
        await server.stop(None)
        worker.close()
        attacker.engine.finalize()
        backend.engine.finalize()
        worker.free()


def notify(attacker, engine_id: str, grant, nonce: str, **fields) -> None:
    message = {
        "request_id": "victim",
        "slot": grant.slot,
        "generation": grant.generation,
        "nonce": nonce,
        "num_tokens": len(PROMPT) - 1,
        "first_token": PROMPT[-1],
        "migrated": 1,
        "seed": SEED,
        "num_generated": 3,
        **fields,
    }
    status = attacker.engine.send_notify(engine_id, attacker.api.NotifyDesc("kv_ready", json.dumps(message)), 2000)
    assert status == attacker.api.SUCCESS


async def generate(stub, grant, *, migrated: bool = True, timeout_ms: int = 1500, prompt=PROMPT):
    params = SamplingParams(max_tokens=8, temperature=0.7, seed=SEED, ignore_eos=True)
    call = stub.Generate(
        worker_pb2.GenerateRequest(
            request_id="victim",
            slot=grant.slot,
            generation=grant.generation,
            prompt_token_ids=prompt,
            sampling=sampling_to_proto(params),
            readiness_timeout_ms=timeout_ms,
            num_generated=3,
            migrated=migrated,
        )
    )
    return call


async def reserve(stub):
    return await stub.Reserve(
        worker_pb2.ReserveRequest(request_id="victim", num_prompt_tokens=len(PROMPT), max_tokens=5, lease_ms=30_000)
    )


@pytest.mark.asyncio
async def test_a_migration_notify_without_the_nonce_is_dropped_and_the_request_never_starts(decode) -> None:
    worker, stub, attacker = decode
    grant = await reserve(stub)
    dropped = (await stub.Status(worker_pb2.StatusRequest())).notifies_dropped
    call = await generate(stub, grant)
    for i in range(50):
        notify(attacker, worker.settings.engine_id, grant, os.urandom(16).hex() if i % 2 else "")
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async for event in call:
            raise AssertionError(f"a forged migration produced a token: {event}")
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    status = await stub.Status(worker_pb2.StatusRequest())
    assert status.notifies_dropped - dropped == 50
    assert worker.loop.stats.requests == 0  # nothing joined the batch
    usage = worker.slots.usage()
    assert usage.committed == 0 and usage.quarantined == 1  # never committed: quarantined, not reused


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "fields, why",
    [
        ({"seed": SEED + 1}, "generation state"),
        ({"num_generated": 2}, "generation state"),
        ({"num_tokens": len(PROMPT)}, "tokens of KV"),
        ({"first_token": 99}, "tokens of KV"),
        ({"migrated": 0}, "a prefill's KV came for a migrated request"),
    ],
)
async def test_a_notify_with_the_nonce_but_not_the_request_s_state_is_refused(decode, fields, why) -> None:
    worker, stub, attacker = decode
    grant = await reserve(stub)
    call = await generate(stub, grant)
    notify(attacker, worker.settings.engine_id, grant, grant.nonce.hex(), **fields)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async for event in call:
            raise AssertionError(f"a mismatched migration produced a token: {event}")
    assert raised.value.code() == grpc.StatusCode.ABORTED and why in raised.value.details()
    assert worker.loop.stats.requests == 0


@pytest.mark.asyncio
@pytest.mark.parametrize("decode", [True], ids=["digests-on"], indirect=True)
async def test_with_digests_on_a_notify_with_the_nonce_but_no_digest_is_refused_by_name(decode) -> None:
    worker, stub, attacker = decode
    grant = await reserve(stub)
    call = await generate(stub, grant)
    notify(attacker, worker.settings.engine_id, grant, grant.nonce.hex())
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async for event in call:
            raise AssertionError(f"a migration without a digest produced a token: {event}")
    assert raised.value.code() == grpc.StatusCode.ABORTED and "carries no 'kv_digest'" in raised.value.details()
    assert worker.loop.stats.requests == 0


@pytest.mark.asyncio
async def test_a_migration_notify_for_a_prefilled_request_is_refused(decode) -> None:
    worker, stub, attacker = decode
    grant = await reserve(stub)
    call = await generate(stub, grant, migrated=False)
    notify(attacker, worker.settings.engine_id, grant, grant.nonce.hex(), num_tokens=len(PROMPT))
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async for _ in call:
            pass
    assert raised.value.code() == grpc.StatusCode.ABORTED and "migration's KV" in raised.value.details()


@pytest.mark.asyncio
async def test_a_migrated_generate_needs_a_streamed_token(decode) -> None:
    _, stub, _ = decode
    grant = await reserve(stub)
    call = stub.Generate(
        worker_pb2.GenerateRequest(
            request_id="victim",
            slot=grant.slot,
            generation=grant.generation,
            prompt_token_ids=PROMPT,
            migrated=True,
            num_generated=0,
        )
    )
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async for _ in call:
            pass
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.asyncio
async def test_migrate_of_a_request_never_handed_over_is_refused(decode) -> None:
    _, stub, _ = decode
    grant = await reserve(stub)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await stub.Migrate(
            worker_pb2.MigrateRequest(
                request_id="victim", slot=grant.slot, generation=grant.generation, targets=[grant]
            )
        )
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert push_settled(raised.value)
