"""The admission queue and API keys behind the router's HTTP API, over a backend with a fixed
number of slots: requests wait for a slot instead of a 429, 401/429 bodies are OpenAI's (read by
the `openai` client's own exception types), bad admission headers are 400s, a client that
leaves while queued leaves the queue, and the queue's state shows in /metrics and /health."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from collections.abc import AsyncIterator

import httpx
import openai
import pytest

from pdserve_worker.api.admission import AdmissionConfig, AdmissionQueue
from pdserve_worker.api.app import create_app
from pdserve_worker.api.backend import Backend, NoCapacity, TokenEvent, capacity_held
from pdserve_worker.api.keys import KeyStore
from pdserve_worker.api.metrics import RouterMetrics
from pdserve_worker.model.sampling.params import SamplingParams
from support.router_fakes import running_router

KEY = "sk-test-interactive-0123456789"
BATCH_KEY = "sk-test-batch-0123456789abcd"
KEYS = KeyStore.parse(f"""
tenants:
  - name: interactive
    keys: ["sha256:{hashlib.sha256(KEY.encode()).hexdigest()}"]
  - name: batch
    keys: ["{BATCH_KEY}"]
    maxPriority: low
""")


class SlotBackend(Backend):
    """A backend with `slots` slots: a request beyond them is `NoCapacity` at once (as a decode's
    RESOURCE_EXHAUSTED is), one that gets a slot reports it and streams `tokens` tokens."""

    model_name = "slot-model"
    max_model_len = 4096

    def __init__(self, slots: int, tokens: int = 4, delay_s: float = 0.02, gate: threading.Event | None = None) -> None:
        self.slots = slots
        self.gate = gate  # when given, a request holds its slot (before its first token) until the gate opens
        self.tokens = tokens
        self.delay_s = delay_s
        self.used = 0
        self.peak = 0
        self.refused = 0
        self.lock = threading.Lock()

    def tokenize_prompt(self, prompt: str) -> list[int]:
        return [ord(c) for c in prompt]

    def tokenize_chat(self, messages: list[dict]) -> list[int]:
        return [ord(c) for m in messages for c in m["content"]]

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, *, cache_scope: str
    ) -> AsyncIterator[TokenEvent]:
        with self.lock:
            if self.used >= self.slots:
                self.refused += 1
                raise NoCapacity(1.0, f"all {self.slots} slots are busy")
            self.used += 1
            self.peak = max(self.peak, self.used)
        try:
            capacity_held()
            while self.gate is not None and not self.gate.is_set():  # set from the test's thread
                await asyncio.sleep(0.005)
            count = min(self.tokens, params.max_tokens)
            for i in range(count):
                await asyncio.sleep(self.delay_s)
                yield TokenEvent(100 + i, "x", "length" if i == count - 1 else None)
        finally:
            with self.lock:
                self.used -= 1


@pytest.fixture
def serve(port):
    stack = []

    def start(backend, config: AdmissionConfig | None = AdmissionConfig(), keys=None):
        metrics = RouterMetrics()
        admission = None if config is None else AdmissionQueue(config, observer=metrics)
        cm = running_router(create_app(backend, metrics, admission=admission, keys=keys), port)
        stack.append(cm)
        return cm.__enter__(), admission

    yield start
    for cm in stack:
        cm.__exit__(None, None, None)


def _burst(url: str, n: int, headers: dict[str, str] | None = None, max_tokens: int = 4) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            return await asyncio.gather(
                *[
                    client.post(
                        "/v1/completions",
                        json={"model": "slot-model", "prompt": f"p{i}", "max_tokens": max_tokens},
                        headers=headers or {},
                    )
                    for i in range(n)
                ]
            )

    return asyncio.run(run())


def test_requests_wait_for_a_slot_instead_of_429(serve):
    backend = SlotBackend(slots=2)
    url, admission = serve(backend)
    responses = _burst(url, 12)
    assert [r.status_code for r in responses] == [200] * 12
    assert backend.peak == 2 and backend.used == 0
    assert admission.waiting() == 0 and admission.running == 0


def test_without_the_queue_the_same_burst_gets_429s(serve):
    backend = SlotBackend(slots=2)
    url, _ = serve(backend, config=None)
    codes = [r.status_code for r in _burst(url, 12)]
    assert codes.count(200) >= 2 and 429 in codes


def test_401_in_openai_shape_and_the_key_never_logged(serve, caplog):
    url, _ = serve(SlotBackend(slots=2), keys=KEYS)
    wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-wrong-key-0123456789", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        wrong.completions.create(model="slot-model", prompt="hi", max_tokens=2)
    assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"
    assert "sk-wrong" not in caught.value.message
    assert caught.value.response.headers["www-authenticate"].startswith("Bearer")
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()

    missing = httpx.post(f"{url}/v1/chat/completions", json={"model": "slot-model", "messages": "not a list"})
    assert missing.status_code == 401  # the key is checked before the body's fields
    assert missing.json()["error"]["code"] == "invalid_api_key"
    assert set(missing.json()["error"]) == {"message", "type", "param", "code"}
    # Nor does a body that is not JSON at all, nor one over the size limit, come before the key;
    # on /tokenize and /detokenize neither (#58 A10: they parsed the body first).
    for path in ("/v1/completions", "/tokenize", "/detokenize"):
        for content in (b"{not json", b"x" * (9 << 20)):
            garbage = httpx.post(
                f"{url}{path}", content=content, headers={"content-type": "application/json"}, timeout=30
            )
            assert garbage.status_code == 401, (path, garbage.text)
            assert garbage.json()["error"]["code"] == "invalid_api_key"

    assert httpx.get(f"{url}/health").status_code == 200  # probes need no key
    with caplog.at_level(logging.DEBUG):
        good = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        reply = good.completions.create(model="slot-model", prompt="hi", max_tokens=2)
    assert reply.choices[0].text == "xx"
    assert [m.id for m in good.models.list()] == ["slot-model"]
    assert KEY not in caplog.text and "sk-wrong" not in caplog.text
    metrics = httpx.get(f"{url}/metrics").text
    assert 'pdserve_router_requests_rejected_total{status="401"} 9.0' in metrics  # 3 + 6 garbage bodies
    assert 'pdserve_router_tenant_tokens_total{kind="completion",tenant="interactive"} 2.0' in metrics


def test_429_queue_full_in_openai_shape_with_retry_after(serve):
    # The running request holds its slot until the 429 is seen: however slow the machine, the
    # queue is still full when the third request arrives (a timed request once finished first).
    gate = threading.Event()
    backend = SlotBackend(slots=1, tokens=4, delay_s=0.02, gate=gate)
    url, admission = serve(backend, AdmissionConfig(capacity=1))
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)  # not 600 s

    async def fill() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:

            async def one() -> int:
                r = await http.post("/v1/completions", json={"model": "slot-model", "prompt": "p", "max_tokens": 40})
                return r.status_code

            running = asyncio.create_task(one())
            while backend.used < 1:
                await asyncio.sleep(0.01)
            waiting = asyncio.create_task(one())
            while admission.waiting() < 1:
                await asyncio.sleep(0.01)
            try:
                with pytest.raises(openai.RateLimitError) as caught:
                    await asyncio.to_thread(client.completions.create, model="slot-model", prompt="p", max_tokens=2)
            finally:
                gate.set()
            err = caught.value
            assert err.status_code == 429 and err.code == "queue_full"
            assert err.body["type"] == "rate_limit_error" and "queue is full" in err.message
            assert int(err.response.headers["retry-after"]) >= 1
            assert int(err.response.headers["retry-after-ms"]) >= 0
            assert await running == 200 and await waiting == 200

    asyncio.run(fill())
    metrics = httpx.get(f"{url}/metrics").text
    assert 'pdserve_router_admission_rejected_total{reason="queue_full"} 1.0' in metrics
    assert 'pdserve_router_admission_wait_seconds_count{priority="normal"} 3.0' not in metrics  # 2 admitted
    assert 'pdserve_router_admission_wait_seconds_count{priority="normal"} 2.0' in metrics


def test_bad_admission_headers_are_400(serve):
    url, _ = serve(SlotBackend(slots=1))
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    for headers, code in (
        ({"x-pdserve-priority": "urgent"}, "invalid_priority"),
        ({"x-pdserve-deadline-ms": "-5"}, "invalid_deadline"),
        ({"x-pdserve-deadline-ms": "1e3"}, "invalid_deadline"),
        ({"x-pdserve-deadline-ms": "9" * 5000}, "invalid_deadline"),  # int() would refuse it: a 500
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="slot-model", prompt="p", max_tokens=1, extra_headers=headers)
        assert caught.value.code == code


def test_a_deadline_passed_in_the_queue_is_429(serve):
    backend = SlotBackend(slots=1, tokens=30, delay_s=0.02)
    url, admission = serve(backend, AdmissionConfig(retry_min_s=5, retry_max_s=5))

    async def run() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            body = {"model": "slot-model", "prompt": "p", "max_tokens": 30}
            running = asyncio.create_task(http.post("/v1/completions", json=body))
            await asyncio.sleep(0.1)
            started = time.monotonic()
            late = await http.post("/v1/completions", json=body, headers={"x-pdserve-deadline-ms": "100"})
            assert late.status_code == 429 and late.json()["error"]["code"] == "deadline"
            assert time.monotonic() - started < 0.5
            assert (await running).status_code == 200

    asyncio.run(run())
    assert admission.waiting() == 0


def test_high_priority_goes_first_and_the_ceiling_holds(serve):
    backend = SlotBackend(slots=1, tokens=3, delay_s=0.03)
    url, admission = serve(backend, keys=KEYS)
    finished: list[str] = []

    async def run() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:

            async def one(label: str, key: str, priority: str) -> None:
                r = await http.post(
                    "/v1/completions",
                    json={"model": "slot-model", "prompt": "p", "max_tokens": 3},
                    headers={"Authorization": f"Bearer {key}", "x-pdserve-priority": priority},
                )
                assert r.status_code == 200
                finished.append(label)

            first = asyncio.create_task(one("first", KEY, "normal"))
            await asyncio.sleep(0.03)
            # batch asks for high but its key's ceiling is low; interactive's low and high follow it.
            tasks = [asyncio.create_task(one("batch-high", BATCH_KEY, "high"))]
            await asyncio.sleep(0.02)
            tasks.append(asyncio.create_task(one("low", KEY, "low")))
            await asyncio.sleep(0.02)
            tasks.append(asyncio.create_task(one("high", KEY, "high")))
            await asyncio.gather(first, *tasks)

    asyncio.run(run())
    assert finished[0] == "first" and finished[1] == "high", finished
    assert set(finished[2:]) == {"batch-high", "low"}


def test_clients_that_leave_while_queued_leave_the_queue(serve):
    backend = SlotBackend(slots=2, tokens=200, delay_s=0.02)
    url, admission = serve(backend, AdmissionConfig(retry_min_s=5, retry_max_s=5))

    async def run() -> float:
        async with httpx.AsyncClient(base_url=url, timeout=30, limits=httpx.Limits(max_connections=200)) as http:
            body = {"model": "slot-model", "prompt": "p", "max_tokens": 200}
            tasks = [asyncio.create_task(http.post("/v1/completions", json=body)) for _ in range(40)]
            deadline = time.monotonic() + 10
            while admission.waiting() < 38 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert admission.waiting() == 38 and backend.used == 2
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            left = time.monotonic()
            while (admission.waiting() or backend.used) and time.monotonic() - left < 5:
                await asyncio.sleep(0.01)
            return time.monotonic() - left

    took = asyncio.run(run())
    assert admission.waiting() == 0 and backend.used == 0 and admission.running == 0
    assert took < 1.0
    health = httpx.get(f"{url}/health").json()["admission"]
    assert health["waiting"] == {"high": 0, "normal": 0, "low": 0} and health["running"] == 0


def test_the_trace_records_the_priority_served_not_the_one_asked_for(serve, tmp_path):
    """#29: a key whose maxPriority is low asked for high; the trace said high."""
    import json

    from pdserve_common import pod_env as E
    from pdserve_common import tracing

    path = tmp_path / "spans.jsonl"
    assert tracing.setup("pdserve-router-test", "r-1", env={E.TRACE_FILE: str(path)})
    try:
        url, _ = serve(SlotBackend(slots=1), keys=KEYS)
        reply = httpx.post(
            f"{url}/v1/completions",
            json={"model": "slot-model", "prompt": "p", "max_tokens": 2},
            headers={"Authorization": f"Bearer {BATCH_KEY}", "x-pdserve-priority": "high"},
        )
        assert reply.status_code == 200
    finally:
        tracing.shutdown()
    spans = [json.loads(line) for line in path.read_text().splitlines() if line]
    [root] = [s for s in spans if s["name"] == "router.request"]
    assert root["attributes"]["pdserve.priority"] == "low"
    assert root["attributes"]["pdserve.priority.requested"] == "high"
    assert root["attributes"]["pdserve.tenant"] == "batch"
