"""Routing from the prefills' own reports (issue #30, item 4), in process: two routers, two real
prefills with prefix caches, one decode, one broker. Router A serves four prompts; router B,
which never saw them, serves their continuations in the opposite order. Following the
prefills' block events (`Prefill.BlockEvents`), B sends every continuation to the prefill that
holds its prefix (each reports cached tokens) — a router predicting from its own history has
none to go by. The answers are the greedy ones either way."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve_common.membership import MemberInfo, Role
from pdserve_worker.decode.service import DecodeServicer
from pdserve_worker.decode.worker import DecodeWorker
from pdserve_worker.engines.native import NativeEngine
from pdserve_worker.model.loading.loader import load_model
from pdserve_worker.model.sampling.params import SamplingParams
from pdserve_worker.prefill.service import PrefillServicer
from pdserve_worker.prefill.worker import PrefillWorker
from pdserve_worker.router.config import RouterConfig, Timeouts
from pdserve_worker.router.pd_backend import PDBackend
from support.inprocess_stack import Stack

SVC, TOKEN, REVISION = "ns/kv-events", "kv-events-token-0123456789", "rev-kv-events"
MAX_LEN, SLOTS = 256, 4
PARAMS = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
SCOPE = '["anonymous",""]'


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), dtype="float32")


def router(stack: Stack, loaded, routing: str) -> PDBackend:
    return PDBackend(
        RouterConfig(
            model_name="tiny",
            max_model_len=MAX_LEN,
            revision=REVISION,
            disaggregation="always",  # (the push road: conftest.py)
            token=TOKEN,
            timeouts=Timeouts(rpc_s=2.0, lease_ms=5000, readiness_ms=10_000, prefill_s=30),
            prefix_routing=routing,
        ),
        tokenizer=loaded.tokenizer,
        broker=stack.client(),
    )


async def cached_tokens(backend: PDBackend, prompt: list[int], request_id: str) -> int:
    """The prompt tokens the prefill took from its cache, as the request's last report says: the
    first event's report may come before the prefill's reply (then without the cache's figure),
    the last one waits for it (the router keeps the latest, api/backend.RequestInfo)."""
    events = [e async for e in backend.generate(prompt, PARAMS, request_id, cache_scope=SCOPE)]
    infos = [e.info for e in events if e.info is not None]
    return infos[-1].cached_tokens if infos else 0


async def two_routers(loaded, routing_b: str) -> tuple[list[int], list[int], list[int]]:
    stack = Stack(SVC, TOKEN, max_len=MAX_LEN, slots=SLOTS)
    routers: list[PDBackend] = []
    try:
        d = stack.settings(
            "decode", decode_prefix_cache=False
        )  # (the prefill's cache under test: the decode's own (kv/decode_prefix.py) would serve repeats first)
        decode = stack.worker(DecodeWorker(d, NativeEngine(loaded), stack.engine(d), REVISION))
        await decode.start()
        await stack.serve(
            d.grpc_port, lambda s: worker_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(decode), s)
        )
        await stack.join(decode.member_info(), decode.load)
        prefills = []
        for i in range(2):
            p = stack.settings("prefill", i, prefix_cache_tokens=1024)
            worker = stack.worker(PrefillWorker(p, NativeEngine(loaded), stack.engine(p), REVISION))
            prefills.append(worker)
            servicer = PrefillServicer(worker)
            await stack.serve(p.grpc_port, lambda s, v=servicer: worker_pb2_grpc.add_PrefillServicer_to_server(v, s))
            await stack.join(
                MemberInfo(
                    worker_id=f"prefill-{i}", role=Role.PREFILL, grpc_endpoint=p.grpc_endpoint, revision=REVISION
                ),
                worker.load,
            )
        a, b = router(stack, loaded, "events"), router(stack, loaded, routing_b)
        routers += [a, b]
        for r in routers:
            await r.start()
            await r.view.wait_for(lambda v: len(v.members) == 3, 5)
        tok = loaded.tokenizer
        prompts = [tok.encode(f"Topic {i}: " + " ".join(["alpha beta gamma delta"] * (6 + i))) for i in range(4)]
        first = [await cached_tokens(a, p, f"a-{i}") for i, p in enumerate(prompts)]
        held = sum(w.prefix.stats().cached_blocks for w in prefills)
        if routing_b == "events":  # B's index catches up with what the prefills hold
            async with asyncio.timeout(10):
                while sum(b.members._reported.size(f"prefill-{i}") for i in range(2)) < held:
                    await asyncio.sleep(0.05)
        second = [await cached_tokens(b, prompts[i] + tok.encode(" and more"), f"b-{i}") for i in reversed(range(4))]
        # The RPC itself, as a router calls it: authenticated, a snapshot first.
        reply = await worker_pb2_grpc.PrefillStub(stack.channel(prefills[0].settings.grpc_endpoint)).BlockEvents(
            worker_pb2.BlockEventsRequest()
        )
        assert reply.enabled and reply.reset and reply.block_tokens == 16 and len(reply.salt) == 32
        return first, second, [len(p) for p in prompts]
    finally:
        for r in routers:
            await r.close()
        await stack.close()


@pytest.mark.asyncio
async def test_a_router_that_follows_the_reports_finds_prefixes_another_router_placed(loaded):
    first, second, lengths = await two_routers(loaded, "events")
    assert first == [0, 0, 0, 0]
    # Every continuation found its prefix (whole blocks, the last token always computed).
    for cached, n in zip(second, reversed(lengths)):
        assert cached >= (n - 1) // 16 * 16 - 16 and cached > 0, (second, lengths)
    # The same run with router B predicting from its own (empty) history: it misses.
    _, predicted, _ = await two_routers(loaded, "predict")
    assert sum(1 for c in predicted if c) < sum(1 for c in second if c), (predicted, second)
