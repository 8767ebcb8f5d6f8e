"""The two-sided baseline serves the same answers as the one-sided push (seed 002's comparison
is between two working systems): a broker, a decode and a prefill worker over real gRPC, their
KV moved once by the host engine (one-sided) and once by gloo send/recv (two-sided), and the
router's `PDBackend` generating greedily from both; both must equal one process's `generate`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from pdserve_worker.decode.worker import DecodeWorker
from pdserve_worker.engines.native import NativeEngine
from pdserve_worker.model.engine import generate
from pdserve_worker.model.sampling.params import SamplingParams
from pdserve_worker.prefill.worker import PrefillWorker
from pdserve_worker.router.config import Timeouts
from pdserve_worker.router.pd_backend import PDBackend
from support.inprocess_stack import Stack

SVC, TOKEN, REVISION = "test/two-sided", "secret-token", "rev-1"
MAX_LEN = 64
PROMPTS = ("Paris is the capital of", "One, two, three, four,", "The quick brown fox")


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    from pdserve_worker.model.loading.loader import load_model

    return load_model(str(tiny_model_dir), dtype="float32")


@asynccontextmanager
async def pd(loaded, transfer: str) -> AsyncIterator[tuple[PDBackend, DecodeWorker, object]]:
    stack = Stack(SVC, TOKEN, max_len=MAX_LEN, slots=2)
    try:
        d_settings = stack.settings("decode")
        d_backend = stack.engine(d_settings, transfer)
        decode = DecodeWorker(d_settings, NativeEngine(loaded), d_backend, REVISION)
        await stack.serve_decode(decode)
        p_settings = stack.settings("prefill")
        prefill = PrefillWorker(p_settings, NativeEngine(loaded), stack.engine(p_settings, transfer), REVISION)
        await stack.serve_prefill(prefill, REVISION)
        timeouts = Timeouts(rpc_s=5.0, lease_ms=10_000, readiness_ms=20_000, prefill_s=30, settle_s=5.0)
        backend = await stack.pd_backend(loaded.tokenizer, REVISION, timeouts)
        try:
            yield backend, decode, d_backend
        finally:
            await backend.close()
    finally:
        await stack.close()


async def answers(loaded, transfer: str) -> tuple[list[list[int]], int, dict[str, int]]:
    """Greedy tokens per prompt, the KV bytes pushed, and the decode engine's copy counts."""
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    out, kv_bytes = [], 0
    async with pd(loaded, transfer) as (backend, _decode, d_backend):
        for i, text in enumerate(PROMPTS):
            events = [
                e async for e in backend.generate(loaded.tokenizer.encode(text), params, f"req-{i}", cache_scope="")
            ]
            out.append([e.token_id for e in events])
            info = [e.info for e in events if e.info is not None][-1]
            assert info.disaggregated and info.kv_transfer_s is not None
            kv_bytes += info.kv_bytes
        copies = d_backend.engine.copy_stats()
    return out, kv_bytes, copies


@pytest.mark.asyncio
async def test_two_sided_and_one_sided_transfer_give_the_same_greedy_text(loaded):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    prompts = [loaded.tokenizer.encode(text) for text in PROMPTS]
    expected = [r.output_ids for r in generate(loaded.model, loaded.tokenizer, prompts, params, max_len=MAX_LEN)]
    one_sided, _, _ = await answers(loaded, "cpu")
    two_sided, kv_bytes, copies = await answers(loaded, "two-sided")
    assert one_sided == expected
    assert two_sided == expected
    # The decode really received them two-sided: into staging, then copied into its blocks.
    assert copies["socket_recv"] == copies["staging_copy"] == kv_bytes > 0
