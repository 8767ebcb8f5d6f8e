"""Admission end to end (issue 19's acceptance): `pdserve local --api-keys` with the tiny model,
one decode with 2 KV slots, a prefill, the router and the broker as real processes.

- 20 concurrent requests all complete (no 429) within their deadline;
- under contention the high class's wait p50 is at most 0.25x the low class's;
- a tenant with 10x the others' clients raises their wait by at most 2x (fair over tokens), and
  a tenant with a tokens/min limit gets no more than it (429 `tokens_per_minute` past it);
- 100 queued clients that disconnect leave an empty queue and both slots free within 1 s;
- 401 and 429 are OpenAI's error shapes, read by the `openai` client's exception types;
- a rotated key works without a restart.

Waits are measured as the client sees them: time to the first streamed chunk.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import grpc
import httpx
import openai
import pytest

from pdserve.v1 import worker_pb2, worker_pb2_grpc
from support.deployments import local_deployment

pytestmark = [pytest.mark.slow, pytest.mark.timing]

MAX_LEN = 512
KEYS = {
    "interactive": "sk-interactive-0123456789abcdef",
    "batch": "sk-batch-0123456789abcdef01",
    "t1": "sk-tenant1-0123456789abcdef",
    "t2": "sk-tenant2-0123456789abcdef",
    "heavy": "sk-heavy-0123456789abcdef0",
    "capped": "sk-capped-0123456789abcdef",
}
CAPPED_TPM = 1200
KEYS_FILE = f"""
tenants:
  - name: interactive
    keys: ["{KEYS["interactive"]}"]
  - name: batch
    keys: ["{KEYS["batch"]}"]
  - name: t1
    keys: ["{KEYS["t1"]}"]
  - name: t2
    keys: ["{KEYS["t2"]}"]
  - name: heavy
    keys: ["{KEYS["heavy"]}"]
  - name: capped
    keys: ["{KEYS["capped"]}"]
    tokensPerMinute: {CAPPED_TPM}
"""


@pytest.fixture(scope="module")
def keys_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.yaml"
    path.write_text(KEYS_FILE)
    return path


@pytest.fixture(scope="module")
def local(tiny_model_dir, tmp_path_factory, keys_path):
    run = local_deployment(
        tmp_path_factory.mktemp("admission-local"),
        tiny_model_dir,
        decode=1,
        slots=2,
        max_len=MAX_LEN,
        api_keys=keys_path,
    )
    yield run
    run.stop_cleanly()


@pytest.fixture(scope="module")
def model(local):
    return httpx.get(f"{local.url}/v1/models", headers=_auth("interactive")).json()["data"][0]["id"]


def _auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


def _decode_slots_used(local) -> int:
    with grpc.insecure_channel(local.child("decode-0")["grpc"]) as channel:
        return (
            worker_pb2_grpc.DecodeStub(channel)
            .Status(worker_pb2.StatusRequest(), metadata=(("authorization", f"Bearer {local.token}"),), timeout=5)
            .slots_used
        )


def _admission(local) -> dict:
    return httpx.get(f"{local.url}/health").json()["admission"]


async def _ttft(
    http: httpx.AsyncClient,
    model: str,
    tenant: str,
    *,
    max_tokens: int = 24,
    priority: str = "normal",
    deadline_ms: int | None = None,
) -> tuple[int, float, float]:
    """(status, seconds to the first chunk, seconds to the end) of one streamed completion."""
    headers = {**_auth(tenant), "x-pdserve-priority": priority}
    if deadline_ms is not None:
        headers["x-pdserve-deadline-ms"] = str(deadline_ms)
    body = {
        "model": model,
        "prompt": "Admission test prompt",
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    started = time.monotonic()
    first = None
    async with http.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, 0.0, time.monotonic() - started
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: "):
                first = time.monotonic() - started
    return 200, first if first is not None else 0.0, time.monotonic() - started


def _client(url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=400))


def test_twenty_concurrent_requests_all_complete_within_their_deadline(local, model):
    deadline_s = 60

    async def run():
        async with _client(local.url) as http:
            return await asyncio.gather(
                *[_ttft(http, model, "interactive", max_tokens=32, deadline_ms=deadline_s * 1000) for _ in range(20)]
            )

    results = asyncio.run(run())
    assert [status for status, _, _ in results] == [200] * 20
    assert max(total for _, _, total in results) < deadline_s
    metrics = httpx.get(f"{local.url}/metrics").text
    assert 'status="429"' not in metrics
    assert 'pdserve_router_admission_wait_seconds_count{priority="normal"}' in metrics
    assert _admission(local)["waiting"] == {"high": 0, "normal": 0, "low": 0}


def test_high_priority_waits_a_quarter_of_low_or_less(local, model):
    """A backlog of low requests, high ones arriving while it drains."""

    async def run():
        async with _client(local.url) as http:
            lows = [asyncio.create_task(_ttft(http, model, "batch", priority="low")) for _ in range(40)]
            await asyncio.sleep(0.3)
            highs = []
            for _ in range(8):  # spaced out: each high meets the low backlog, not the other highs
                highs.append(asyncio.create_task(_ttft(http, model, "interactive", priority="high")))
                await asyncio.sleep(0.25)
            return await asyncio.gather(*lows), await asyncio.gather(*highs)

    lows, highs = asyncio.run(run())
    assert all(s == 200 for s, _, _ in lows + highs)
    low_p50 = statistics.median(w for _, w, _ in lows)
    high_p50 = statistics.median(w for _, w, _ in highs)
    print(f"priority: high wait p50 {high_p50 * 1000:.0f} ms, low {low_p50 * 1000:.0f} ms")
    assert high_p50 <= 0.25 * low_p50, (high_p50, low_p50)


def _closed_loop_waits(local, model, clients: dict[str, int], seconds: float) -> dict[str, list[float]]:
    """Each tenant runs `clients[tenant]` clients that send one request after the other."""
    waits: dict[str, list[float]] = {t: [] for t in clients}

    async def client(http, tenant, stop_at):
        while time.monotonic() < stop_at:
            status, wait, _ = await _ttft(http, model, tenant)
            assert status == 200
            waits[tenant].append(wait)

    async def run():
        async with _client(local.url) as http:
            stop_at = time.monotonic() + seconds
            await asyncio.gather(*[client(http, t, stop_at) for t, n in clients.items() for _ in range(n)])

    asyncio.run(run())
    return waits


def test_a_tenant_with_ten_times_the_load_at_most_doubles_the_others_wait(local, model):
    even = _closed_loop_waits(local, model, {"t1": 2, "t2": 2, "heavy": 2}, seconds=6)
    flood = _closed_loop_waits(local, model, {"t1": 2, "t2": 2, "heavy": 20}, seconds=6)
    before = statistics.median(even["t1"] + even["t2"])
    after = statistics.median(flood["t1"] + flood["t2"])
    # Fair over tokens: the others keep their share of the slots. (First come first served would
    # put each of their requests behind the heavy tenant's 20: about 4x the wait.)
    print(
        f"fairness: others' wait p50 {before * 1000:.0f} ms at even load, {after * 1000:.0f} ms with 10x; "
        f"requests heavy {len(flood['heavy'])}, t1+t2 {len(flood['t1'] + flood['t2'])}"
    )
    assert after <= 2.0 * before, (before, after, len(flood["t1"]), len(flood["heavy"]))
    assert len(flood["heavy"]) <= 2 * len(flood["t1"] + flood["t2"])


def test_a_tenant_is_held_to_its_tokens_per_minute(local, model):
    client = openai.OpenAI(base_url=f"{local.url}/v1", api_key=KEYS["capped"], max_retries=0, timeout=60)
    used, refused, started = 0, None, time.monotonic()
    for _ in range(200):
        try:
            reply = client.completions.create(
                model=model,
                prompt="Admission test prompt",
                max_tokens=40,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
        except openai.RateLimitError as exc:
            refused = exc
            break
        used += reply.usage.total_tokens
    elapsed = time.monotonic() - started
    assert refused is not None, f"{used} tokens in {elapsed:.1f}s and never refused"
    assert refused.code == "tokens_per_minute" and refused.body["type"] == "rate_limit_error"
    assert 1 <= int(refused.response.headers["retry-after"]) <= 60
    # The bucket: a minute's tokens at the start, refilled at tokensPerMinute/60 per second; the
    # last request admitted may overdraw it by its own generated tokens.
    print(f"tokens/min: {used} tokens in {elapsed:.1f} s before the 429 (limit {CAPPED_TPM}/min)")
    assert used <= CAPPED_TPM + CAPPED_TPM / 60 * elapsed + 40, (used, elapsed)
    metrics = httpx.get(f"{local.url}/metrics").text
    assert 'pdserve_router_admission_rejected_total{reason="tokens_per_minute"}' in metrics
    assert 'pdserve_router_tenant_tokens_total{kind="completion",tenant="capped"}' in metrics


def test_a_hundred_queued_clients_that_leave_free_everything_within_a_second(local, model):
    async def run() -> float:
        async with _client(local.url) as http:
            # Long requests keep both slots busy (two run, the rest wait at a higher class), so
            # the hundred low ones stay queued until they leave.
            holders = [asyncio.create_task(_ttft(http, model, "batch", max_tokens=MAX_LEN - 16)) for _ in range(10)]
            deadline = time.monotonic() + 30
            while _decode_slots_used(local) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            queued = [asyncio.create_task(_ttft(http, model, "interactive", priority="low")) for _ in range(100)]
            while _admission(local)["waiting"]["low"] < 100 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert _admission(local)["waiting"]["low"] == 100
            for task in holders + queued:
                task.cancel()
            await asyncio.gather(*holders, *queued, return_exceptions=True)
            left = time.monotonic()
            while time.monotonic() - left < 5:
                state = _admission(local)
                if sum(state["waiting"].values()) == 0 and state["running"] == 0 and _decode_slots_used(local) == 0:
                    break
                await asyncio.sleep(0.02)
            return time.monotonic() - left

    took = asyncio.run(run())
    state = _admission(local)
    assert sum(state["waiting"].values()) == 0 and state["running"] == 0
    assert _decode_slots_used(local) == 0
    print(f"disconnect: queue empty and slots free {took * 1000:.0f} ms after 110 clients left")
    assert took <= 1.0, took


def test_401_and_429_in_openai_shape(local, model):
    with pytest.raises(openai.AuthenticationError) as caught:
        openai.OpenAI(base_url=f"{local.url}/v1", api_key="sk-not-a-key-0123456789", max_retries=0).models.list()
    assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"
    assert set(caught.value.body) == {"message", "type", "param", "code"}
    bad = httpx.post(f"{local.url}/v1/completions", json={"model": model, "prompt": "x"})
    assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
    # A deadline the measured drain rate cannot meet: 429 at once (the earlier tests measured it).

    async def run():
        async with _client(local.url) as http:
            backlog = [
                asyncio.create_task(_ttft(http, model, "batch", priority="low", max_tokens=64)) for _ in range(30)
            ]
            while _admission(local)["waiting"]["low"] < 20:
                await asyncio.sleep(0.05)
            client = openai.AsyncOpenAI(base_url=f"{local.url}/v1", api_key=KEYS["batch"], max_retries=0)
            with pytest.raises(openai.RateLimitError) as refused:
                await client.completions.create(
                    model=model,
                    prompt="x",
                    max_tokens=4,
                    extra_headers={"x-pdserve-priority": "low", "x-pdserve-deadline-ms": "1"},
                )
            for task in backlog:
                task.cancel()
            await asyncio.gather(*backlog, return_exceptions=True)
            return refused.value

    refused = asyncio.run(run())
    assert refused.status_code == 429 and refused.code == "deadline"
    assert int(refused.response.headers["retry-after"]) >= 1


def test_a_rotated_key_works_without_restart(local, model, keys_path):
    new_key = "sk-interactive-ROTATED-0123456789"
    tmp = keys_path.with_suffix(".tmp")
    tmp.write_text(KEYS_FILE.replace(KEYS["interactive"], new_key))
    tmp.replace(keys_path)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if httpx.get(f"{local.url}/v1/models", headers={"Authorization": f"Bearer {new_key}"}).status_code == 200:
            break
        time.sleep(0.2)
    assert httpx.get(f"{local.url}/v1/models", headers={"Authorization": f"Bearer {new_key}"}).status_code == 200
    assert httpx.get(f"{local.url}/v1/models", headers=_auth("interactive")).status_code == 401
    tmp.write_text(KEYS_FILE)
    tmp.replace(keys_path)


def test_the_demo_sends_the_openai_api_key_and_names_it_when_refused(local, capsys):
    """`pdserve local --demo --api-keys F` asks with $OPENAI_API_KEY (passed in by the command)."""
    from pdserve_worker.cli.local import _demo

    assert _demo(local.url, "1 prefill, 1 decode", True, KEYS["batch"]) == 0  # never rotated by the test above
    shown = capsys.readouterr()
    assert shown.out.startswith("> ") and "TTFT" in shown.out.upper(), shown
    assert _demo(local.url, "1 prefill, 1 decode", True, None) == 1
    assert "OPENAI_API_KEY" in capsys.readouterr().err
