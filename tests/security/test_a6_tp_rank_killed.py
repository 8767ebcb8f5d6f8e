"""Issue #58 A6 (a killed tensor-parallel rank), against real processes: `pdserve local
--on-exit restart` with one prefill and one decode of two ranks each, a rank past 0 SIGKILLed
by PID (found in its instance's `tp_ranks_started` line).

The instance whose rank died ends itself and is restarted as one, once: no crash loop (the
launcher restarts it exactly once, and it serves afterwards). Requests sent meanwhile wait for
it (the router's return wait, PDSERVE_RETURN_WAIT_SECONDS) and succeed within RECOVERY_S with
the undisturbed text; a stream on the decode whose rank died resumes on the restarted decode
with no token lost or repeated.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import time

import httpx
import pytest

from support.deployments import local_deployment
from support.local_run import Answer, LocalRun, requests_in_flight, served_model, stream_completion
from support.tiny_model import write_tiny_model

pytestmark = pytest.mark.slow

MAX_LEN, MAX_TOKENS = 256, 160
RECOVERY_S = 120  # the instance's restart (both ranks load and join) with the machine shared
PROMPTS = ["The quick brown fox", "Paris is the capital of"]


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    # 16 layers: a stream lasts long enough that the kill meets it on the decode.
    model = write_tiny_model(tmp_path_factory.mktemp("tiny-tp-16-layers"), num_layers=16)
    run = local_deployment(
        tmp_path_factory.mktemp("a6-tp-restart"),
        model,
        decode=1,
        prefill_tp=2,
        decode_tp=2,
        prefix_cache_tokens=0,
        slots=4,
        max_len=MAX_LEN,
        threads=1,
        on_exit="restart",
        env={"PDSERVE_RETURN_WAIT_SECONDS": RECOVERY_S},
    )
    seen: set[int] = set()
    run.seen_pids = seen  # type: ignore[attr-defined]
    yield run
    seen.update(c["pid"] for c in run.manifest["children"])
    run.stop_cleanly(also=seen)


def body(run: LocalRun, prompt: str, stream: bool) -> dict:
    extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    return {
        "model": served_model(run.url),
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


def complete(run: LocalRun, prompt: str) -> httpx.Response:
    return httpx.post(f"{run.url}/v1/completions", json=body(run, prompt, False), timeout=RECOVERY_S + 60)


@pytest.fixture(scope="module")
def undisturbed(local) -> dict[str, str]:
    texts = {}
    for prompt in PROMPTS:
        reply = complete(local, prompt)
        assert reply.status_code == 200, reply.text
        texts[prompt] = reply.json()["choices"][0]["text"]
    return texts


def rank_pids(run: LocalRun, name: str) -> list[int]:
    """The PIDs of ranks 1.. of `name`'s current instance (its last `tp_ranks_started` line)."""
    log = open(run.child(name)["log"]).read()
    found = re.findall(r'event=tp_ranks_started size=\d+ pids="?\[([\d, ]+)\]', log)
    return [int(p) for p in found[-1].split(",")]


def restarts(run: LocalRun, name: str) -> int:
    """How many times the launcher restarted `name` (its stderr says so once per restart)."""
    return len(re.findall(rf"{name} \(pid \d+\) exited with code -?\d+; restarting it", run.stderr_path.read_text()))


def serving(run: LocalRun) -> bool:
    try:
        return httpx.get(f"{run.url}/health", timeout=2).json()["members"] == {"prefill": 1, "decode": 1}
    except (httpx.HTTPError, KeyError, ValueError):
        return False


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        time.sleep(0.2)


def assert_restarted_once_and_stays_up(run: LocalRun, name: str, before: int) -> None:
    """No crash loop: one restart, then the deployment serves on, again and again."""
    wait_until(lambda: serving(run), RECOVERY_S, "both members registered again")
    for prompt in PROMPTS * 2:
        assert complete(run, prompt).status_code == 200
        time.sleep(1.0)
    assert restarts(run, name) == before + 1, run.stderr_path.read_text()[-3000:]


def test_a_killed_prefill_rank_restarts_its_instance_once_and_requests_wait_for_it(local, undisturbed):
    before = restarts(local, "prefill-0")
    victim = rank_pids(local, "prefill-0")[0]
    local.seen_pids.add(victim)  # type: ignore[attr-defined]
    os.kill(victim, signal.SIGKILL)
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        replies = list(pool.map(lambda p: complete(local, p), PROMPTS))
    assert [r.status_code for r in replies] == [200] * len(PROMPTS), [r.text for r in replies]
    assert [r.json()["choices"][0]["text"] for r in replies] == [undisturbed[p] for p in PROMPTS]
    assert time.monotonic() - started < RECOVERY_S
    assert "event=tp_group_broken" in open(local.child("prefill-0")["log"]).read()
    assert_restarted_once_and_stays_up(local, "prefill-0", before)


def test_a_killed_decode_rank_restarts_its_instance_once_and_the_stream_resumes(local, undisturbed):
    """A kill that came after the decode had generated the whole stream (no retry, no error:
    nothing in flight was lost) proves nothing: the test then tries again, up to 3 times, each
    once the instance serves again."""
    gone: set[int] = set()  # ranks killed by earlier tries
    for _ in range(3):
        wait_until(
            lambda: serving(local) and not set(rank_pids(local, "decode-0")) & gone,
            RECOVERY_S,
            "both members registered",
        )
        before = restarts(local, "decode-0")
        victim = rank_pids(local, "decode-0")[0]
        killed = []

        def fire(chunks: int, victim: int = victim, killed: list[int] = killed) -> None:
            # only while the decode still generates it (requests_in_flight)
            if chunks == 10 and not killed and requests_in_flight(local, "decode-0"):
                local.seen_pids.add(victim)  # type: ignore[attr-defined]
                os.kill(victim, signal.SIGKILL)
                killed.append(victim)
                gone.add(victim)

        answer = Answer()
        answer.on_chunk = fire
        stream_completion(local.url, body(local, PROMPTS[0], True), answer, timeout_s=RECOVERY_S + 60)
        if killed and (answer.error is not None or (answer.pdserve or {}).get("retries")):
            break
    assert killed, "in 3 tries the decode had finished the stream before the kill was due"
    assert answer.error is None, answer.error
    assert answer.finish_reason == "length" and answer.completion_tokens == MAX_TOKENS
    assert answer.text == undisturbed[PROMPTS[0]]  # no token lost, none repeated
    assert answer.pdserve["retries"] == 1
    assert_restarted_once_and_stays_up(local, "decode-0", before)
