"""Live migration through real processes (issue #17's acceptance): `pdserve local` (broker, one
prefill, two decodes, router; the tiny model with 16 layers, and the real default model SmolLM2;
two layer-sharded groups of 2 members each, where decode-0/decode-1 below are their leaders and
each member pushes its own layers, issue #29; the 4-layer tiny model on two tensor-parallel decodes
of 2 ranks, each rank pushing its KV head, issue #32).

4 greedy streams of 256 tokens and 2 seeded sampled ones run on decode-0 (decode-1's slots
are held meanwhile, so the router puts them all on decode-0); then decode-0 is drained through
its admin port (the pod's preStop). The drain answers in under 2 s while the streams go on,
no prefill is called during it (the prefill's request counter), every stream's text is that
of an undisturbed run of the same deployment, each answer says it moved once to decode-1,
decode-0's KV is all free, the migrations are counted on both ends' /metrics, and no process
is left after the deployment stops. Then the faults: the target decode killed mid-migration,
the source killed mid-migration; either way the request resumes with identical text.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import threading
import time

import grpc
import httpx
import pytest

from pdserve.v1 import worker_pb2, worker_pb2_grpc
from support.deployments import local_deployment
from support.local_run import Answer, LocalRun, served_model, stream_completion
from support.tiny_model import write_tiny_model

pytestmark = pytest.mark.slow

SLOTS, MAX_LEN, MAX_TOKENS = 8, 320, 256
GREEDY = ["The quick brown fox", "Paris is the capital of", "A language model predicts", "Berlin is"]
SEEDED = [("Once upon a time", 7), ("In a galaxy far away", 8)]


@pytest.fixture(scope="module")
def deep_tiny_dir(tmp_path_factory):
    """The tiny model with 16 layers: a decode step costs about 4x the 4-layer one's, so 256-token
    streams still run when the drain comes on a loaded machine."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-16-layers"), num_layers=16)


@pytest.fixture(scope="module", params=["tiny-16-layers", "smollm2", "tiny-16-layers-groups", "tiny-4-layers-tp"])
def local(request, tmp_path_factory):
    """The tiny model in fp32, and the real default model as a user runs it (`builtin:smollm2`,
    dtype and weights auto: bf16 where the CPU has it, int4 matrices; a route whose logits do not
    depend on the batch, tests/unit/test_batch_invariance.py); the tiny model on two layer-
    sharded decode groups of 2 members (each member pushes its own layers when its group drains);
    and the 4-layer tiny model on two tensor-parallel decodes of 2 ranks (each rank pushes its KV
    head, issue #32)."""
    options: dict = {}
    if request.param == "smollm2":
        model, options["dtype"] = "builtin:smollm2", None  # its own dtype
    elif request.param == "tiny-4-layers-tp":  # (2 ranks per step on 2 cores: 4 layers keep it short)
        model = write_tiny_model(tmp_path_factory.mktemp("tiny-4-layers"))
    else:
        model = request.getfixturevalue("deep_tiny_dir")
    if request.param.endswith("-groups"):
        options["layer_shards"] = 2
    if request.param.endswith("-tp"):
        options["decode_tp"] = 2
    run = local_deployment(
        tmp_path_factory.mktemp("pd-migrate"),
        model,
        slots=SLOTS,
        max_len=MAX_LEN,
        threads=1,
        env={"PDSERVE_DRAIN_TIMEOUT_SECONDS": 20},
        **options,
    )
    pids = {c["pid"] for c in run.manifest["children"]}
    yield run
    run.stop_cleanly(also=pids)


def body(model: str, prompt: str, seed: int | None) -> dict:
    sampling = {"temperature": 0.8, "top_p": 0.95, "seed": seed} if seed is not None else {"temperature": 0}
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **sampling,
    }


def stream(url: str, model: str, prompt: str, seed: int | None, answer: Answer) -> Answer:
    return stream_completion(url, body(model, prompt, seed), answer)


REQUESTS = [(p, None) for p in GREEDY] + SEEDED


def model_of(local: LocalRun) -> str:
    return served_model(local.url)


def decodes(local: LocalRun) -> list[str]:
    """The decode instances routers see: decode-0, decode-1, or their groups' leaders."""
    return sorted(c["name"] for c in local.manifest["children"] if c["role"] == "decode")


@pytest.fixture(scope="module")
def reference(local) -> list[str]:
    """Each request's text without a drain: all at once (a row's tokens do not depend on its
    batch on these routes; one batched pass instead of six streams one after another)."""
    model = model_of(local)
    with concurrent.futures.ThreadPoolExecutor(len(REQUESTS)) as pool:
        answers = list(pool.map(lambda r: stream(local.url, model, r[0], r[1], Answer()), REQUESTS))
    for a in answers:
        assert a.error is None and a.completion_tokens == MAX_TOKENS and not a.pdserve.get("migrations")
    return [a.text for a in answers]


def stub(local: LocalRun, name: str) -> tuple[grpc.Channel, worker_pb2_grpc.DecodeStub]:
    channel = grpc.insecure_channel(local.child(name)["grpc"])
    return channel, worker_pb2_grpc.DecodeStub(channel)


def auth(local: LocalRun) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {local.token}"),)


def scrape(address: str) -> dict[str, float]:
    text = httpx.get(f"http://{address}/metrics", timeout=5).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^([a-z_]+(?:\{[^}]*\})?) ([0-9.e+-]+)$", text, re.M)}


def prefills_served(local: LocalRun) -> float:
    return scrape(local.child("prefill-0")["http"]).get("pdserve_prefill_request_seconds_count", 0.0)


class Held:
    """Every slot of a decode reserved (a long lease), so the router puts requests elsewhere."""

    def __init__(self, local: LocalRun, name: str) -> None:
        self.channel, self.stub = stub(local, name)
        self.meta = auth(local)
        self.grants = [
            self.stub.Reserve(
                worker_pb2.ReserveRequest(request_id=f"hold-{i}", num_prompt_tokens=4, max_tokens=4, lease_ms=120_000),
                metadata=self.meta,
                timeout=5,
            )
            for i in range(SLOTS)
        ]

    def release(self) -> None:
        for g in self.grants:
            self.stub.Release(
                worker_pb2.ReleaseRequest(
                    request_id=g.request_id, slot=g.slot, generation=g.generation, push_settled=True
                ),
                metadata=self.meta,
                timeout=5,
            )
        self.channel.close()


def run_streams(local: LocalRun, when_chunks: int, action) -> tuple[list[Answer], object]:
    """Stream every request; once each has `when_chunks` chunks, run `action()` (in this thread)."""
    model = model_of(local)
    answers = [Answer() for _ in REQUESTS]
    with concurrent.futures.ThreadPoolExecutor(len(REQUESTS)) as pool:
        futures = [pool.submit(stream, local.url, model, p, s, a) for (p, s), a in zip(REQUESTS, answers)]
        deadline = time.monotonic() + 60
        while not all(a.chunks >= when_chunks for a in answers):
            assert time.monotonic() < deadline, [a.chunks for a in answers]
            assert not any(f.done() for f in futures), [a.error for a in answers]
            time.sleep(0.002)
        assert all(a.chunks < MAX_TOKENS for a in answers), "a stream ended before the action was due"
        result = action()
        for f in futures:
            f.result(timeout=120)
    return answers, result


def active_requests(local: LocalRun, name: str) -> int:
    channel, decode = stub(local, name)
    with channel:
        return decode.Status(worker_pb2.StatusRequest(), metadata=auth(local), timeout=5).active_requests


def forged_member_pushes_are_refused(local: LocalRun) -> int:
    """A group follower's PushHandoff (its layers of a request, to any engine named) runs only for
    a decode's token (a router's is refused by the policy) and that reservation's nonce. Returns
    how many followers were probed (none outside the groups deployment)."""
    from pdserve.v1 import shard_pb2, shard_pb2_grpc
    from pdserve_common.auth import role_token

    followers = [c for c in local.manifest["children"] if c["role"] == "decode-member"]
    forged = shard_pb2.PushHandoffRequest(slot=0, generation=1, nonce="00" * 16, num_tokens=4)
    for follower in followers:
        with grpc.insecure_channel(follower["grpc"]) as channel:
            shard = shard_pb2_grpc.DecodeShardStub(channel)
            for role, needle in (("router", "may not call"), ("decode", "nonce is not that reservation's")):
                meta = (("authorization", f"Bearer {role_token(local.token, role)}"),)
                with pytest.raises(grpc.RpcError) as refused:
                    shard.PushHandoff(forged, metadata=meta, timeout=10)
                assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, refused.value.details()
                assert needle in refused.value.details()
    return len(followers)


def test_draining_a_decode_moves_its_streams_without_prefill(local, reference):
    source, target = decodes(local)
    assert forged_member_pushes_are_refused(local) == (2 if source.count("-") == 2 else 0)  # decode-0-0: a group
    drain: dict = {}

    def drain_decode_0() -> None:
        # The drain is only a test of migration if the source still holds every stream: on a
        # loaded machine the client may read its fourth chunk after the decode has finished.
        drain["active"] = active_requests(local, source)
        held.release()  # the target has room again
        if drain["active"] != len(REQUESTS):
            return  # nothing drained: the streams finish where they are, and the test tries again
        drain["prefills"] = prefills_served(local)
        started = time.monotonic()
        drain["answer"] = local.drain(source)
        drain["seconds"] = time.monotonic() - started
        drain["prefills_after"] = prefills_served(local)

    for _ in range(3):
        held = Held(local, target)
        answers, _ = run_streams(local, 4, drain_decode_0)
        if "answer" in drain:
            break
    assert "answer" in drain, f"in 3 tries the streams were done before the drain (active: {drain['active']})"
    for a, text in zip(answers, reference):
        assert a.error is None and a.completion_tokens == MAX_TOKENS and a.finish_reason == "length"
        assert a.text == text, "a migrated stream's text differs from the undisturbed run"
        assert a.pdserve.get("migrations") == 1 and a.pdserve.get("decode") == target, a.pdserve
        assert not a.pdserve.get("retries")
    print(f"drain of {source} with {len(REQUESTS)} streams: {drain['seconds']:.3f}s")
    assert drain["answer"].get("drained") is True
    assert drain["seconds"] < 2.0, f"the drain took {drain['seconds']:.2f}s"
    assert drain["prefills_after"] == drain["prefills"], "a prefill was made during the drain"
    channel, decode0 = stub(local, source)
    with channel:
        status = decode0.Status(worker_pb2.StatusRequest(), metadata=auth(local), timeout=5)
    assert status.slots_free == status.slots_total and status.kv_tokens_used == 0 and status.active_requests == 0
    sent, received = scrape(local.child(source)["http"]), scrape(local.child(target)["http"])
    assert sent['pdserve_decode_migrations_total{outcome="migrated"}'] == len(REQUESTS)
    assert sent["pdserve_decode_migration_bytes_total"] > 0
    assert received["pdserve_decode_migrations_received_total"] == len(REQUESTS)
    router = scrape(local.url.removeprefix("http://"))
    assert router['pdserve_router_migrations_total{outcome="migrated"}'] == len(REQUESTS)
    assert router.get('pdserve_router_migrations_total{outcome="fallback"}', 0) == 0


@pytest.fixture
def three_decodes(deep_tiny_dir, tmp_path, local_deployments):
    run = local_deployments(
        tmp_path / "pd-migrate-faults",
        deep_tiny_dir,
        decode=3,
        slots=SLOTS,
        max_len=MAX_LEN,
        threads=1,
        on_exit="ignore",
        env={"PDSERVE_DRAIN_TIMEOUT_SECONDS": 20, "PDSERVE_TRANSFER_TIMEOUT_MS": 2000},
    )
    pids = {c["pid"] for c in run.manifest["children"]}
    yield run
    run.stop_cleanly(also=pids)


def undisturbed(local: LocalRun) -> list[str]:
    model = model_of(local)
    return [stream(local.url, model, p, s, Answer()).text for p, s in REQUESTS]


@pytest.mark.timing  # (the kill must land while the drain's migrations run: alone, after the parallel phase)
@pytest.mark.parametrize("victim", ["target", "source"])
def test_a_decode_killed_mid_migration_leaves_every_text_identical(three_decodes, victim):
    """The kill lands while the drain's migrations run (as soon as the router counted the first
    one): each request either moved before it, or resumes by re-prefilling (a migration that
    fails falls back to that too); none is lost or changed."""
    local = three_decodes
    expected = undisturbed(local)
    holds = {name: Held(local, name) for name in ("decode-1", "decode-2")}
    killed = "decode-1" if victim == "target" else "decode-0"
    killed_at: list[float] = []

    def drain_and_kill() -> None:
        holds["decode-1"].release()  # the migrations' target
        if victim == "source":
            holds["decode-2"].release()  # room for the resumes
        drainer = threading.Thread(target=lambda: _drain_quietly(local, "decode-0"), daemon=True)
        drainer.start()
        deadline = time.monotonic() + 10
        while sum(migrations(local).values()) < 1:  # the first request has moved: kill amid the rest
            assert time.monotonic() < deadline, "no migration began"
        os.kill(local.child(killed)["pid"], signal.SIGKILL)
        killed_at.append(time.monotonic())
        if victim == "target":
            time.sleep(0.5)
            holds["decode-2"].release()  # the resumes find room here
        drainer.join(30)

    answers, _ = run_streams(local, 4, drain_and_kill)
    moved = resumed = 0
    for i, (a, text) in enumerate(zip(answers, expected)):
        if a.text != text:
            at = next((j for j, (x, y) in enumerate(zip(a.text, text)) if x != y), min(len(a.text), len(text)))
            print(f"DIVERGED request {i} {REQUESTS[i]} at char {at} of {len(text)}: {a.pdserve}")
    for a, text in zip(answers, expected):
        assert a.error is None and a.completion_tokens == MAX_TOKENS, a.error
        assert a.text == text, f"{victim} killed: a stream's text differs from the undisturbed run"
        # No stream ends on the drained decode; none on the killed one unless it had finished
        # there before the kill (a stream that moved to the target early and was short).
        ended = a.pdserve.get("decode")
        assert ended != "decode-0", a.pdserve
        assert ended != killed or a.arrivals[-1] < killed_at[0], (a.pdserve, a.arrivals[-1], killed_at)
        moved += bool(a.pdserve.get("migrations"))
        resumed += bool(a.pdserve.get("retries"))
    counted = migrations(local)
    assert moved + resumed >= len(REQUESTS) and counted["migrated"] >= 1
    if victim == "target":
        assert resumed >= 1  # at least the streams that had moved to it went on elsewhere
    print(
        f"{victim} killed mid-drain: router counted {counted}; {moved} answers ended on their migration "
        f"target, {resumed} resumed by re-prefill"
    )


def migrations(local: LocalRun) -> dict[str, float]:
    router = scrape(local.url.removeprefix("http://"))
    return {o: router.get(f'pdserve_router_migrations_total{{outcome="{o}"}}', 0.0) for o in ("migrated", "fallback")}


def _drain_quietly(local: LocalRun, name: str) -> None:
    try:
        local.drain(name)
    except (httpx.HTTPError, AssertionError):
        pass  # the drained decode itself was killed: its admin port is gone
