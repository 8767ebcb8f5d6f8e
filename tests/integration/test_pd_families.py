"""qwen2 and qwen3 through real prefill/decode processes: `pdserve local --model DIR` (broker,
prefill, decode or a decode group of two, router), KV pushed between processes, against
colocated generation in this process. The models are the tiny transformers-built families of
tests/support/model_families.py (q/k/v bias; q/k norm, explicit head_dim, tied head), whose KV bytes
per token differ from the LLaMA default's."""

from __future__ import annotations

import concurrent.futures

import openai
import pytest

from support.deployments import local_deployment
from support.local_run import pid_alive

pytestmark = pytest.mark.slow

MAX_LEN = 128
PROMPTS = ["The quick brown fox", "Paris is the capital of", "Unicode text: café, 東京 🙂 12345"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(
    scope="module",
    params=[("qwen2", 1), ("qwen2", 2), ("qwen3", 1), ("qwen3", 2)],
    ids=["qwen2", "qwen2-shards2", "qwen3", "qwen3-shards2"],
)
def deployment(request, family_dirs, tmp_path_factory):
    """(pdserve local run, colocated reference) for one family and layer-shard count."""
    from pdserve_worker.model.engine import generate
    from pdserve_worker.model.loading.loader import load_model
    from pdserve_worker.model.sampling.params import SamplingParams

    name, shards = request.param
    folder = family_dirs(name)
    loaded = load_model(str(folder), dtype="float32")

    def reference(prompt_ids: list[int], max_tokens: int) -> str:
        # The model's generation_config defaults apply as the server applies them (its
        # repetition_penalty included); the request's own temperature 0 wins.
        defaults = loaded.generation.sampling_defaults()
        params = SamplingParams(**{**defaults, "max_tokens": max_tokens, "temperature": 0})
        [done] = generate(loaded.model, loaded.tokenizer, [prompt_ids], params, max_len=MAX_LEN)
        return done.text

    run = local_deployment(
        tmp_path_factory.mktemp(f"pd-{name}-{shards}"),
        folder,
        decode=1,
        layer_shards=shards,
        slots=4,
        max_len=MAX_LEN,
        layers_per_chunk=1,
        threads=1,
    )
    yield run, loaded, reference
    pids = [c["pid"] for c in run.manifest["children"]]
    run.stop_cleanly()
    assert not [pid for pid in pids if pid_alive(pid)], "children outlived pdserve local"


def test_greedy_output_equals_colocated_generation(deployment):
    run, loaded, reference = deployment
    client = openai.OpenAI(base_url=f"{run.url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    kv_bytes_per_token = loaded.config.kv_bytes_per_token("float32")

    first = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=24, temperature=0)
    assert first.choices[0].text == reference(loaded.tokenizer.encode(PROMPTS[0]), 24)
    report = first.model_extra["pdserve"]
    assert report["disaggregated"] is True
    assert report["kv_bytes"] == first.usage.prompt_tokens * kv_bytes_per_token  # every layer's KV was pushed

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:  # batched decode across requests
        answers = list(
            pool.map(lambda p: client.completions.create(model=model, prompt=p, max_tokens=16, temperature=0), PROMPTS)
        )
    assert [a.choices[0].text for a in answers] == [reference(loaded.tokenizer.encode(p), 16) for p in PROMPTS]

    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=16, temperature=0)
    assert chat.choices[0].message.content == reference(loaded.tokenizer.encode_chat(CHAT), 16)
