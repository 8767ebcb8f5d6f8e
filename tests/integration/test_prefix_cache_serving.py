"""The prefix cache end to end: `pdserve local` with `--prefix-cache-tokens`, PD, colocated and a
layer-sharded decode group. Multi-turn prompts sharing a system prompt are answered exactly as
colocated generation without any cache answers them (greedy), and repeats report
`usage.prompt_tokens_details.cached_tokens` (issue #16's acceptance)."""

from __future__ import annotations

import openai
import pytest

from support.deployments import local_deployment
from support.local_run import LocalRun

pytestmark = pytest.mark.slow

MAX_LEN = 256
SYSTEM = (
    "You are a careful assistant for a platform team. Answer in one short sentence, plainly, "
    "and never invent facts you were not given."
)
TURNS = [
    " Q: What is a KV cache? A:",
    " Q: What is a KV cache? A: It stores keys. Q: And values? A:",
    " Q: Name a colour. A:",
]
MODES: dict[str, dict] = {
    "pd": {"decode": 1},
    "colocated": {"colocated": True},
    "pd-layer-shards-2": {"decode": 1, "layer_shards": 2},
}


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Colocated generation in this process without a prefix cache: what every answer must equal."""
    from pdserve_worker.model.engine import generate
    from pdserve_worker.model.loading.loader import load_model
    from pdserve_worker.model.sampling.params import SamplingParams

    loaded = load_model(str(tiny_model_dir), dtype="float32")

    def complete(prompt: str, max_tokens: int) -> str:
        ids = loaded.tokenizer.encode(prompt)
        [done] = generate(
            loaded.model, loaded.tokenizer, [ids], SamplingParams(max_tokens=max_tokens, temperature=0), max_len=MAX_LEN
        )
        return done.text

    complete.encode = loaded.tokenizer.encode
    return complete


def start(tmp_path_factory, tiny_model_dir, name: str, **mode) -> LocalRun:
    return local_deployment(
        tmp_path_factory.mktemp(f"prefix-{name}"),
        tiny_model_dir,
        **mode,
        slots=4,
        max_len=MAX_LEN,
        layers_per_chunk=1,
        threads=1,
        prefix_cache_tokens=2048,
        env={
            "PDSERVE_DECODE_PREFIX_CACHE": "0"
        },  # (the prefill's cache under test: the decode's own (kv/decode_prefix.py) would serve repeats first)
    )


@pytest.fixture(scope="module", params=sorted(MODES))
def local(request, tiny_model_dir, tmp_path_factory):
    run = start(tmp_path_factory, tiny_model_dir, request.param, **MODES[request.param])
    run.mode = request.param
    yield run
    run.stop_cleanly()


@pytest.fixture(scope="module")
def two_prefills(tiny_model_dir, tmp_path_factory):
    """Two prefills: n copies of a prompt, started at once, would be spread over both (and each
    prefill would compute the prompt) without api/prompt_copies.py."""
    run = start(tmp_path_factory, tiny_model_dir, "two-prefills", prefill=2, decode=1)
    yield run
    run.stop_cleanly()


def test_greedy_answers_with_the_prefix_cache_equal_those_without(local, reference):
    client = openai.OpenAI(base_url=f"{local.url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    system_blocks = len(reference.encode(SYSTEM)) // 16 * 16
    cached = []
    for round_ in range(2):  # the second round finds every prompt cached but its tail
        for turn in TURNS:
            prompt = SYSTEM + turn
            answer = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0)
            assert answer.choices[0].text == reference(prompt, 16), (round_, turn)
            cached.append(answer.usage.prompt_tokens_details.cached_tokens)
            assert 0 <= cached[-1] < answer.usage.prompt_tokens and cached[-1] % 16 == 0
    assert cached[0] == 0  # nothing was cached before the first request
    assert all(c >= system_blocks - 16 for c in cached[1:]), cached  # the system prompt's blocks, at least
    assert cached[len(TURNS) + 1] > cached[1]  # a repeated long turn reuses more than the system prompt


def counter(local, roles: tuple[str, ...], name: str) -> float:
    """The counter `name` summed over every process of `roles` (from their /metrics)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for child in local.manifest["children"]:
        if child["role"] not in roles or not child["http"]:
            continue
        text = httpx.get(f"http://{child['http']}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            if family.name == name:
                total += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return total


def hit_tokens(local) -> float:
    """pdserve_prefill_prefix_hit_tokens_total over every process that prefills."""
    return counter(local, ("prefill", "colocated"), "pdserve_prefill_prefix_hit_tokens")


def pushed_and_shared(local) -> tuple[float, float]:
    """KV bytes the prefills pushed, and KV blocks decodes took from another copy instead."""
    return (
        counter(local, ("prefill",), "pdserve_kv_transfer_bytes"),
        counter(local, ("decode",), "pdserve_decode_kv_shared_blocks"),
    )


def test_n_copies_of_a_prompt_compute_it_once_and_answer_as_single_requests(local, reference):
    check_copies(local, reference)


def test_n_copies_go_to_the_prefill_of_the_first_copy(two_prefills, reference):
    """Without api/prompt_copies.py the copies spread over both prefills and only one of them
    found the prompt cached (measured: 128 of the 256 tokens asked here)."""
    check_copies(two_prefills, reference)


def check_copies(local, reference) -> None:
    """#31 item 2 (api/prompt_copies.py): the first copy prefills, the others find the prompt in
    the prefix cache of the same prefill; each copy still samples as the single request with its
    seed would (seed + i)."""
    client = openai.OpenAI(base_url=f"{local.url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    prompt = SYSTEM + " Three answers to one question about copies, please."
    whole = (len(reference.encode(prompt)) - 1) // 16 * 16  # what a prefill may reuse (it computes the last token)
    before, (pushed_before, shared_before) = hit_tokens(local), pushed_and_shared(local)
    out = client.completions.create(model=model, prompt=prompt, max_tokens=8, n=3, temperature=0.9, seed=11)
    reused = hit_tokens(local) - before
    assert reused >= 2 * whole > 0, (reused, whole)  # copies 1 and 2 reused every whole block of the prompt
    pushed_n, shared_n = (a - b for a, b in zip(pushed_and_shared(local), (pushed_before, shared_before), strict=True))
    singles = [
        client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0.9, seed=11 + i)
        for i in range(3)
    ]
    assert [c.text for c in out.choices] == [s.choices[0].text for s in singles]
    assert out.usage.prompt_tokens == singles[0].usage.prompt_tokens  # the prompt counted once
    if "prefill" not in {child["role"] for child in local.manifest["children"]}:
        return
    # PD: pushed once. The other copies took the first copy's whole prompt blocks on the decode
    # (read-only) and were pushed only the tail; each single request pushed it all. A layer-
    # sharded group keeps max-length slots, not blocks: nothing to share there, pushed 3 times.
    pushed_one = (pushed_and_shared(local)[0] - pushed_before - pushed_n) / 3
    if getattr(local, "mode", "") == "pd-layer-shards-2":
        assert (shared_n, pushed_n) == (0, pytest.approx(3 * pushed_one))
        return
    blocks = out.usage.prompt_tokens // 16
    assert shared_n == 2 * blocks > 0, (shared_n, blocks)
    tail = (out.usage.prompt_tokens - blocks * 16) / out.usage.prompt_tokens
    assert pushed_n == pytest.approx(pushed_one * (1 + 2 * tail)), (pushed_n, pushed_one, tail)
    # One token each: the first copy has ended before the others reserve; its decode kept the
    # prompt's blocks for them.
    _, shared_before = pushed_and_shared(local)
    short = client.completions.create(model=model, prompt=prompt, max_tokens=1, n=3, temperature=0.9, seed=11)
    assert [c.text for c in short.choices] == [
        s.choices[0].text[: len(c.text)] for c, s in zip(short.choices, singles, strict=True)
    ]
    assert pushed_and_shared(local)[1] - shared_before == 2 * blocks
