"""Issue #58 A1, against real processes (`pdserve local`, the session's `local` deployment):
requests whose structured outputs and tools are slow to compile must not stall the router's
event loop. Before the fix, every schema was compiled while the request body was validated, on
the loop: /health and every other request waited behind it.

The attack: 12 requests at once, each with a different 1.6 KB JSON schema that takes llguidance
0.35-0.8 s to compile (api/grammar_compiler.py's tests have it), and one chat request with 100
such tool schemas. While it runs, /health and plain completions must answer in under 1 s at
p99, and the attack's requests end as answers or 4xx (never a 500)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timing]

ATTACKERS = 12  # (with the tools request and two probes: 15 connections, under the fixture's 16 per address)
TOOLS = 100


def slow_schema(salt: str) -> dict:
    return {
        "allOf": [
            {"anyOf": [{"type": "object", "properties": {f"{salt}a{i}{j}": {"type": "integer"}}} for j in range(4)]}
            for i in range(6)
        ]
    }


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def test_a1_slow_grammars_leave_health_and_other_requests_under_a_second(local):
    url = local.url
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    salt = f"s{time.monotonic_ns()}"  # (new schemas each run: nothing compiled before helps)
    done = threading.Event()
    health: list[float] = []
    victims: list[float] = []

    def probe(path: str, out: list[float], body: dict | None) -> None:
        with httpx.Client(base_url=url, timeout=30) as http:
            while not done.is_set():
                started = time.monotonic()
                r = http.post(path, json=body) if body is not None else http.get(path)
                assert r.status_code == 200, r.text
                out.append(time.monotonic() - started)
                time.sleep(0.05)

    def attack(i: int) -> int:
        body = {"model": model, "prompt": "hi", "max_tokens": 2, "guided_json": slow_schema(f"{salt}{i}")}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        return r.status_code

    def tools_attack() -> int:
        tools = [
            {"type": "function", "function": {"name": f"t{i}", "parameters": slow_schema(f"{salt}t{i}")}}
            for i in range(TOOLS)
        ]
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": tools}
        return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).status_code

    plain = {"model": model, "prompt": "hello", "max_tokens": 2, "temperature": 0}
    with ThreadPoolExecutor(ATTACKERS + 3) as pool:
        watchers = [pool.submit(probe, "/health", health, None), pool.submit(probe, "/v1/completions", victims, plain)]
        try:
            time.sleep(0.5)
            started = time.monotonic()
            tools_status = pool.submit(tools_attack)
            statuses = list(pool.map(attack, range(ATTACKERS))) + [tools_status.result()]
            attack_s = time.monotonic() - started
        finally:
            done.set()
        for w in watchers:
            w.result()
    assert attack_s > 1.0, f"the attack took {attack_s:.2f} s: its schemas were not slow to compile here"
    assert set(statuses) <= {200, 400, 429}, statuses
    assert statuses[-1] == 400  # 100 tool schemas: over the prompt's size or the request's compile budget
    assert len(health) >= 10 and len(victims) >= 5, (len(health), len(victims))
    assert p99(health) < 1.0, f"/health p99 {p99(health):.2f} s while the attack ran ({len(health)} probes)"
    assert p99(victims) < 1.0, f"plain completions p99 {p99(victims):.2f} s while the attack ran ({len(victims)})"
