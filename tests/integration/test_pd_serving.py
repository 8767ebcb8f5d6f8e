"""The serving path end to end: `pdserve local` (broker, 2 decode, 1 prefill, router as real
processes on 127.0.0.1) driven by the official `openai` client, against colocated generation.

One deployment for the module (tiny model, fp32): greedy and seeded answers must be exactly the
colocated Generator's, streamed or not, one at a time or eight at once over both decodes; every
answer's KV must have arrived by push; bad input gets a 4xx and nothing breaks; gRPC calls need
the service's token. The drain test runs last (it takes a decode away).
"""

from __future__ import annotations

import concurrent.futures
import re
import time

import grpc
import httpx
import openai
import pytest

from pdserve.v1 import broker_pb2, broker_pb2_grpc, worker_pb2, worker_pb2_grpc
from support.clients import debug_client, scrape
from support.deployments import local_deployment

pytestmark = pytest.mark.slow

MAX_LEN = 256
SLOTS = 4
PROMPTS = [
    "The quick brown fox",
    "Paris is the capital of",
    "A language model predicts",
    "Numbers like 12345 and",
    "Prefill computes the cache of a prompt; decode reads it",
    "Unicode text: café, naïve,",
    "Berlin is",
    "The lazy dog",
]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Colocated generation in this process: what every answer must equal."""
    from pdserve_worker.model.engine import generate
    from pdserve_worker.model.loading.loader import load_model

    loaded = load_model(str(tiny_model_dir), dtype="float32")

    class Reference:
        tokenizer = loaded.tokenizer
        layout_bytes_per_token = 2 * loaded.config.num_layers * loaded.config.num_kv_heads * loaded.config.head_dim * 4

        def complete(self, prompt_ids: list[int], **params) -> str:
            return self.completion(prompt_ids, **params).text

        def completion(self, prompt_ids: list[int], **params):
            from pdserve_worker.model.sampling.params import SamplingParams

            [done] = generate(loaded.model, loaded.tokenizer, [prompt_ids], SamplingParams(**params), max_len=MAX_LEN)
            return done

    return Reference()


@pytest.fixture(scope="module")
def local(tiny_model_dir, tmp_path_factory):
    run = local_deployment(
        tmp_path_factory.mktemp("pd-local"), tiny_model_dir, slots=SLOTS, max_len=MAX_LEN, layers_per_chunk=1
    )
    yield run
    run.stop_cleanly()


@pytest.fixture(scope="module")
def client(local):
    return debug_client(local.url)  # (it names the serving workers: the tests check where requests went)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_completions_match_colocated_streamed_or_not(client, model, reference):
    prompt = PROMPTS[0]
    expected = reference.complete(reference.tokenizer.encode(prompt), max_tokens=24, temperature=0)
    whole = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0)
    assert whole.choices[0].text == expected
    report = whole.model_extra["pdserve"]
    assert report["disaggregated"] is True
    assert report["kv_bytes"] == whole.usage.prompt_tokens * reference.layout_bytes_per_token
    assert report["prefill"] == "prefill-0" and report["decode"] in ("decode-0", "decode-1")
    assert report["kv_transfer_ms"] >= 0

    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].model_extra["pdserve"]["disaggregated"] is True


def test_chat_matches_colocated_greedy_and_seeded(client, model, reference):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt_ids = reference.tokenizer.encode_chat(messages)
    greedy = client.chat.completions.create(model=model, messages=messages, max_tokens=20, temperature=0)
    assert greedy.choices[0].message.content == reference.complete(prompt_ids, max_tokens=20, temperature=0)
    # Prefill samples token 0, decode the rest: keyed by (seed, index), the same draws as colocated.
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=20, temperature=0.8, seed=11, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == reference.complete(prompt_ids, max_tokens=20, temperature=0.8, seed=11)


def test_logits_processors_through_pd_match_colocated(client, model, reference):
    """#31's processors: prefill draws token 0 and decode the rest, each with the request's
    penalties, bias and min_tokens, so PD answers as colocated generation does — through the
    official SDK (vLLM's extensions in `extra_body`)."""
    prompt = PROMPTS[1]
    ids = reference.tokenizer.encode(prompt)
    eos = sorted(reference.tokenizer.eos_token_ids)[0]
    cases = [
        dict(frequency_penalty=1.5, presence_penalty=0.5),
        dict(extra_body={"repetition_penalty": 1.4, "min_p": 0.05}, temperature=0.9, seed=5),
        dict(logit_bias={str(eos): 100}, extra_body={"min_tokens": 4}),
    ]
    for case in cases:
        extra = case.pop("extra_body", {})
        params = dict(max_tokens=16, temperature=case.pop("temperature", 0), **case, **extra)
        if "logit_bias" in params:
            params["logit_bias"] = tuple((int(k), float(v)) for k, v in params["logit_bias"].items())
        expected = reference.complete(ids, **params)
        answer = client.completions.create(
            model=model, prompt=prompt, max_tokens=16, temperature=params["temperature"], extra_body=extra, **case
        )
        assert answer.choices[0].text == expected, (case, extra)
        if "logit_bias" in case:  # EOS biased to win, held back for min_tokens: 4 tokens, then EOS (counted)
            assert answer.usage.completion_tokens == 5 and answer.choices[0].finish_reason == "stop"
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0)
    penalised = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0, frequency_penalty=2)
    assert plain.choices[0].text != penalised.choices[0].text  # the penalty changed the answer


def test_logprobs_through_pd_are_colocated_generations_in_both_shapes(client, model, reference):
    """#31's logprobs: the prefill's first token and the decode's others carry the same values
    colocated generation computes, in the completions shape (streamed and not) and the chat one;
    a sampled request's values do not depend on its temperature (they are taken before it)."""
    prompt = PROMPTS[2]
    ids = reference.tokenizer.encode(prompt)
    done = reference.completion(ids, max_tokens=8, temperature=0, logprobs=3)
    text_of = [reference.tokenizer.decode([t]) for t in done.output_ids]
    whole = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, logprobs=3)
    lp = whole.choices[0].logprobs
    assert lp.tokens == text_of
    assert lp.token_logprobs == pytest.approx([e.logprob for e in done.logprobs], abs=1e-4)
    for top, entry in zip(lp.top_logprobs, done.logprobs, strict=True):  # greedy: the chosen token is the top one
        expected_top = {reference.tokenizer.decode([i]): v for i, v in entry.top}  # (texts may collide: later wins)
        assert top == pytest.approx(expected_top, abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in text_of[:i]) for i in range(len(text_of))]
    streamed = list(
        client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, logprobs=3, stream=True)
    )
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in streamed if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert tokens == text_of and offsets == lp.text_offset

    messages = [{"role": "user", "content": "Name a colour."}]
    chat_ids = reference.tokenizer.encode_chat(messages)
    hot = reference.completion(chat_ids, max_tokens=6, temperature=1.5, seed=3, logprobs=2)
    chat = client.chat.completions.create(
        model=model, messages=messages, max_tokens=6, temperature=1.5, seed=3, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [reference.tokenizer.decode([t]) for t in hot.output_ids]
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in hot.logprobs], abs=1e-4)
    assert all(len(c.top_logprobs) == 2 and bytes(c.bytes).decode() == c.token for c in content)
    cold = client.chat.completions.create(
        model=model, messages=messages, max_tokens=1, temperature=0.2, seed=3, logprobs=True, top_logprobs=2
    )
    # The first position's distribution is the prompt's alone, taken before the temperature.
    first_hot, first_cold = content[0].top_logprobs, cold.choices[0].logprobs.content[0].top_logprobs
    assert [a.token for a in first_cold] == [a.token for a in first_hot]
    assert [a.logprob for a in first_cold] == pytest.approx([a.logprob for a in first_hot], abs=1e-5)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=model, messages=messages, max_tokens=2, top_logprobs=2)


def test_echo_through_pd_gives_the_prefills_prompt_logprobs(client, model, reference):
    """#31 echo: the prefill computes the prompt tokens' logprobs over the whole prompt and the
    router puts them before the generated ones (lm-eval's loglikelihood request shape), equal to
    colocated generation's, streamed or not."""
    prompt = PROMPTS[0]
    ids = reference.tokenizer.encode(prompt)
    done = reference.completion(ids, max_tokens=1, temperature=0, logprobs=2, prompt_logprobs=2)
    answer = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=2)
    lp = answer.choices[0].logprobs
    assert answer.choices[0].text == prompt + done.text
    assert lp.tokens == [reference.tokenizer.decode([t]) for t in ids + done.output_ids]
    expected = [None, *(e.logprob for e in done.prompt_logprobs), done.logprobs[0].logprob]
    assert lp.token_logprobs[0] is None and lp.token_logprobs[1:] == pytest.approx(expected[1:], abs=1e-4)
    assert answer.usage.prompt_tokens == len(ids) and answer.usage.completion_tokens == 1
    chunks = list(
        client.completions.create(
            model=model, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=2, stream=True
        )
    )
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(expected[1:], abs=1e-4)


def test_vllms_prompt_logprobs_through_pd_are_the_prefills(client, model, reference):
    """#31: prompt_logprobs (vLLM's field) over PD: every prompt token's logprob and rank as
    colocated generation computes them, its alternatives ranked 1..k."""
    prompt = PROMPTS[1]
    ids = reference.tokenizer.encode(prompt)
    done = reference.completion(ids, max_tokens=1, temperature=0, prompt_logprobs=2)
    reply = client.completions.create(
        model=model, prompt=prompt, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    got = reply.choices[0].model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    for token, entry, want in zip(ids[1:], got[1:], done.prompt_logprobs, strict=True):
        mine = entry[str(token)]
        assert mine["logprob"] == pytest.approx(want.logprob, abs=1e-4) and mine["rank"] == want.rank >= 1
        by_rank = {v["rank"]: v["logprob"] for v in entry.values()}
        assert 1 in by_rank and by_rank[1] >= mine["logprob"] - 1e-6  # the most likely is no less likely


def test_a_list_of_prompts_gets_each_its_colocated_answer(client, model, reference):
    """#31: several prompts in one request (lm-eval's batches), served at once over PD: choice i
    is prompt i's colocated answer, with echo and logprobs too."""
    prompts = PROMPTS[:3]
    expected = [reference.complete(reference.tokenizer.encode(p), max_tokens=6, temperature=0) for p in prompts]
    out = client.completions.create(model=model, prompt=prompts, max_tokens=6, temperature=0)
    assert [c.text for c in out.choices] == expected and [c.index for c in out.choices] == [0, 1, 2]
    ids = [reference.tokenizer.encode(p) for p in prompts[:2]]
    echoed = client.completions.create(model=model, prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=1)
    for choice, prompt_ids in zip(echoed.choices, ids, strict=True):
        assert len(choice.logprobs.token_logprobs) == len(prompt_ids) + 1 and choice.logprobs.token_logprobs[0] is None


def test_n_seeded_choices_are_the_colocated_answers_of_seed_plus_index(client, model, reference):
    """#31 item 2: n = 3 with a seed over PD: choice i is exactly the colocated answer sampled
    with seed + i (vLLM's parallel sampling seeds), and the prompt is counted once."""
    ids = reference.tokenizer.encode(PROMPTS[0])
    expected = [reference.complete(ids, max_tokens=8, temperature=1.0, seed=40 + i) for i in range(3)]
    out = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, seed=40, n=3)
    assert [c.text for c in out.choices] == expected and [c.index for c in out.choices] == [0, 1, 2]
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 24


def test_bad_words_through_pd_are_the_colocated_answer_with_the_same_bans(client, model, reference):
    """#31: vLLM's bad_words over PD: the router turns words into token sequences
    (api/bad_words.py), prefill and decode ban them; the answer is the colocated one with the
    same sequences banned, and differs from the unbanned one."""
    from pdserve_worker.api.bad_words import bad_word_ids

    ids = reference.tokenizer.encode(PROMPTS[2])
    free = reference.completion(ids, max_tokens=8, temperature=0, ignore_eos=True)
    word = reference.tokenizer.decode(free.output_ids[1:2]).strip() or reference.tokenizer.decode(free.output_ids[1:2])
    banned = bad_word_ids([word], lambda text: reference.tokenizer.encode(text, add_special_tokens=False))
    expected = reference.complete(ids, max_tokens=8, temperature=0, ignore_eos=True, bad_words=banned)
    out = client.completions.create(
        model=model,
        prompt=PROMPTS[2],
        max_tokens=8,
        temperature=0,
        extra_body={"bad_words": [word], "ignore_eos": True},
    )
    assert out.choices[0].text == expected != free.text


def test_stop_token_ids_end_the_answer_before_that_token_through_pd(client, model, reference):
    """vLLM's stop_token_ids: greedy generation stops where the named token would come (the
    decode checks it; the token's text is not in the answer), finish_reason stop."""
    prompt = PROMPTS[1]
    done = reference.completion(reference.tokenizer.encode(prompt), max_tokens=12, temperature=0, ignore_eos=True)
    stop_at = next(i for i in range(3, 12) if done.output_ids[i] not in done.output_ids[:i])
    answer = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        extra_body={"stop_token_ids": [done.output_ids[stop_at]]},
    )
    assert answer.choices[0].finish_reason == "stop" and answer.usage.completion_tokens == stop_at + 1
    assert answer.choices[0].text == reference.tokenizer.decode(done.output_ids[:stop_at], skip_special_tokens=True)


def test_stop_string_cut_once_by_decode(client, model, reference):
    prompt = PROMPTS[1]
    full = reference.complete(reference.tokenizer.encode(prompt), max_tokens=30, temperature=0)
    stop = next((full[i : i + 3] for i in range(4, len(full) - 3) if full[i : i + 3].strip()), None)
    assert stop, f"the reference answer {full!r} has no usable stop string"
    answer = client.completions.create(model=model, prompt=prompt, max_tokens=30, temperature=0, stop=[stop])
    assert answer.choices[0].text == full[: full.index(stop)]
    assert answer.choices[0].finish_reason == "stop"
    kept = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=30,
        temperature=0,
        stop=[stop],
        extra_body={"include_stop_str_in_output": True},
    )
    assert kept.choices[0].text == full[: full.index(stop) + len(stop)]


def test_eight_concurrent_requests_over_two_decodes(client, model, reference):
    expected = [reference.complete(reference.tokenizer.encode(p), max_tokens=16, temperature=0) for p in PROMPTS]

    def ask(prompt: str):
        return client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0)

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(ask, PROMPTS))
    assert [a.choices[0].text for a in answers] == expected
    assert all(a.model_extra["pdserve"]["disaggregated"] for a in answers)
    assert {a.model_extra["pdserve"]["decode"] for a in answers} == {"decode-0", "decode-1"}


def test_metrics_show_every_answer_pushed(local, client, model):
    client.completions.create(model=model, prompt="Berlin is", max_tokens=4, temperature=0)
    text = httpx.get(f"{local.url}/metrics").text

    def value(pattern: str) -> float:
        match = re.search(pattern + r" ([0-9.e+]+)", text)
        return float(match.group(1)) if match else 0.0

    completed = value(r'pdserve_router_requests_completed_total\{mode="disaggregated"\}')
    assert completed >= 1
    assert value(r'pdserve_router_requests_completed_total\{mode="colocated"\}') == 0
    assert value(r"pdserve_router_kv_transfer_bytes_count") == completed


def test_worker_metrics_agree_with_the_router(local, client, model):
    """Each prefill and decode pod serves /metrics; their sums agree with what the router counted."""
    answer = client.completions.create(model=model, prompt="The lazy dog", max_tokens=5, temperature=0)
    assert answer.usage.completion_tokens >= 2

    router = scrape(local.url.removeprefix("http://"))
    prefill = scrape(local.child("prefill-0")["http"])
    decodes = [scrape(local.child(n)["http"]) for n in ("decode-0", "decode-1")]
    # Every disaggregated request was prefilled once and pushed once, by the one prefill.
    requests = router['pdserve_router_requests_completed_total{mode="disaggregated"}']
    assert prefill["pdserve_prefill_queue_wait_seconds_count"] >= requests >= 1
    assert prefill["pdserve_prefill_prompt_tokens_total"] == router["pdserve_router_prompt_tokens_total"]
    assert prefill["pdserve_kv_transfer_bytes_total"] == router["pdserve_router_kv_transfer_bytes_sum"]
    assert prefill["pdserve_kv_transfer_failures_total"] == 0
    assert prefill["pdserve_prefill_queue_length"] == 0  # nothing in flight now
    # What the prefill pushed, the decodes received; the tokens they generated are the router's
    # minus the first token of each request (prefill samples it).
    assert sum(d["pdserve_kv_transfer_bytes_total"] for d in decodes) == prefill["pdserve_kv_transfer_bytes_total"]
    generated = sum(d["pdserve_decode_generated_tokens_total"] for d in decodes)
    assert generated == router["pdserve_router_generation_tokens_total"] - requests
    for d in decodes:
        assert d["pdserve_decode_kv_slots_total"] == SLOTS
        assert 0 <= d["pdserve_decode_kv_slots_used"] <= SLOTS
        assert d["pdserve_decode_running_requests"] == 0
        assert d["pdserve_decode_step_seconds_count"] >= 0 and d["pdserve_decode_step_seconds_sum"] >= 0
    assert sum(d["pdserve_decode_step_seconds_count"] for d in decodes) >= 1


def test_bad_input_is_4xx_and_the_service_keeps_serving(client, model):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=model, prompt="fox " * (MAX_LEN + 10), max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=model, prompt="hi", max_tokens=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="hi", max_tokens=-3)
    ok = client.completions.create(model=model, prompt="hi", max_tokens=3, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length") and ok.usage.completion_tokens >= 1


def test_grpc_calls_need_the_service_token(local):
    wrong = (("authorization", "Bearer not-the-token"),)
    right = (("authorization", f"Bearer {local.token}"),)
    with grpc.insecure_channel(local.manifest["broker"]) as channel:
        broker = broker_pb2_grpc.BrokerStub(channel)
        with pytest.raises(grpc.RpcError) as denied:
            broker.ListMembers(broker_pb2.ListMembersRequest(service_key="local/pdserve"), metadata=wrong, timeout=5)
        assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as other:
            broker.ListMembers(broker_pb2.ListMembersRequest(service_key="other/service"), metadata=right, timeout=5)
        assert other.value.code() == grpc.StatusCode.PERMISSION_DENIED
        members = broker.ListMembers(
            broker_pb2.ListMembersRequest(service_key="local/pdserve"), metadata=right, timeout=5
        ).members
        assert {m.info.worker_id for m in members} == {"decode-0", "decode-1", "prefill-0", "router-0"}
    with grpc.insecure_channel(local.child("decode-0")["grpc"]) as channel:
        decode = worker_pb2_grpc.DecodeStub(channel)
        with pytest.raises(grpc.RpcError) as denied:
            decode.Status(worker_pb2.StatusRequest(), metadata=wrong, timeout=5)
        assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as missing:
            decode.Reserve(worker_pb2.ReserveRequest(request_id="x", num_prompt_tokens=3, max_tokens=3), timeout=5)
        assert missing.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert decode.Status(worker_pb2.StatusRequest(), metadata=right, timeout=5).slots_total == SLOTS
    with grpc.insecure_channel(local.child("prefill-0")["grpc"]) as channel:
        prefill = worker_pb2_grpc.PrefillStub(channel)
        with pytest.raises(grpc.RpcError) as denied:
            prefill.Prefill(
                worker_pb2.PrefillRequest(request_id="x", prompt_token_ids=[1, 2]), metadata=wrong, timeout=5
            )
        assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # What the prefix cache holds (#30's block events) is for the service's routers only.
        with pytest.raises(grpc.RpcError) as denied:
            prefill.BlockEvents(worker_pb2.BlockEventsRequest(), metadata=wrong, timeout=5)
        assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as missing:
            prefill.BlockEvents(worker_pb2.BlockEventsRequest(), timeout=5)
        assert missing.value.code() == grpc.StatusCode.UNAUTHENTICATED
        held = prefill.BlockEvents(worker_pb2.BlockEventsRequest(), metadata=right, timeout=5)
        assert held.enabled and held.reset and len(held.salt) == 32  # on by default; a snapshot first


def _decode_status(local, name: str) -> worker_pb2.DecodeStatus:
    with grpc.insecure_channel(local.child(name)["grpc"]) as channel:
        return worker_pb2_grpc.DecodeStub(channel).Status(
            worker_pb2.StatusRequest(), metadata=(("authorization", f"Bearer {local.token}"),), timeout=5
        )


def test_a_client_that_goes_away_frees_its_slot(local, client, model):
    """The client closes a stream the decode still generates: its slot is freed. On a loaded
    machine the decode may have generated every token before the first chunk is read (nothing
    left to abandon): the test then tries again, up to 3 times, and fails if it never holds a slot."""

    def used() -> int:
        return sum(_decode_status(local, n).slots_used for n in ("decode-0", "decode-1"))

    for _ in range(3):
        stream = client.completions.create(
            model=model,
            prompt=PROMPTS[2],
            max_tokens=MAX_LEN - 20,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        next(iter(stream))
        busy = used()
        stream.close()
        if busy:
            break
        deadline = time.monotonic() + 10
        while used() and time.monotonic() < deadline:
            time.sleep(0.05)
    assert busy >= 1, "every try's stream was generated whole before its first chunk was read"
    deadline = time.monotonic() + 10
    while used() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert used() == 0


def test_start_failure_names_the_child_and_exits_nonzero(tiny_model_dir, tmp_path):
    """Workers that refuse their settings die at start: `pdserve local` shows why and exits 1."""
    import subprocess

    from support.local_run import cli, cli_env

    out = subprocess.run(
        cli(
            "local",
            "--model",
            str(tiny_model_dir),
            "--dtype",
            "float32",
            "--decode",
            "1",
            "--slots",
            "1",
            "--max-len",
            "8",
            "--port",
            "0",
            "--log-dir",
            str(tmp_path),
        ),
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=180,
    )
    assert out.returncode == 1, out.stderr
    assert re.search(r"(decode|prefill|router)-0 \(pid \d+\) exited with code 2", out.stderr), out.stderr
    assert "PDSERVE_MAX_LENGTH" in out.stderr  # the child's own message, naming the bad variable
    assert out.stdout == ""  # the URL is printed only once serving


def test_a_taken_port_is_refused_before_anything_starts(local, tiny_model_dir, tmp_path):
    import subprocess

    from support.local_run import cli, cli_env

    port = local.url.rsplit(":", 1)[1]
    out = subprocess.run(
        cli("local", "--model", str(tiny_model_dir), "--port", port, "--log-dir", str(tmp_path)),
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=60,
    )
    assert out.returncode == 1 and f"port {port}" in out.stderr and "already in use" in out.stderr
    assert not (tmp_path / "deployment.json").exists()


def test_drain_takes_a_decode_out_and_requests_go_on(local, client, model, reference):
    """Last: decode-1's preStop drain; the router stops using it and answers stay right."""
    decode1 = local.child("decode-1")
    assert local.drain("decode-1")["drained"] is True
    assert httpx.get(f"http://{decode1['http']}/readyz").status_code == 503
    # Drained and deregistered, it fails liveness: Kubernetes replaces it instead of keeping it idle.
    assert httpx.get(f"http://{decode1['http']}/healthz").status_code == 503
    deadline = time.monotonic() + 10
    while httpx.get(f"{local.url}/health").json()["members"]["decode"] != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(f"{local.url}/health").json()["members"] == {"prefill": 1, "decode": 1}
    expected = reference.complete(reference.tokenizer.encode(PROMPTS[3]), max_tokens=8, temperature=0)
    for _ in range(3):
        answer = client.completions.create(model=model, prompt=PROMPTS[3], max_tokens=8, temperature=0)
        assert answer.choices[0].text == expected
        assert answer.model_extra["pdserve"]["decode"] == "decode-0"
