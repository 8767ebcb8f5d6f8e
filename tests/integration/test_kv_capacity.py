"""KV capacity in blocks: with the KV memory of `--slots 8 --max-len 2048`, one decode admits at
least 4x as many concurrent requests of 300 prompt + 64 output tokens as max-length slots do
(issue #16's acceptance). Counted through the decode's gRPC Reserve until the first
RESOURCE_EXHAUSTED, which the router answers as HTTP 429."""

from __future__ import annotations

import grpc
import pytest

from netutil import free_port
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve_common.auth import TokenTable
from pdserve_common.channels import aio_channel, aio_server, bind
from pdserve_worker.decode.service import DecodeServicer
from pdserve_worker.decode.worker import DecodeWorker
from pdserve_worker.engines.native import NativeEngine
from pdserve_worker.serving.settings import WorkerSettings
from pdserve_worker.transfer.registry import create_engine

SVC, TOKEN = "test/capacity", "secret-token"
SLOTS, MAX_LEN, PROMPT, OUTPUT = 8, 2048, 300, 64


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from pdserve_worker.model.loading.loader import load_model
    from support.tiny_model import write_tiny_model

    folder = write_tiny_model(tmp_path_factory.mktemp("tiny-2048"), max_position_embeddings=MAX_LEN)
    return load_model(str(folder), dtype="float32")


async def admissions(loaded, **decode_settings) -> tuple[int, str, worker_pb2.DecodeStatus]:
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
        max_length=MAX_LEN,
        **decode_settings,
    )
    backend = create_engine("cpu")
    assert backend.engine.initialize(settings.engine_id) == backend.api.SUCCESS
    worker = DecodeWorker(settings, NativeEngine(loaded), backend, "rev")
    await worker.start()
    server = aio_server(TokenTable({SVC: TOKEN}))
    worker_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(worker), server)
    bind(server, "127.0.0.1", settings.grpc_port)
    await server.start()
    try:
        async with aio_channel(settings.grpc_endpoint, TOKEN) as channel:
            stub = worker_pb2_grpc.DecodeStub(channel)
            for admitted in range(10_000):
                try:
                    await stub.Reserve(
                        worker_pb2.ReserveRequest(
                            request_id=f"r{admitted}", num_prompt_tokens=PROMPT, max_tokens=OUTPUT, lease_ms=60_000
                        )
                    )
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                    status = await stub.Status(worker_pb2.StatusRequest())
                    return admitted, exc.details(), status
    finally:
        await server.stop(None)
        worker.close()
        backend.engine.finalize()
        worker.free()
    raise AssertionError("never refused")


@pytest.mark.asyncio
async def test_blocks_admit_four_times_the_requests_of_slots_in_the_same_memory(loaded) -> None:
    slots, slot_refusal, slot_status = await admissions(loaded, slots=SLOTS, kv_block_tokens=0)
    assert slots == SLOTS and "no free KV slot" in slot_refusal
    assert (slot_status.kv_tokens_used, slot_status.kv_tokens_total) == (SLOTS * MAX_LEN, SLOTS * MAX_LEN)

    # The same memory (kv_tokens default: slots x max_len), blocks of 16, a request cap of 256.
    blocks, block_refusal, block_status = await admissions(
        loaded, slots=256, kv_block_tokens=16, kv_tokens=SLOTS * MAX_LEN
    )
    per_request = -(-(PROMPT + OUTPUT) // 16) * 16  # 368 tokens: 23 blocks
    assert blocks == (SLOTS * MAX_LEN) // per_request == 44
    assert blocks >= 4 * slots
    assert "needs 23 blocks (364 tokens)" in block_refusal
    assert block_status.kv_tokens_total == SLOTS * MAX_LEN
    assert block_status.kv_tokens_used == blocks * per_request
    assert block_status.slots_used == blocks and block_status.slots_total == 256


@pytest.mark.asyncio
async def test_the_request_cap_still_holds_with_blocks(loaded) -> None:
    admitted, refusal, _ = await admissions(loaded, slots=5, kv_block_tokens=16, kv_tokens=SLOTS * MAX_LEN)
    assert admitted == 5 and "all 5 reservations in use" in refusal
