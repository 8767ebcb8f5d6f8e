"""Issue #58 A8 and A10's `logit_bias`, against real processes (the session's `pdserve local`):
a client's own bad input is a 400 naming the field, never a 500 after it reached the workers.
Before the fix, `repetition_penalty: 1e-300` divided the fp32 logits to inf (a 500 from the
prefill), and a `logit_bias` id past the vocabulary reached the workers."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(local) -> str:
    return httpx.get(f"{local.url}/v1/models", timeout=10).json()["data"][0]["id"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),
        ({"repetition_penalty": 0.0099}, "repetition_penalty"),
        ({"logit_bias": {"999999": 5}}, "logit_bias"),
    ],
)
def test_out_of_range_sampling_inputs_are_400_naming_the_field(local, model, extra, param):
    body = {"model": model, "prompt": "hello", "max_tokens": 3, **extra}
    r = httpx.post(f"{local.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_the_bounds_themselves_are_served(local, model):
    for extra in ({"repetition_penalty": 0.01}, {"repetition_penalty": 100.0}, {"logit_bias": {"5": 100}}):
        body = {"model": model, "prompt": "hello", "max_tokens": 3, "temperature": 1.0, "seed": 1, **extra}
        r = httpx.post(f"{local.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, (extra, r.text)
        assert r.json()["usage"]["completion_tokens"] >= 1
