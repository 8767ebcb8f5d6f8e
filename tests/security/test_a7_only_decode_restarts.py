"""Issue #58 A7, against real processes: `pdserve local --on-exit restart --decode 1`, the only
decode SIGKILLed by PID in the middle of a long greedy stream.

Before the fix the stream ended with an error event although the decode came back seconds
later: the request avoided the worker that failed it, by name, and no other decode was left.
Now the router waits (`PDSERVE_RETURN_WAIT_SECONDS`) for a decode to come back (the same one
restarted is a new instance) and resumes there: the client's text equals an undisturbed run's,
no token lost or repeated, and the stream ends normally. Past the wait (the launcher frozen, so
nothing restarts the decode) the stream ends with an error event that names the wait.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from support.deployments import local_deployment
from support.local_run import Answer, LocalRun, requests_in_flight, served_model, stop_process, stream_completion
from support.tiny_model import write_tiny_model

pytestmark = pytest.mark.slow

MAX_LEN, MAX_TOKENS = 256, 200
RETURN_WAIT_S = 40  # longer than a restart of the decode here (its old lease lapses in 10 s; ~10 s in all)
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    # 16 layers: the stream lasts long enough that the kill meets it on the decode.
    model = write_tiny_model(tmp_path_factory.mktemp("tiny-16-layers"), num_layers=16)
    run = local_deployment(
        tmp_path_factory.mktemp("a7-restart"),
        model,
        decode=1,
        slots=4,
        max_len=MAX_LEN,
        layers_per_chunk=1,
        threads=1,
        on_exit="restart",
        env={"PDSERVE_RETURN_WAIT_SECONDS": RETURN_WAIT_S},
    )
    seen: set[int] = set()
    run.seen_pids = seen  # type: ignore[attr-defined]
    yield run
    seen.update(c["pid"] for c in run.manifest["children"])
    run.stop_cleanly(also=seen)


def stream(run: LocalRun, answer: Answer) -> Answer:
    body = {
        "model": served_model(run.url),
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return stream_completion(run.url, body, answer, timeout_s=300)


def decodes_ready(run: LocalRun) -> bool:
    try:
        return httpx.get(f"{run.url}/health", timeout=2).json()["members"]["decode"] == 1
    except (httpx.HTTPError, KeyError, ValueError):
        return False


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        time.sleep(0.2)


def kill_decode_at(run: LocalRun, answer: Answer, chunk: int, also=lambda: None) -> list[int]:
    """SIGKILL the decode by PID once `answer` has `chunk` chunks, if it is still generating the
    stream (see `requests_in_flight`); `also` runs just before. Returns the victim's PID (none: the
    stream was done before the kill was due, the caller tries again)."""
    killed: list[int] = []

    def fire(chunks: int) -> None:
        if chunks == chunk and not killed and requests_in_flight(run, "decode-0"):
            also()
            pid = run.child("decode-0")["pid"]
            run.seen_pids.add(pid)  # type: ignore[attr-defined]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    answer.on_chunk = fire
    return killed


@pytest.fixture(scope="module")
def undisturbed(local) -> str:
    answer = stream(local, Answer())
    assert answer.error is None and answer.finish_reason == "length" and answer.completion_tokens == MAX_TOKENS
    return answer.text


def back_after(run: LocalRun, killed: list[int]) -> None:
    """Before a try: the decode a late kill of the try before took down is back and serving."""
    wait_until(
        lambda: run.child("decode-0")["pid"] not in killed and decodes_ready(run), 90, "the decode serving again"
    )


def test_a_stream_waits_for_its_only_decode_to_restart_and_resumes_there(local, undisturbed):
    """A kill that came after the decode had generated the whole stream (nothing in flight was
    lost: no retry, no error) proves nothing: the test then tries again, up to 3 times."""
    killed: list[int] = []
    for _ in range(3):
        back_after(local, killed)
        answer = Answer()
        killed = kill_decode_at(local, answer, chunk=20)
        started = time.monotonic()
        stream(local, answer)
        took = time.monotonic() - started
        if killed and (answer.error is not None or (answer.pdserve or {}).get("retries")):
            break
    assert killed, "in 3 tries the decode had finished the stream before the kill was due"
    assert answer.error is None, answer.error
    assert answer.finish_reason == "length" and answer.completion_tokens == MAX_TOKENS
    assert answer.text == undisturbed  # no token lost, none repeated
    assert answer.pdserve["retries"] == 1 and answer.pdserve["decode"] == "decode-0"
    assert local.child("decode-0")["pid"] != killed[0]  # resumed on the restarted process
    assert took < RETURN_WAIT_S, f"the stream took {took:.1f}s"
    router_log = open(local.child("router-0")["log"]).read()
    assert "event=request_waits_for_return" in router_log


def test_past_the_wait_the_stream_ends_with_an_error_naming_it(local, undisturbed):
    """The launcher is frozen before the kill: nothing restarts the decode within the wait. A
    kill that came after the decode had generated the whole stream (it finished) proves
    nothing: the test then tries again, up to 3 times."""
    launcher = local.proc.pid
    killed: list[int] = []
    for _ in range(3):
        back_after(local, killed)
        answer = Answer()
        killed = kill_decode_at(local, answer, chunk=20, also=lambda: stop_process(launcher))
        try:
            started = time.monotonic()
            stream(local, answer)
            waited = time.monotonic() - started
        finally:
            os.kill(launcher, signal.SIGCONT)
        if killed and answer.finish_reason is None:
            break
    assert killed, "in 3 tries the decode had finished the stream before the kill was due"
    assert answer.error is not None and answer.finish_reason is None
    assert "went away and none came back" in answer.error
    assert f"({RETURN_WAIT_S} s, PDSERVE_RETURN_WAIT_SECONDS)" in answer.error
    assert waited >= RETURN_WAIT_S - 1
    assert undisturbed.startswith(answer.text)  # what did arrive was right
    # The launcher, thawed, restarts the decode, and the deployment serves again.
    wait_until(lambda: local.child("decode-0")["pid"] != killed[0], 60, "decode-0 restarted")
    wait_until(lambda: decodes_ready(local), 90, "the decode serving again")
    assert stream(local, Answer()).text == undisturbed
