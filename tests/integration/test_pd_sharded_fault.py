"""A decode group whose follower died fails requests with an error at once; it does not hang."""

from __future__ import annotations

import os
import signal
import time

import openai
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timing]


def test_a_dead_follower_fails_requests_quickly(tiny_model_dir, tmp_path, local_deployments):
    run = local_deployments(tmp_path, tiny_model_dir, decode=1, layer_shards=2, slots=2, max_len=64, threads=1)
    try:
        client = openai.OpenAI(base_url=f"{run.url}/v1", api_key="unused", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        assert client.completions.create(model=model, prompt="Berlin is", max_tokens=4, temperature=0).choices
        follower = next(c for c in run.manifest["children"] if c["role"] == "decode-member")
        os.kill(follower["pid"], signal.SIGKILL)  # a child this test's deployment started
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as failed:
            client.completions.create(model=model, prompt="Berlin is", max_tokens=4, temperature=0)
        assert failed.value.status_code >= 500
        assert time.monotonic() - started < 30
    finally:
        run.stop()
