"""`pdserve local --transfer two-sided` end to end: the gloo send/recv baseline of seed 002's
experiment (transfer/backends/two_sided.py) carries the KV between real prefill and decode processes,
and the answers are the colocated Generator's, one at a time and four at once — so the
one-sided/two-sided comparison in benchmarks/seed_transfer.py is between working systems.
"""

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
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS]
    return [r.text for r in generate(loaded.model, loaded.tokenizer, prompts, params, max_len=MAX_LEN)]


@pytest.fixture(scope="module")
def local(tiny_model_dir, tmp_path_factory):
    run = local_deployment(
        tmp_path_factory.mktemp("two-sided"), tiny_model_dir, decode=1, slots=4, max_len=MAX_LEN, transfer="two-sided"
    )
    yield run
    run.stop_cleanly()


def test_two_sided_pd_answers_equal_colocated_one_at_a_time_and_together(local, reference):
    client = openai.OpenAI(base_url=f"{local.url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id

    def ask(prompt: str):
        return client.completions.create(
            model=model, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )

    first = ask(PROMPTS[0])
    assert first.choices[0].text == reference[0]
    assert first.model_extra["pdserve"]["disaggregated"] is True and first.model_extra["pdserve"]["kv_bytes"] > 0
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(ask, PROMPTS))
    assert [a.choices[0].text for a in answers] == reference
    # The KV really went two-sided: both roles' engines say so in their logs.
    for child in local.manifest["children"]:
        if child["role"] in ("prefill", "decode"):
            assert "event=engine_initialized backend=two-sided" in open(child["log"]).read(), child["name"]
