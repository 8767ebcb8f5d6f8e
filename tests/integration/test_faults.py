"""Fault injection on real processes: `pdserve local` (broker, 2 decode, 2 prefill, router; tiny
model) with `--on-exit restart`, as pods under a restart policy. Processes are killed or frozen by
PID (from `deployment.json`) while requests stream.

Each test asserts that every request ends with exactly the text of an undisturbed run (greedy,
`ignore_eos`, so every answer is `max_tokens` long: a lost or repeated token would show), that
the failure was actually met (the `pdserve.retries` field of the answer), and that the decodes'
slot accounting comes back to all-free. The module's teardown checks no child outlived the
deployment. Timeouts are shortened through `--env` so recovery takes seconds: the decode waits
3 s for a prefill's KV, and a quarantined slot comes back 2 s + 5 s after its push was abandoned.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import grpc
import httpx
import pytest

from pdserve.v1 import worker_pb2, worker_pb2_grpc
from support.deployments import local_deployment
from support.local_run import Answer, LocalRun, served_model, stop_process, stream_completion
from support.tiny_model import write_tiny_model

pytestmark = pytest.mark.slow

SLOTS, MAX_LEN, MAX_TOKENS = 4, 256, 160
PROMPTS = ["The quick brown fox", "Paris is the capital of", "A language model predicts", "Berlin is"]


@pytest.fixture(scope="module")
def slow_model_dir(tmp_path_factory):
    """The tiny model with 16 layers: its streams last ~4x longer, so a fault fired at the third
    chunk still meets the request on a decode (with 4 layers a loaded machine once saw the
    decode finish all 160 tokens before the client had read three chunks)."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-16-layers"), num_layers=16)


@pytest.fixture(scope="module")
def local(slow_model_dir, tmp_path_factory):
    run = local_deployment(
        tmp_path_factory.mktemp("pd-faults"),
        slow_model_dir,
        prefill=2,
        decode=2,
        slots=SLOTS,
        max_len=MAX_LEN,
        layers_per_chunk=1,
        threads=1,
        on_exit="restart",
        env={"PDSERVE_READINESS_TIMEOUT_MS": 3000, "PDSERVE_TRANSFER_TIMEOUT_MS": 2000},
    )
    seen_pids: set[int] = set()
    run.seen_pids = seen_pids  # type: ignore[attr-defined]
    yield run
    seen_pids.update(c["pid"] for c in run.manifest["children"])
    run.stop_cleanly(also=seen_pids)


def stream(url: str, prompt: str, answer: Answer, max_tokens: int = MAX_TOKENS) -> Answer:
    """One streamed greedy completion, recorded into `answer` as it arrives."""
    body = {
        "model": served_model(url),
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return stream_completion(url, body, answer)


@pytest.fixture(scope="module")
def reference(local) -> dict[str, str]:
    """Undisturbed answers from the same deployment, before any fault."""
    answers = {p: stream(local.url, p, Answer()) for p in PROMPTS}
    for a in answers.values():
        assert a.error is None and a.finish_reason == "length" and a.completion_tokens == MAX_TOKENS
        assert not a.pdserve.get("retries")
    return {p: a.text for p, a in answers.items()}


def decode_status(local: LocalRun, name: str) -> worker_pb2.DecodeStatus | None:
    meta = (("authorization", f"Bearer {local.token}"),)
    with grpc.insecure_channel(local.child(name)["grpc"]) as channel:
        try:
            return worker_pb2_grpc.DecodeStub(channel).Status(worker_pb2.StatusRequest(), metadata=meta, timeout=2)
        except grpc.RpcError:
            return None


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s}s: {what}")
        time.sleep(0.1)


def all_slots_free(local: LocalRun) -> bool:
    statuses = [decode_status(local, f"decode-{i}") for i in range(2)]
    return all(s is not None and s.slots_free == s.slots_total and s.active_requests == 0 for s in statuses)


def healthy(local: LocalRun) -> bool:
    try:
        return httpx.get(f"{local.url}/health", timeout=2).json()["members"] == {"prefill": 2, "decode": 2}
    except (httpx.HTTPError, KeyError, ValueError):
        return False


def settle(local: LocalRun) -> None:
    """Restarted children back in the membership and every slot free (quarantine over)."""
    wait_until(lambda: healthy(local), 60, "2 prefill and 2 decode members")
    wait_until(lambda: all_slots_free(local), 30, "every decode slot free")


def kill(local: LocalRun, name: str, sig: int = signal.SIGKILL) -> int:
    pid = local.child(name)["pid"]
    local.seen_pids.add(pid)  # type: ignore[attr-defined]
    if sig == signal.SIGSTOP:
        stop_process(pid)  # returns once it is stopped, not when the signal is queued
    else:
        os.kill(pid, sig)
    return pid


def run_all(local: LocalRun, prompts: list[str], fault, when_chunks: int = 3) -> list[Answer]:
    """Stream `prompts` at once; once the first has `when_chunks` chunks, call `fault()`.

    The fault runs in the first stream's reading thread, before it reads on: a poll from
    another thread could see the stream already finished on a loaded machine (the tiny model
    generates 160 tokens in well under a second).
    """
    answers = [Answer() for _ in prompts]
    fired: list[BaseException | None] = []

    def fire(chunks: int) -> None:
        if chunks == when_chunks and not fired:
            try:
                fault()
                fired.append(None)
            except BaseException as exc:  # re-raised in the test's thread below
                fired.append(exc)

    if when_chunks > 0:
        answers[0].on_chunk = fire
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(stream, local.url, p, a) for p, a in zip(prompts, answers)]
        if when_chunks == 0:
            fault()
            fired.append(None)
        for f in futures:
            f.result(timeout=120)
    assert fired, f"the first stream ended after {answers[0].chunks} chunks, before the fault was due"
    if fired[0] is not None:
        raise fired[0]
    return answers


def assert_complete(answers: list[Answer], prompts: list[str], reference: dict[str, str]) -> None:
    for prompt, a in zip(prompts, answers):
        assert a.error is None, f"{prompt!r}: {a.error}"
        assert a.finish_reason == "length" and a.completion_tokens == MAX_TOKENS
        assert a.text == reference[prompt], f"{prompt!r} differs from the undisturbed run"


def test_a_killed_decode_is_replaced_mid_stream(local, reference):
    settle(local)
    victim: list[str] = []

    def kill_the_busy_decode() -> None:
        busy = [n for n in ("decode-0", "decode-1") if (s := decode_status(local, n)) and s.active_requests]
        if busy:  # (none: the decode finished before the client read chunk 3; the test tries again)
            victim.append(busy[0])
            kill(local, busy[0])

    for _ in range(3):
        [answer] = run_all(local, PROMPTS[:1], kill_the_busy_decode)
        if victim:
            break
    assert victim, "in 3 tries no decode was serving the request when the fault was due"
    assert_complete([answer], PROMPTS[:1], reference)
    assert answer.pdserve["retries"] == 1 and answer.pdserve["decode"] != victim[0]
    settle(local)


def test_killed_and_stalled_prefills_are_replaced(local, reference):
    settle(local)
    # prefill-0 frozen: requests routed to it time out in the decode's readiness wait and retry.
    kill(local, "prefill-0", signal.SIGSTOP)
    try:
        answers = run_all(local, PROMPTS, lambda: None, when_chunks=0)
    finally:
        kill(local, "prefill-0", signal.SIGCONT)
    assert_complete(answers, PROMPTS, reference)
    assert any(a.pdserve.get("retries") for a in answers), "no request met the frozen prefill"
    assert all(a.pdserve["prefill"] == "prefill-1" for a in answers)
    settle(local)
    # prefill-1 killed while requests arrive: the ones it held go to prefill-0.
    answers = run_all(local, PROMPTS, lambda: kill(local, "prefill-1"), when_chunks=0)
    assert_complete(answers, PROMPTS, reference)
    settle(local)


def test_a_broker_restart_leaves_requests_in_flight_alone(local, reference):
    settle(local)
    old = local.child("broker")["pid"]
    answers = run_all(local, PROMPTS, lambda: kill(local, "broker"))
    assert_complete(answers, PROMPTS, reference)
    wait_until(lambda: local.child("broker")["pid"] != old, 30, "the broker restarted")
    settle(local)  # the workers registered again by themselves
    assert_complete([stream(local.url, PROMPTS[1], Answer())], PROMPTS[1:2], reference)


def test_decodes_stopped_gracefully_come_back_and_serve(local, reference):
    """#58 A6: a decode that stopped on SIGTERM shut down the KV listener it had inherited from
    `pdserve local`, and its restart advertised a port nothing listened on: every request 503.
    Both decodes stop in turn, so the answers after can only come from restarted ones."""
    settle(local)
    for name in ("decode-0", "decode-1"):
        old = kill(local, name, signal.SIGTERM)
        wait_until(lambda n=name, o=old: local.child(n)["pid"] != o, 60, f"{name} restarted")
        settle(local)
    answers = run_all(local, PROMPTS, lambda: None, when_chunks=0)
    assert_complete(answers, PROMPTS, reference)
    assert {a.pdserve["decode"] for a in answers} <= {"decode-0", "decode-1"}


def test_draining_a_decode_under_load_loses_no_request(local, reference):
    """Last: decode-1 stays drained."""
    settle(local)
    drained: list[dict] = []
    answers = run_all(local, PROMPTS, lambda: drained.append(local.drain("decode-1")))
    assert drained == [{"drained": True}] or drained[0].get("drained") is True
    assert_complete(answers, PROMPTS, reference)
    wait_until(lambda: httpx.get(f"{local.url}/health").json()["members"]["decode"] == 1, 15, "decode-1 gone")
    answer = stream(local.url, PROMPTS[2], Answer())
    assert_complete([answer], PROMPTS[2:3], reference)
    assert answer.pdserve["decode"] == "decode-0"
    wait_until(
        lambda: (s := decode_status(local, "decode-1")) is not None and s.slots_free == SLOTS,
        15,
        "decode-1's slots free",
    )
