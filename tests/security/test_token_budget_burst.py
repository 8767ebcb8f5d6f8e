"""#29's token-budget attack against real processes: a tenant limited to 2,000 tokens/min sends
16 requests at once, each allowed 300 tokens (ignore_eos, so each would use them all). Before,
admission charged the prompt only and all 16 ran (4,870 tokens in 32 s, every decode slot
held). Now each request reserves prompt + max_tokens at admission: the burst gets no more than
the minute's budget, the rest is refused with 429 `tokens_per_minute` and a Retry-After.

`pdserve local --api-keys` with the tiny model: broker, a prefill, a decode, the router.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from support.deployments import local_deployment

pytestmark = pytest.mark.slow

KEY = "sk-burst-0123456789abcdef0123"
TPM, MAX_TOKENS, BURST = 2000, 300, 16


@pytest.fixture(scope="module")
def local(tiny_model_dir, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys.write_text(f'tenants:\n  - name: burst\n    keys: ["{KEY}"]\n    tokensPerMinute: {TPM}\n')
    run = local_deployment(
        tmp_path_factory.mktemp("burst"), tiny_model_dir, decode=1, slots=BURST, max_len=512, api_keys=keys
    )
    yield run
    run.stop_cleanly()


def test_a_burst_gets_no_more_than_the_tenants_tokens_per_minute(local):
    headers = {"Authorization": f"Bearer {KEY}"}
    model = httpx.get(f"{local.url}/v1/models", headers=headers).json()["data"][0]["id"]
    body = {"model": model, "prompt": "Burst", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}

    def one(_: int) -> httpx.Response:
        return httpx.post(f"{local.url}/v1/completions", json=body, headers=headers, timeout=120)

    started = time.monotonic()
    with ThreadPoolExecutor(BURST) as pool:
        replies = list(pool.map(one, range(BURST)))
    elapsed = time.monotonic() - started
    served = [r for r in replies if r.status_code == 200]
    refused = [r for r in replies if r.status_code == 429]
    assert len(served) + len(refused) == BURST, [r.status_code for r in replies]
    used = sum(r.json()["usage"]["total_tokens"] for r in served)
    prompt = served[0].json()["usage"]["prompt_tokens"]
    # The budget, plus what refilled while the burst ran, plus at most one request's worth.
    assert used <= TPM + TPM / 60 * elapsed + prompt + MAX_TOKENS, (used, elapsed, len(served))
    assert len(served) <= TPM // (prompt + MAX_TOKENS) + 1
    assert refused, "every request of the burst was admitted"
    for r in refused:
        assert r.json()["error"]["code"] == "tokens_per_minute"
        assert 1 <= int(r.headers["retry-after"]) <= 60
