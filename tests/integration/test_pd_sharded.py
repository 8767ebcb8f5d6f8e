"""A layer-sharded decode group as real processes: `pdserve local --layer-shards 2` (broker, one
prefill, a decode group of a leader and a follower, router) answers exactly as colocated
generation does, with the prompt's KV pushed into both members and one instance registered."""

from __future__ import annotations

import concurrent.futures

import openai
import pytest

from support.deployments import local_deployment

pytestmark = pytest.mark.slow

MAX_LEN = 128
PROMPTS = ["The quick brown fox", "Paris is the capital of", "A language model predicts", "Berlin is"]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    from pdserve_worker.model.engine import generate
    from pdserve_worker.model.loading.loader import load_model
    from pdserve_worker.model.sampling.params import SamplingParams

    loaded = load_model(str(tiny_model_dir), dtype="float32")

    def complete(prompt: str, **params) -> str:
        [done] = generate(
            loaded.model, loaded.tokenizer, [loaded.tokenizer.encode(prompt)], SamplingParams(**params), max_len=MAX_LEN
        )
        return done.text

    complete.kv_bytes_per_token = 2 * loaded.config.num_layers * loaded.config.num_kv_heads * loaded.config.head_dim * 4
    return complete


@pytest.fixture(scope="module")
def local(tiny_model_dir, tmp_path_factory):
    run = local_deployment(
        tmp_path_factory.mktemp("pd-sharded"),
        tiny_model_dir,
        decode=1,
        layer_shards=2,
        slots=4,
        max_len=MAX_LEN,
        layers_per_chunk=1,
        threads=1,
    )
    yield run
    run.stop_cleanly()


def test_group_of_two_processes_answers_as_colocated(local, reference):
    roles = sorted(c["role"] for c in local.manifest["children"])
    assert roles == ["broker", "decode", "decode-member", "prefill", "router"]
    client = openai.OpenAI(
        base_url=f"{local.url}/v1",
        api_key="unused",
        max_retries=0,
        timeout=120,
        default_headers={"x-pdserve-debug": "workers"},
    )
    model = client.models.list().data[0].id

    answer = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=20, temperature=0)
    assert answer.choices[0].text == reference(PROMPTS[0], max_tokens=20, temperature=0)
    report = answer.model_extra["pdserve"]
    assert report["disaggregated"] is True and report["decode"] == "decode-0-0"
    # Both members' shares arrived: the whole model's KV of the prompt.
    assert report["kv_bytes"] == answer.usage.prompt_tokens * reference.kv_bytes_per_token

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(
            pool.map(lambda p: client.completions.create(model=model, prompt=p, max_tokens=12, temperature=0), PROMPTS)
        )
    assert [a.choices[0].text for a in answers] == [reference(p, max_tokens=12, temperature=0) for p in PROMPTS]


def test_a_follower_asked_to_drain_keeps_serving_its_leader(local, reference):
    """A follower's preStop waits for its leader to let go (up to the drain timeout, 10 s in
    `pdserve local`) and never cuts the leader's steps short."""
    follower = next(c for c in local.manifest["children"] if c["role"] == "decode-member")
    reply = local.drain(follower["name"], timeout_s=30)
    assert reply == {"drained": False, "busy": 1}  # the leader's step stream is still open
    client = openai.OpenAI(
        base_url=f"{local.url}/v1",
        api_key="unused",
        max_retries=0,
        timeout=120,
        default_headers={"x-pdserve-debug": "workers"},
    )
    model = client.models.list().data[0].id
    answer = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=8, temperature=0)
    assert answer.choices[0].text == reference(PROMPTS[1], max_tokens=8, temperature=0)
