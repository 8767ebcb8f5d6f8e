"""Every input of the router's API has a bound, checked before it costs anything: values the
worker protocol cannot carry are a 400 (never a 500 after a slot was reserved), bodies past the
size limit a 413 before they are read, prompts too long to fit a 400 before they are tokenized,
and long prompts are tokenized in a bounded pool."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

from pdserve_worker.api.app import RouterLimits, create_app
from pdserve_worker.api.backend import NoCapacity
from pdserve_worker.api.openai_api import MAX_MESSAGES
from pdserve_worker.api.tokenizing import TokenizerPool, max_prompt_chars
from pdserve_worker.model.sampling.params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, SamplingParams
from pdserve_worker.rpc.convert import sampling_to_proto
from support.router_fakes import ScriptedBackend, running_router

MODEL = ScriptedBackend.model_name
COMPLETIONS = {"model": MODEL, "prompt": "x"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}


@pytest.fixture
def router(port):
    stack = []

    def start(backend=None, limits=RouterLimits()):  # noqa: B008  (frozen: one shared default is safe)
        backend = backend or ScriptedBackend(max_model_len=100_000)
        cm = running_router(create_app(backend, limits=limits), port)
        stack.append(cm)
        return backend, cm.__enter__()

    yield start
    for cm in stack:
        cm.__exit__(None, None, None)


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"top_k": 2**63}, "top_k"),  # D2 of issue 13: was a 500 after the slot was reserved
        ({"top_k": 2**32}, "top_k"),
        ({"max_tokens": 2**40}, "max_tokens"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"n": 2**63}, "n"),
        ({"logprobs": 2**63}, "logprobs"),
        ({"best_of": 2**63}, "best_of"),
        ({"presence_penalty": 1e308}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),  # OpenAI's range is [-2, 2]
        ({"temperature": 1e308}, "temperature"),
        ({"top_p": 2.0}, "top_p"),
        ({"stop": ["s"] * (MAX_STOP_STRINGS + 1)}, "stop"),
        ({"stop": "s" * (MAX_STOP_STRING_CHARS + 1)}, "stop"),
        ({"model": "m" * 10_000}, "model"),
    ],
)
def test_values_the_workers_cannot_take_are_400_before_the_backend(router, extra, param):
    backend, url = router()
    r = httpx.post(f"{url}/v1/completions", json={**COMPLETIONS, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert backend.calls == []  # nothing reached the backend (no slot was reserved)


def test_every_accepted_value_fits_the_wire_format():
    """The API's bounds are the proto's: the largest accepted values convert without error."""
    params = SamplingParams(
        max_tokens=2**32 - 1,
        top_k=2**32 - 1,
        seed=2**63 - 1,
        stop=tuple(str(i) + "x" * (MAX_STOP_STRING_CHARS - 2) for i in range(10, 10 + MAX_STOP_STRINGS)),
    )
    msg = sampling_to_proto(params)
    assert msg.top_k == 2**32 - 1 and msg.seed == 2**63 - 1 and len(msg.stop) == MAX_STOP_STRINGS


def test_too_many_messages_are_refused_by_their_number_before_validation(router):
    backend, url = router()
    body = {**CHAT, "messages": [{"role": "user", "content": ""}] * 200_000}
    started = time.monotonic()
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and f"at most {MAX_MESSAGES} messages" in r.json()["error"]["message"]
    assert backend.chats == []
    assert time.monotonic() - started < 5  # (issue 13 saw 6.6 s of stall; json parsing stays)


def test_a_prompt_too_long_to_fit_is_refused_by_its_characters_without_tokenizing(router):
    backend, url = router(ScriptedBackend(max_model_len=64), RouterLimits(max_prompt_chars=1000))
    r = httpx.post(f"{url}/v1/completions", json={**COMPLETIONS, "prompt": "y" * 1001})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and "1001 characters" in error["message"]
    r = httpx.post(
        f"{url}/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": "z" * 600}] * 2}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert backend.chats == [] and backend.calls == []


def test_the_char_bound_comes_from_the_longest_token(tiny_model_dir):
    from pdserve_worker.api.tokenizing import ModelTokenizing
    from pdserve_worker.model.tokenizer import Tokenizer

    class Holder(ModelTokenizing):
        def __init__(self, tokenizer):
            self._tokenizer = tokenizer

    holder = Holder(Tokenizer.from_dir(tiny_model_dir))
    longest = holder.max_token_chars
    vocab = holder._tokenizer.backend.get_vocab(with_added_tokens=True)
    assert longest == max(len(t) for t in vocab)
    # No prompt of more characters than the bound can tokenize into fewer than max_model_len tokens.
    text = "a" * (max_prompt_chars(8, longest) + 1)
    assert len(holder.tokenize_prompt(text)) > 8


def _raw_post(url: str, headers: dict[str, str], body_bytes: int, chunked: bool = False) -> tuple[bytes, float]:
    """POST `body_bytes` of JSON-ish bytes from a raw socket, reading the answer while sending;
    returns (the answer's first bytes, seconds until they came)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    head += "Transfer-Encoding: chunked\r\n\r\n" if chunked else f"Content-Length: {body_bytes}\r\n\r\n"
    answer: list[bytes] = []
    got, done = threading.Event(), threading.Event()
    started = time.monotonic()

    def read() -> None:
        data = b""
        try:
            while True:
                part = sock.recv(65536)
                if not part:
                    break
                if not data:
                    got.set()  # the answer started: stop sending
                data += part
                head_, sep, body = data.partition(b"\r\n\r\n")
                length = [
                    int(line.split(b":")[1])
                    for line in head_.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                ]
                if sep and length and len(body) >= length[0]:
                    break
        except OSError:
            pass
        answer.append(data)
        done.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    sock.sendall(head.encode())
    chunk = b"[" + b" " * (64 * 1024 - 2) + b"]"
    sent = 0
    try:
        while sent < body_bytes and not got.is_set():
            part = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n" if chunked else chunk
            sock.sendall(part)
            sent += len(chunk)
    except OSError:
        pass  # the server answered and closed: what we want
    got.wait(10)
    elapsed = time.monotonic() - started
    done.wait(10)
    sock.close()
    return answer[0] if answer else b"", elapsed


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_over_the_limit_is_413_without_being_read(router, chunked):
    backend, url = router(limits=RouterLimits(max_body_bytes=256 * 1024))
    answer, elapsed = _raw_post(url, {}, 10 * 1024 * 1024, chunked=chunked)
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 413"), answer[:200]
    body = json.loads(rest.partition(b"\r\n\r\n")[2])
    assert body["error"]["code"] == "request_too_large" and "262144 bytes" in body["error"]["message"]
    assert elapsed < 2.0
    assert backend.calls == []
    assert httpx.post(f"{url}/v1/completions", json=COMPLETIONS).status_code == 200  # the router goes on


def test_tokenizer_pool_bounds_its_threads_and_its_queue():
    async def main() -> None:
        pool = TokenizerPool(threads=2, queue=3)
        running, peak = 0, 0
        gate = threading.Event()
        lock = threading.Lock()

        def work() -> int:
            nonlocal running, peak
            with lock:
                running += 1
                peak = max(peak, running)
            gate.wait(5)
            with lock:
                running -= 1
            return 1

        tasks = [asyncio.create_task(pool.run(work)) for _ in range(3)]
        await asyncio.sleep(0.1)
        with pytest.raises(NoCapacity, match="tokenizer busy"):
            await pool.run(work)  # a fourth is refused at once, not queued
        gate.set()
        assert await asyncio.gather(*tasks) == [1, 1, 1]
        assert peak == 2 and pool.in_progress == 0

    asyncio.run(main())


def test_a_busy_tokenizer_is_429_not_a_queue(router):
    class SlowTokenizer(ScriptedBackend):
        def tokenize_prompt(self, prompt: str) -> list[int]:
            time.sleep(0.5)
            return super().tokenize_prompt(prompt[:10])

    backend, url = router(SlowTokenizer(max_model_len=100_000), RouterLimits(tokenize_threads=1, tokenize_queue=1))
    long_prompt = {**COMPLETIONS, "prompt": "p" * 5000}  # past the inline bound: tokenized in the pool
    with httpx.Client(timeout=10) as client:
        results: list[int] = []
        threads = [
            threading.Thread(
                target=lambda: results.append(client.post(f"{url}/v1/completions", json=long_prompt).status_code)
            )
            for _ in range(3)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert sorted(results)[0] == 200 and 429 in results
