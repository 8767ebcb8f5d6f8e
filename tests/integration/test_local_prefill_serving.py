"""Conditional disaggregation end to end (router/disaggregation.py, decode/local_prefill.py):
`pdserve local --disaggregation never` (real processes, the tiny model made 24 layers deep, fp32)
computes each prompt on its decode, one position per step while it also decodes, and must answer exactly as colocated generation
does, greedy or seeded, one at a time or six at once; nothing is pushed and no prefill is named;
what a decode cannot compute (prompt logprobs) still goes to the prefill; a client that leaves
mid-prefill frees its blocks; the counters say which road each request took.
"""

from __future__ import annotations

import concurrent.futures
import re
import time
from typing import Any

import httpx
import pytest

from support.clients import debug_client, scrape
from support.deployments import local_deployment

pytestmark = pytest.mark.slow

MAX_LEN = 256
LAYERS = 24  # (the tiny model has 4)
CHUNK = 1  # --prefill-chunk-tokens: every prompt takes a turn of the decode's loop per position
PROMPTS = [
    "The quick brown fox jumps over the lazy dog, and then it runs away into the forest",
    "Paris is the capital of",
    "A language model predicts the next token of a text from the tokens before it, one at a time",
    "Numbers like 12345 and 67890 are",
    "Prefill computes the cache of a prompt; decode reads it",
    "Unicode text: café, naïve, and more",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny model, LAYERS deep: a step of the decode's loop is then long enough that a prompt's
    prefill (a position per step) lasts a few hundred ms, which the kill test must catch."""
    from support.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("deep-tiny-model"), num_layers=LAYERS)


@pytest.fixture(scope="module")
def reference(model_dir):
    from pdserve_worker.model.engine import generate
    from pdserve_worker.model.loading.loader import load_model
    from pdserve_worker.model.sampling.params import SamplingParams

    loaded = load_model(str(model_dir), dtype="float32")

    def complete(prompt: str, **params) -> str:
        ids = loaded.tokenizer.encode(prompt)
        [done] = generate(loaded.model, loaded.tokenizer, [ids], SamplingParams(**params), max_len=MAX_LEN)
        return done.text

    complete.tokenizer = loaded.tokenizer  # type: ignore[attr-defined]
    return complete


@pytest.fixture(scope="module")
def local(model_dir, tmp_path_factory):
    run = local_deployment(
        tmp_path_factory.mktemp("local-prefill"),
        model_dir,
        slots=4,
        max_len=MAX_LEN,
        disaggregation="never",
        prefill_chunk_tokens=CHUNK,
        on_exit="restart",  # (the last test kills a decode, as a pod's container would die)
    )
    seen: set[int] = set()
    run.seen_pids = seen  # type: ignore[attr-defined]
    yield run
    run.stop_cleanly(also=seen)


@pytest.fixture(scope="module")
def client(local):
    return debug_client(local.url)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_answers_computed_on_the_decode_match_colocated(client, model, reference):
    for prompt in PROMPTS[:3]:
        answer = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0)
        assert answer.choices[0].text == reference(prompt, max_tokens=16, temperature=0)
        report = answer.model_extra["pdserve"]
        assert report["disaggregated"] is False and report["kv_bytes"] == 0
        assert "prefill" not in report and report["decode"] in ("decode-0", "decode-1")
    seeded = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=16, temperature=0.8, seed=5)
    assert seeded.choices[0].text == reference(PROMPTS[1], max_tokens=16, temperature=0.8, seed=5)


def test_six_at_once_interleave_their_chunks_with_the_others_steps(client, model, reference):
    """Prompts of several chunks arriving while others decode: each still gets exactly its answer."""

    def one(prompt: str) -> str:
        return client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(one, PROMPTS))
    assert answers == [reference(p, max_tokens=24, temperature=0) for p in PROMPTS]


def test_a_grammar_holds_on_the_local_road(client, model):
    """The decode draws the first token under the request's grammar too (draw_first with its tokenizer)."""
    for seed in range(3):
        answer = client.completions.create(
            model=model,
            prompt="id:",
            max_tokens=20,
            temperature=1.0,
            seed=seed,
            extra_body={"guided_regex": r"[A-Z]{2}\d{3}"},
        )
        assert re.fullmatch(r"[A-Z]{2}\d{3}", answer.choices[0].text), answer.choices[0].text
        assert answer.model_extra["pdserve"]["disaggregated"] is False


def test_prompt_logprobs_still_go_to_the_prefill(client, model, reference):
    answer = client.completions.create(
        model=model, prompt=PROMPTS[1], max_tokens=4, temperature=0, extra_body={"prompt_logprobs": 1}
    )
    assert answer.choices[0].text == reference(PROMPTS[1], max_tokens=4, temperature=0)
    report = answer.model_extra["pdserve"]
    assert report["disaggregated"] is True and report["kv_bytes"] > 0 and report["prefill"] == "prefill-0"


def test_a_client_gone_mid_prefill_frees_its_blocks(local, client, model):
    stream = client.completions.create(
        model=model, prompt=PROMPTS[2] * 4, max_tokens=60, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    stream.close()  # before its first token: while the decode computes the prompt, or just after
    deadline = time.monotonic() + 20
    decodes = [local.child(n)["http"] for n in ("decode-0", "decode-1")]
    while time.monotonic() < deadline:
        used = [scrape(d).get("pdserve_decode_kv_slots_used", -1) for d in decodes]
        if used == [0, 0]:
            break
        time.sleep(0.1)
    assert used == [0, 0], f"slots still used: {used}"


def test_the_counters_say_which_road_each_request_took(local, client, model):
    client.completions.create(model=model, prompt=PROMPTS[3], max_tokens=2, temperature=0)
    router = scrape(local.url.removeprefix("http://"))
    local_roads = router['pdserve_router_prefill_roads_total{reason="policy",road="local"}']
    assert local_roads >= 1 and router['pdserve_router_prefill_roads_total{reason="unable",road="remote"}'] >= 1
    computed = sum(
        scrape(local.child(n)["http"])["pdserve_decode_local_prefills_total"] for n in ("decode-0", "decode-1")
    )
    assert computed == local_roads  # each local road was computed by a decode, once
    prefill = scrape(local.child("prefill-0")["http"])
    assert prefill["pdserve_prefill_prompt_tokens_total"] > 0  # only the prompt-logprobs request's


def test_a_decode_killed_mid_prefill_is_replaced_and_nothing_leaks(local, reference):
    """Runs last (it kills a decode). A decode computes one prompt position per turn of its loop
    only while it also decodes (alone, it takes the whole prompt in one turn), so each decode
    first streams a long background answer; then a long prompt goes to one of them, which is
    frozen as soon as it holds both (mid-prefill, before any token reached the client), and
    SIGKILLed (and restarted, as a pod would be). The router runs the request again on a decode,
    which computes it again: the client gets exactly the colocated answer, and no decode holds a
    slot after. A try whose first token left the decode before the kill (the retry then resumes
    through the prefill: disaggregated) proves nothing: the test tries again, up to 3 times."""
    import concurrent.futures as futures
    import os
    import signal

    import grpc

    from pdserve.v1 import worker_pb2, worker_pb2_grpc
    from support.local_run import Answer, stop_process, stream_completion

    run = local
    ids = reference.tokenizer.encode(" ".join(PROMPTS * 20))[: MAX_LEN - 24]  # as long as the context allows
    prompt = reference.tokenizer.decode(ids, skip_special_tokens=True)
    expected = reference(prompt, max_tokens=12, temperature=0)
    names = ("decode-0", "decode-1")
    meta = (("authorization", f"Bearer {run.token}"),)
    stubs: dict[str, tuple[str, Any]] = {}  # name -> (its address, a Status stub on one channel)

    def active(name: str) -> int:
        address = run.child(name)["grpc"]
        if stubs.get(name, ("",))[0] != address:  # (a restarted decode listens anew)
            stubs[name] = (address, worker_pb2_grpc.DecodeStub(grpc.insecure_channel(address)))
        try:
            status = stubs[name][1].Status(worker_pb2.StatusRequest(), metadata=meta, timeout=2)
        except grpc.RpcError:
            return 0
        return int(status.active_requests)

    def serving() -> bool:
        try:
            return httpx.get(f"{run.url}/health", timeout=2).json()["members"]["decode"] == 2
        except (httpx.HTTPError, KeyError, ValueError):
            return False

    def wait_for(condition, what: str, timeout_s: float = 90) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, f"not {what} in {timeout_s} s"
            time.sleep(0.05)

    model_id = httpx.get(f"{run.url}/v1/models").json()["data"][0]["id"]
    stream = {"model": model_id, "temperature": 0, "stream": True}
    killed: list[int] = []
    tries: list[tuple[int, bool, bool, int, bool | None]] = []  # (polls, caught, killed, chunks seen, disaggregated)
    for _ in range(3):
        wait_for(
            lambda: serving() and all(run.child(n)["pid"] not in killed for n in names) and not any(map(active, names)),
            "both decodes serving and idle",
        )
        answer, caught, hit = Answer(), False, False
        with futures.ThreadPoolExecutor(3) as pool:
            background = []
            for count in (1, 2):  # one at a time: the router then puts the second on the idle decode
                body = {**stream, "prompt": PROMPTS[1], "max_tokens": MAX_LEN - 16, "ignore_eos": True}
                background.append(pool.submit(stream_completion, run.url, body, Answer()))
                wait_for(lambda n=count: sum(map(bool, map(active, names))) == n, f"{count} decodes streaming", 30)
            done = pool.submit(stream_completion, run.url, {**stream, "prompt": prompt, "max_tokens": 12}, answer)
            polls = 0
            while not caught and not done.done():
                polls += 1
                for name in (n for n in names if active(n) >= 2):  # its background answer and this prompt
                    pid = run.child(name)["pid"]
                    stop_process(pid)
                    if answer.chunks:  # too late: its tokens are streaming
                        os.kill(pid, signal.SIGCONT)
                    else:
                        os.kill(pid, signal.SIGKILL)
                        run.seen_pids.add(pid)  # type: ignore[attr-defined]
                        killed.append(pid)
                        hit = True
                    caught = True
                    break
            done.result(timeout=120)
            for other in background:  # (the killed decode's is resumed elsewhere)
                assert other.result(timeout=120).error is None, other.result().error
        tries.append((polls, caught, hit, answer.chunks, answer.pdserve.get("disaggregated")))
        if hit and answer.pdserve.get("disaggregated") is False:
            break
    assert hit and answer.pdserve.get("disaggregated") is False, f"in 3 tries no decode was caught computing: {tries}"
    assert answer.error is None, answer.error
    assert answer.text == expected
    assert answer.pdserve.get("retries") == 1 and answer.pdserve["kv_bytes"] == 0, (answer.pdserve, tries)

    def slots_held() -> int:  # on every decode that answers (the killed one may still be restarting)
        held = 0
        for name in names:
            try:
                held += int(scrape(run.child(name)["http"]).get("pdserve_decode_kv_slots_used", 0))
            except httpx.HTTPError:
                continue
        return held

    wait_for(lambda: not slots_held(), "every slot given back", 30)
