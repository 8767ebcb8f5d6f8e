"""A model's generation_config.json sampling values reach requests through `pdserve local`.

The tiny model with `{"do_sample": false}` in its generation_config.json (greedy, transformers'
meaning): a completion that sets no temperature is then greedy, through the real router and
workers — the same text twice, and the text of an explicit `temperature: 0` request. Without
the router applying the file, such a request is sampled at temperature 1 with no seed.
"""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from support.local_run import pid_alive, served_model

pytestmark = pytest.mark.slow


def test_a_request_without_temperature_follows_do_sample_false(tiny_model_dir, tmp_path, local_deployments):
    folder = shutil.copytree(tiny_model_dir, tmp_path / "greedy-model")
    config = folder / "generation_config.json"
    data = json.loads(config.read_text()) if config.exists() else {}
    config.write_text(json.dumps({**data, "do_sample": False}))
    run = local_deployments(tmp_path / "run", folder, decode=1, slots=2, max_len=128, threads=1)
    pids = [c["pid"] for c in run.manifest["children"]]
    try:
        model = served_model(run.url)

        def complete(**sampling: float) -> str:
            body = {"model": model, "prompt": "Paris is the capital of", "max_tokens": 24, "ignore_eos": True}
            reply = httpx.post(f"{run.url}/v1/completions", json={**body, **sampling}, timeout=60)
            assert reply.status_code == 200, reply.text
            return reply.json()["choices"][0]["text"]

        unset = [complete(), complete()]
        greedy = complete(temperature=0.0)
        hot = {complete(temperature=1.5) for _ in range(3)}
    finally:
        run.stop_cleanly()
    assert not [pid for pid in pids if pid_alive(pid)]
    assert unset == [greedy, greedy]
    assert hot != {greedy}, "sampling at temperature 1.5 gave the greedy text three times: the check cannot tell"
