"""The router's HTTP API as a real client sees it: the official `openai` package against a
uvicorn server on 127.0.0.1, over a scripted backend."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve_worker.api.app import create_app
from pdserve_worker.api.backend import BackendUnavailable, NoCapacity, RequestInfo, RequestTimeout
from pdserve_worker.api.metrics import RouterMetrics
from support.router_fakes import ScriptedBackend, running_router

MODEL = ScriptedBackend.model_name


@pytest.fixture
def serve(port):
    """serve(backend) -> (openai client, base url); the server stops with the test."""
    stack = []

    def start(backend, metrics=None):
        cm = running_router(create_app(backend, metrics), port)
        url = cm.__enter__()
        stack.append(cm)
        return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10), url

    yield start
    for cm in stack:
        cm.__exit__(None, None, None)


def samples(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{url}/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


# --- answers ---------------------------------------------------------------------------------


def test_completion_non_streaming_gives_text_usage_and_finish(serve):
    backend = ScriptedBackend()
    client, _ = serve(backend)
    out = client.completions.create(model=MODEL, prompt="Say hi", max_tokens=10)
    assert out.choices[0].text == "Hello, world!"
    assert out.choices[0].finish_reason == "stop"
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (6, 4, 10)
    call = backend.wait_closed()
    assert call.prompt_ids == [ord(c) for c in "Say hi"] and call.params.max_tokens == 10
    assert call.finished and not call.cancelled


def test_completion_streaming_chunks_concatenate_to_the_text(serve):
    client, _ = serve(ScriptedBackend())
    stream = client.completions.create(
        model=MODEL, prompt=["Say hi"], max_tokens=10, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert texts == ["Hello", ",", " world", "!", ""]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert all(c.usage is None for c in chunks[:-1])


def test_logprobs_in_the_completions_and_chat_shapes_streamed_or_not(serve):
    """#31: what the backend reports per token, in OpenAI's legacy completions shape (the chosen
    token's text, logprob, a dict of alternatives and text offsets counted over token texts, the
    offsets going on across stream chunks) and in the chat shape (bytes, exactly k alternatives)."""
    backend = ScriptedBackend()
    client, _ = serve(backend)
    texts = [chr(1000 + i) for i in range(4)]  # the fake tokenizer's texts of ids 1000..1003 (2 UTF-8 bytes each)
    out = client.completions.create(model=MODEL, prompt="hi", max_tokens=10, logprobs=2)
    lp = out.choices[0].logprobs
    assert backend.calls[-1].params.logprobs == 2
    assert lp.tokens == texts and lp.text_offset == [0, 1, 2, 3]
    assert lp.token_logprobs == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    assert lp.top_logprobs[1] == pytest.approx({texts[1]: -0.2, chr(2001): -0.7})
    chunks = list(client.completions.create(model=MODEL, prompt="hi", max_tokens=10, logprobs=0, stream=True))
    scored = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for s in scored for t in s.tokens] == texts
    assert [o for s in scored for o in s.text_offset] == [0, 1, 2, 3]
    assert [list(t) for s in scored for t in s.top_logprobs] == [[t] for t in texts]  # k=0: the chosen token only

    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == texts and all(c.bytes == list(t.encode()) for c, t in zip(content, texts))
    assert [[a.token for a in c.top_logprobs] for c in content][0] == [texts[0], chr(2001), chr(2002)]
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], logprobs=False)
    assert plain.choices[0].logprobs is None and backend.calls[-1].params.logprobs is None
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], top_logprobs=1)


def test_echo_repeats_the_prompt_with_its_logprobs_as_lm_eval_asks(serve):
    """#31 echo: the prompt's text before the completion; with logprobs, the prompt's tokens
    first (the very first with null logprob and alternatives), then the generated ones — what
    lm-evaluation-harness's loglikelihood requests (echo, logprobs 1, max_tokens 1) read."""
    backend = ScriptedBackend(pieces=("!",))
    client, _ = serve(backend)
    plain = client.completions.create(model=MODEL, prompt="Hey", max_tokens=1, echo=True)
    assert plain.choices[0].text == "Hey!" and plain.choices[0].logprobs is None
    assert backend.calls[-1].params.prompt_logprobs is None
    scored = client.completions.create(model=MODEL, prompt="Hey", max_tokens=1, echo=True, logprobs=1)
    assert backend.calls[-1].params.prompt_logprobs == 1
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text == "Hey!"
    assert lp.tokens == ["H", "e", "y", chr(1000)] and lp.text_offset == [0, 1, 2, 3]
    assert lp.token_logprobs == [None, -1.0, -2.0, pytest.approx(-0.1)]
    assert lp.top_logprobs[0] is None and lp.top_logprobs[2] == {"y": -2.0, chr(3002): -0.5}
    ids = client.completions.create(model=MODEL, prompt=[72, 105], max_tokens=1, echo=True)
    assert ids.choices[0].text == "Hi!"  # token-id prompts are echoed decoded
    chunks = list(
        client.completions.create(model=MODEL, prompt="Hey", max_tokens=1, echo=True, logprobs=0, stream=True)
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert texts[0] == "Hey" and "".join(texts) == "Hey!"
    first = next(c.choices[0].logprobs for c in chunks if c.choices)
    assert first.tokens == ["H", "e", "y"] and first.token_logprobs == [None, -1.0, -2.0]


def test_system_fingerprint_names_the_server_and_model_revision_on_every_body(serve):
    """#31: OpenAI's system_fingerprint, the same on every response and chunk of one server, and
    another for another model revision (what a seeded request's determinism depends on)."""
    from pdserve_worker.api.response_format import system_fingerprint

    backend = ScriptedBackend()
    client, _ = serve(backend)
    whole = client.completions.create(model=MODEL, prompt="hi", max_tokens=3)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True)
    prints = {whole.system_fingerprint} | {c.system_fingerprint for c in chat}
    assert prints == {system_fingerprint(MODEL, "")} and prints.pop().startswith("fp_")
    assert system_fingerprint(MODEL, "rev-a") != system_fingerprint(MODEL, "rev-b") != system_fingerprint(MODEL, "")


def test_prompt_logprobs_in_vllms_shape_on_both_endpoints_and_never_streamed(serve):
    """#31: vLLM's prompt_logprobs — None for the first prompt token, then {token id: {logprob,
    rank, decoded_token}} with the prompt's token and the alternatives (ranks 1..k), on the
    choice for completions and on the response for chat (vllm/entrypoints/openai/completion/
    protocol.py CompletionResponseChoice, chat_completion/protocol.py ChatCompletionResponse).
    A stream cannot carry them: 400, as vLLM answers."""
    backend = ScriptedBackend()
    _, url = serve(backend)
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 2, "prompt_logprobs": 1}
    choice = httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]
    assert choice["logprobs"] is None  # (no generated-token logprobs were asked)
    assert choice["prompt_logprobs"] == [
        None,
        {
            "98": {"logprob": -1.0, "rank": 2, "decoded_token": "b"},
            "3001": {"logprob": -0.5, "rank": 1, "decoded_token": chr(3001)},
        },
        {
            "99": {"logprob": -2.0, "rank": 3, "decoded_token": "c"},
            "3002": {"logprob": -0.5, "rank": 1, "decoded_token": chr(3002)},
        },
    ]
    assert backend.calls[-1].params.prompt_logprobs == 1
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_logprobs": 0}
    reply = httpx.post(f"{url}/v1/chat/completions", json=chat).json()
    prompt = backend.calls[-1].prompt_ids
    assert len(reply["prompt_logprobs"]) == len(prompt) and reply["prompt_logprobs"][0] is None
    assert reply["prompt_logprobs"][1] == {
        str(prompt[1]): {"logprob": -1.0, "rank": 2, "decoded_token": chr(prompt[1])}
    }
    streamed = httpx.post(f"{url}/v1/completions", json={**body, "stream": True})
    assert streamed.status_code == 400 and "prompt_logprobs" in streamed.json()["error"]["message"]


def test_echo_logprobs_too_large_for_the_prefills_reply_are_a_clear_400(serve, monkeypatch):
    """The prefill returns an echo's prompt logprobs in one gRPC reply: a prompt whose logprobs
    would not fit (here made small: 10 tokens at 20 alternatives) is refused before it runs,
    naming what fits; fewer alternatives fit more."""
    from pdserve_common.channels import WORKER_MAX_MESSAGE
    from pdserve_worker.api import intake

    monkeypatch.setattr(intake, "PROMPT_LOGPROB_BYTES", WORKER_MAX_MESSAGE // 2 // (21 * 10))
    backend = ScriptedBackend()
    client, _ = serve(backend)
    prompt = "abcdefghijklmnopqrst"  # 20 tokens with the fake tokenizer
    with pytest.raises(openai.BadRequestError, match="at most 10 tokens, got 20"):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, echo=True, logprobs=20)
    assert not backend.calls
    ok = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, echo=True, logprobs=0)
    assert len(ok.choices[0].logprobs.tokens) == 21


def test_several_prompts_get_one_choice_each_streamed_or_not(serve):
    """#31: a list of prompts (strings or token ids) as vLLM serves it: each prompt a request of
    its own, all at once, one choice per prompt in order, the usage summed; streamed, the chunks
    interleave with each choice's index, one usage chunk and one [DONE] at the end."""
    backend = ScriptedBackend(delay_s=0.01)
    client, url = serve(backend)
    out = client.completions.create(model=MODEL, prompt=["ab", "cde", "f"], max_tokens=10)
    assert [c.index for c in out.choices] == [0, 1, 2] and {c.text for c in out.choices} == {"Hello, world!"}
    assert sorted(c.prompt_ids for c in backend.calls) == [[97, 98], [99, 100, 101], [102]]
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (6, 12)
    assert all(c.closed for c in backend.calls)
    ids = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": [[104, 105], [106]], "max_tokens": 2})
    assert ids.status_code == 200 and [c["index"] for c in ids.json()["choices"]] == [0, 1]

    stream = client.completions.create(
        model=MODEL, prompt=["ab", "cde"], max_tokens=10, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    texts: dict[int, str] = {}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {0: "Hello, world!", 1: "Hello, world!"}
    assert [c.usage.completion_tokens for c in chunks if c.usage] == [8] and not chunks[-1].choices
    finishes = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
    assert finishes == ["stop", "stop"] and len({c.id for c in chunks}) == 1  # one request, one id


def test_n_choices_are_copies_of_the_request_with_seed_plus_index_and_the_prompt_counted_once(serve):
    """#31 item 2: n > 1 on both endpoints. Each choice is a request of its own; with a seed,
    choice i samples with seed + i, as vLLM's parallel sampling does
    (vllm/v1/engine/parallel_sampling.py, ParentRequest.get_child_sampling_params); usage
    counts each prompt once and every completion; with a list of prompts the choices are
    prompt-major (index = prompt × n + i)."""
    backend = ScriptedBackend(delay_s=0.005)
    client, _ = serve(backend)
    out = client.completions.create(model=MODEL, prompt="ab", max_tokens=10, n=3, seed=7)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert sorted(c.params.seed for c in backend.calls) == [7, 8, 9]
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (2, 12, 14)
    assert all(c.closed for c in backend.calls)

    backend.calls.clear()
    both = client.completions.create(model=MODEL, prompt=["ab", "cde"], max_tokens=10, n=2)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.prompt_ids for c in backend.calls].count([97, 98]) == 2 and len(backend.calls) == 4
    assert both.usage.prompt_tokens == 5 and both.usage.completion_tokens == 16

    backend.calls.clear()
    top = 2**63 - 1
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], n=2, seed=top, max_tokens=10
    )
    assert [c.index for c in chat.choices] == [0, 1] and {c.message.content for c in chat.choices} == {"Hello, world!"}
    assert sorted(c.params.seed for c in backend.calls) == [-(2**63), top]  # seed + 1 wraps to int64
    assert chat.usage.prompt_tokens == len(backend.calls[0].prompt_ids)

    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        n=2,
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    texts: dict[int, str] = {}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    assert texts == {0: "Hello, world!", 1: "Hello, world!"}
    usage = [c.usage for c in chunks if c.usage]
    assert len(usage) == 1 and usage[0].completion_tokens == 8
    assert usage[0].prompt_tokens == len(backend.calls[-1].prompt_ids)  # once, not twice


def test_one_prompt_of_several_refused_refuses_the_request_and_frees_the_others(serve):
    backend = ScriptedBackend(first_delay_s=0.2)
    client, _ = serve(backend)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match="maximum context length"):
            client.completions.create(model=MODEL, prompt=["ok", "x" * 80], max_tokens=4, stream=stream)
    assert backend.calls and all(backend.wait_closed(i).closed for i in range(len(backend.calls)))


def test_stop_token_ids_reach_the_engine_once_each(serve):
    backend = ScriptedBackend()
    client, _ = serve(backend)
    client.completions.create(model=MODEL, prompt="hi", max_tokens=3, extra_body={"stop_token_ids": [7, 9, 7]})
    assert backend.calls[-1].params.stop_token_ids == (7, 9)
    with pytest.raises(openai.BadRequestError, match="stop_token_ids"):
        client.completions.create(model=MODEL, prompt="hi", extra_body={"stop_token_ids": list(range(65))})


def test_bad_words_reach_the_engine_as_token_sequences_and_unenforceable_ones_are_400(serve):
    backend = ScriptedBackend()
    client, _ = serve(backend)
    client.completions.create(model=MODEL, prompt="hi", max_tokens=3, extra_body={"bad_words": ["ab", " ab", "c"]})
    # The fake tokenizer spells characters: "ab" and " ab" strip to one word; " ab" is longer, so not kept.
    assert backend.calls[-1].params.bad_words == ((97, 98), (99,))
    for words, match in (([" "], "no token"), (["x"] * 129, "bad_words")):
        with pytest.raises(openai.BadRequestError, match=match):
            client.completions.create(model=MODEL, prompt="hi", extra_body={"bad_words": words})


def test_chat_non_streaming_and_streaming(serve):
    backend = ScriptedBackend()
    client, _ = serve(backend)
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=8, temperature=0)
    assert out.choices[0].message.content == "Hello, world!" and out.choices[0].message.role == "assistant"
    prompt = "<system>be brief<user>hi<assistant>"
    assert out.usage.prompt_tokens == len(prompt) and out.usage.completion_tokens == 4
    assert backend.chats[0] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert backend.calls[0].params.max_tokens == 8 and backend.calls[0].params.greedy

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello, world!"
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].object == "chat.completion.chunk"
    # Chat without max_tokens may fill the context: 64 - prompt length.
    assert backend.calls[1].params.max_tokens == 64 - len(prompt)


def test_stream_is_exact_openai_sse_ending_with_done(serve):
    _, url = serve(ScriptedBackend(pieces=["a", "b"]))
    with httpx.stream("POST", f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: {") for e in events[:-2])


def test_max_tokens_cuts_with_length_even_if_backend_overruns(serve):
    backend = ScriptedBackend(pieces=["a", "b", "c", "d"], honour_max_tokens=False)
    client, _ = serve(backend)
    out = client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert out.choices[0].text == "ab" and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 2


def test_request_info_reaches_the_response_and_the_metrics(serve):
    info = RequestInfo(disaggregated=True, kv_bytes=3 * 1024 * 1024, kv_transfer_s=0.004, prefill="p0", decode="d1")
    client, url = serve(ScriptedBackend(info=info))
    # Without the debug header the workers stay unnamed (internal topology, #29).
    assert client.completions.create(model=MODEL, prompt="x").model_extra["pdserve"] == {
        "disaggregated": True,
        "kv_bytes": 3 * 1024 * 1024,
        "kv_transfer_ms": 4.0,
    }
    client = client.with_options(default_headers={"x-pdserve-debug": "workers"})
    out = client.completions.create(model=MODEL, prompt="x")
    assert out.model_extra["pdserve"] == {
        "disaggregated": True,
        "kv_bytes": 3 * 1024 * 1024,
        "kv_transfer_ms": 4.0,
        "prefill": "p0",
        "decode": "d1",
    }
    chunks = list(client.completions.create(model=MODEL, prompt="x", stream=True))
    assert chunks[-1].model_extra["pdserve"]["decode"] == "d1"
    m = samples(url)
    assert m[("pdserve_router_requests_completed_total", (("mode", "disaggregated"),))] == 3
    assert m[("pdserve_router_kv_transfer_bytes_sum", ())] == 3 * 3 * 1024 * 1024
    assert m[("pdserve_router_kv_transfer_seconds_count", ())] == 3


def test_with_keys_only_a_key_allowed_to_debug_gets_the_workers_names(port):
    from pdserve_worker.api.keys import KeyStore

    allowed, plain = "sk-debug-0123456789abcdef", "sk-plain-0123456789abcdef"
    keys = KeyStore.parse(
        f'tenants:\n  - name: ops\n    keys: ["{allowed}"]\n    debug: true\n  - name: user\n    keys: ["{plain}"]\n'
    )
    info = RequestInfo(disaggregated=True, kv_bytes=1, kv_transfer_s=0.001, prefill="p0", decode="d1")
    with running_router(create_app(ScriptedBackend(info=info), keys=keys), port) as url:
        for key, named in ((allowed, True), (plain, False)):
            client = openai.OpenAI(
                base_url=f"{url}/v1", api_key=key, max_retries=0, default_headers={"x-pdserve-debug": "workers"}
            )
            extension = client.completions.create(model=MODEL, prompt="x").model_extra["pdserve"]
            assert ("prefill" in extension and "decode" in extension) is named, (key, extension)


# --- stop strings ----------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_go_to_the_backend_and_its_answer_comes_back_as_it_is(serve, stream):
    """The engine decides where a stop string ends the answer (model.sampling.sampler.StopStringMatcher):
    the router hands the stops over and passes the text through, it cuts nothing itself."""
    backend = ScriptedBackend(pieces=["The answer", " is 4", "2.\n"], finish="stop")  # cut before "User:"
    client, _ = serve(backend)
    kwargs = dict(model=MODEL, prompt="q", max_tokens=20, stop=["User:", "never"])
    if stream:
        chunks = list(client.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].text for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        out = client.completions.create(**kwargs)
        text, finish = out.choices[0].text, out.choices[0].finish_reason
    assert text == "The answer is 42.\n" and finish == "stop"
    call = backend.wait_closed()
    assert call.params.stop == ("User:", "never") and not call.cancelled


def test_a_single_stop_string_in_chat_reaches_the_backend(serve):
    backend = ScriptedBackend(pieces=["Hell"], finish="stop")
    client, _ = serve(backend)
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], stop="o, w")
    assert out.choices[0].message.content == "Hell" and out.choices[0].finish_reason == "stop"
    assert backend.wait_closed().params.stop == ("o, w",)


# --- bad input -------------------------------------------------------------------------------

CASES = [
    # (body or raw bytes, status, words the message must contain, param)
    (b'{"model": "fake-model", "prompt": ', 400, ["not valid JSON"], None),
    ({"prompt": "hi"}, 400, ["missing", "model"], "model"),
    ({"model": MODEL}, 400, ["missing", "prompt"], "prompt"),
    ({"model": "gpt-9", "prompt": "hi"}, 404, ["gpt-9", "does not exist"], "model"),
    (
        {"model": MODEL, "prompt": "hi", "max_tokens": 0},
        400,
        ["max_tokens", "greater than or equal to 1", "0"],
        "max_tokens",
    ),
    ({"model": MODEL, "prompt": "hi", "max_tokens": -3}, 400, ["max_tokens", "-3"], "max_tokens"),
    ({"model": MODEL, "prompt": "x" * 80}, 400, ["80 tokens", "maximum context length is 64"], "prompt"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 63}, 400, ["2 tokens", "63", "64", "at most 62"], "max_tokens"),
    ({"model": MODEL, "prompt": 42}, 400, ["prompt", "valid string", "42"], "prompt"),
    ({"model": MODEL, "prompt": ["a"] * 65}, 400, ["at most 64 prompts", "got 65"], "prompt"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": "5"}, 400, ["max_tokens", "valid integer"], "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "temperature": True}, 400, ["temperature", "number"], "temperature"),
    ({"model": MODEL, "prompt": "hi", "temperature": 7}, 400, ["temperature", "2"], "temperature"),
    ({"model": MODEL, "prompt": "hi", "n": 65}, 400, ["n", "less than or equal to 64"], "n"),
    ({"model": MODEL, "prompt": "hi", "n": 0}, 400, ["n", "greater than or equal to 1"], "n"),
    ({"model": MODEL, "prompt": ["a", "b", "c"], "n": 22}, 400, ["prompts × n", "66", "3 prompt(s) × n=22"], None),
    ({"model": MODEL, "prompt": "hi", "stop": ""}, 400, ["stop"], "stop"),
    (b'{"model": "fake-model", "prompt": "\\ud800"}', 400, ["lone surrogate"], "prompt"),
    ({"model": MODEL, "prompt": ""}, 400, ["empty"], "prompt"),
    ({"model": MODEL, "prompt": "hi", "logprobs": 21}, 400, ["logprobs"], "logprobs"),
]


@pytest.mark.parametrize("body,status,words,param", CASES, ids=[str(i) for i in range(len(CASES))])
def test_bad_completion_requests_get_openai_errors_and_service_goes_on(serve, body, status, words, param):
    client, url = serve(ScriptedBackend())
    if isinstance(body, bytes):
        r = httpx.post(f"{url}/v1/completions", content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(f"{url}/v1/completions", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for word in words:
        assert word in error["message"], (word, error)
    assert error["param"] == param
    assert client.completions.create(model=MODEL, prompt="ok").choices[0].text == "Hello, world!"


@pytest.mark.parametrize(
    "body,words",
    [
        ({"model": MODEL, "messages": []}, ["messages", "at least 1"]),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, ["messages.0.role"]),
        ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, ["only text content"]),
        ({"model": MODEL, "messages": [{"role": "assistant", "content": "x"}]}, ["must end with a user message"]),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
            ["max_completion_tokens"],
        ),
    ],
)
def test_bad_chat_requests_are_400(serve, body, words):
    client, url = serve(ScriptedBackend())
    r = httpx.post(f"{url}/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    for word in words:
        assert word in r.json()["error"]["message"]


def test_unknown_route_and_method_use_the_error_envelope(serve):
    _, url = serve(ScriptedBackend())
    assert httpx.get(f"{url}/v2/nothing").json()["error"]["message"] == "Not Found: GET /v2/nothing"
    assert httpx.get(f"{url}/v1/completions").status_code == 405


# --- backend failures ------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_no_capacity_is_429_with_retry_after(serve, stream):
    client, url = serve(ScriptedBackend(error=NoCapacity(2.5, "all 8 decode slots are busy")))
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "stream": stream})
    assert r.status_code == 429
    assert r.headers["retry-after"] == "3" and r.headers["retry-after-ms"] == "2500"
    message = r.json()["error"]["message"]
    assert message.startswith("the service has no free capacity now") and "decode" not in message
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=MODEL, prompt="x")


@pytest.mark.parametrize(
    "error,status",
    [(BackendUnavailable("no decode registered"), 503), (RequestTimeout("kv transfer timed out after 5 s"), 504)],
)
def test_unavailable_and_timeout_map_to_503_and_504(serve, error, status):
    _, url = serve(ScriptedBackend(error=error))
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
    message = r.json()["error"]["message"]
    # The backend's own words (worker names, gRPC details) stay in the log; the client gets the
    # kind of failure and the request id that finds them there.
    assert r.status_code == status and str(error) not in message
    assert message.endswith(f"(request {r.headers['x-request-id']})")
    assert (
        samples(url)[
            ("pdserve_router_requests_failed_total", (("reason", "unavailable" if status == 503 else "timeout"),))
        ]
        == 1
    )


def test_error_after_the_stream_started_is_reported_in_band(serve):
    client, _ = serve(ScriptedBackend(error=BackendUnavailable("decode d0 went away"), error_after=2))
    stream = client.completions.create(model=MODEL, prompt="x", stream=True)
    got = []
    with pytest.raises(openai.APIError, match=r"temporarily unavailable \(request cmpl-[0-9a-f]{32}\)"):
        for chunk in stream:
            got.append(chunk.choices[0].text)
    assert got == ["Hello", ","]


# --- cancellation ----------------------------------------------------------------------------


def test_client_disconnect_mid_stream_closes_the_backend_generator(serve):
    backend = ScriptedBackend(pieces=[f"t{i} " for i in range(200)], delay_s=0.02)
    client, url = serve(backend)
    stream = client.completions.create(model=MODEL, prompt="x", max_tokens=60, stream=True)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    call = backend.wait_closed()
    assert call.cancelled and call.tokens_sent < 60
    deadline = time.monotonic() + 5
    while samples(url).get(("pdserve_router_requests_failed_total", (("reason", "cancelled"),))) != 1:
        assert time.monotonic() < deadline, "the disconnect was not counted as a cancelled request"
        time.sleep(0.02)


@pytest.mark.parametrize("stream,first_delay_s", [(False, 0.0), (True, 30.0)])
def test_client_disconnect_before_the_answer_starts_closes_the_backend(serve, stream, first_delay_s):
    """Non-streamed: the client leaves while tokens are being collected. Streamed: it leaves
    before the first token, when no byte has been sent yet (a prefill that takes long)."""
    backend = ScriptedBackend(pieces=["a"] * 50, delay_s=0.05, first_delay_s=first_delay_s)
    _, url = serve(backend)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 50, "stream": stream}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, timeout=0.3)
    call = backend.wait_closed()
    assert call.cancelled and call.tokens_sent < 50


# --- metrics ---------------------------------------------------------------------------------


def test_metrics_histograms_move_and_slot_gauges_follow_the_backend(serve):
    metrics = RouterMetrics()
    client, url = serve(ScriptedBackend(delay_s=0.01), metrics)
    before = samples(url)
    assert before[("pdserve_router_time_to_first_token_seconds_count", ())] == 0
    client.completions.create(model=MODEL, prompt="abc")
    list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True))
    httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 0})
    metrics.set_decode_slots("decode-0", used=3, free=5)
    metrics.set_decode_slots("decode-1", used=0, free=8)
    metrics.forget_decode("decode-1")
    after = samples(url)
    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert after[(f"pdserve_router_{name}_count", ())] == 2, name
        assert after[(f"pdserve_router_{name}_sum", ())] > 0, name
    # Four tokens 10 ms apart: the mean inter-token time is at least 10 ms per request.
    assert after[("pdserve_router_time_per_output_token_seconds_sum", ())] >= 2 * 0.01
    assert after[("pdserve_router_generation_tokens_total", ())] == 8
    assert after[("pdserve_router_prompt_tokens_total", ())] == 3 + len("<user>x<assistant>")
    assert after[("pdserve_router_requests_completed_total", (("mode", "colocated"),))] == 2
    assert after[("pdserve_router_requests_rejected_total", (("status", "400"),))] == 1
    assert after[("pdserve_router_decode_slots_used", (("decode", "decode-0"),))] == 3
    assert after[("pdserve_router_decode_slots_free", (("decode", "decode-0"),))] == 5
    assert ("pdserve_router_decode_slots_free", (("decode", "decode-1"),)) not in after


def test_models_and_health(serve):
    client, url = serve(ScriptedBackend())
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(f"{url}/health").json() == {"status": "ok", "model": MODEL}


def test_the_models_sampling_defaults_fill_only_what_a_request_leaves_unset(port):
    """generation_config's temperature/top_p/top_k (GenerationDefaults.sampling_defaults) are the
    defaults, as in transformers' generate and vLLM; a value the request sends wins."""
    backend = ScriptedBackend()
    defaults = {"temperature": 0.6, "top_p": 0.8, "top_k": 20}
    with running_router(create_app(backend, sampling_defaults=defaults), port) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10)
        client.completions.create(model=MODEL, prompt="Say hi", max_tokens=5)
        unset = backend.wait_closed().params
        client.completions.create(model=MODEL, prompt="Say hi", max_tokens=5, temperature=0.0, top_p=1.0)
        sent = backend.wait_closed().params
    assert (unset.temperature, unset.top_p, unset.top_k) == (0.6, 0.8, 20)
    assert (sent.temperature, sent.top_p, sent.top_k) == (0.0, 1.0, 20)


def test_without_model_defaults_a_request_gets_openais(serve):
    backend = ScriptedBackend()
    client, _ = serve(backend)
    client.completions.create(model=MODEL, prompt="Say hi", max_tokens=5)
    params = backend.wait_closed().params
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 1.0, 0)


def test_later_copies_of_a_prompt_start_once_the_first_has_its_first_token(serve):
    """api/prompt_copies.py: on a backend whose prefills cache prefixes, copy 0 of each prompt
    goes first and the others start after its first token; elsewhere all copies start at once.
    Judged by the order of events, not by the clock."""

    class Ordered(ScriptedBackend):
        def __init__(self) -> None:
            super().__init__(first_delay_s=0.2, delay_s=0.001)
            self.shares_prompt_prefill = True
            self.events: list[tuple[str, tuple[int, ...], int | None]] = []

        def generate(self, prompt_ids, params, request_id, *, cache_scope):
            key = (tuple(prompt_ids), params.seed)
            self.events.append(("start", *key))
            inner = super().generate(prompt_ids, params, request_id, cache_scope=cache_scope)

            async def noted():
                async for i, event in _enumerate(inner):
                    if i == 0:
                        self.events.append(("first", *key))
                    yield event

            return noted()

    async def _enumerate(it):
        i = 0
        async for item in it:
            yield i, item
            i += 1

    backend = Ordered()
    client, _ = serve(backend)
    for shares, stream in ((True, False), (True, True), (False, False)):
        backend.shares_prompt_prefill, backend.events = shares, []
        out = client.completions.create(model=MODEL, prompt=["ab", "cd"], max_tokens=4, n=3, seed=5, stream=stream)
        if stream:
            assert len({ch.index for chunk in out for ch in chunk.choices}) == 6
        else:
            assert [c.index for c in out.choices] == list(range(6))
        order = [(kind, prompt, seed) for kind, prompt, seed in backend.events]
        starts = [e for e in order if e[0] == "start"]
        assert len(starts) == 6
        for _, prompt, seed in starts:
            if seed == 5:  # copy 0 of its prompt
                continue
            leader_first = order.index(("first", prompt, 5))
            follower_start = order.index(("start", prompt, seed))
            if shares:
                assert leader_first < follower_start, order  # after its prompt's first copy had a token
            else:
                assert follower_start < leader_first, order  # all at once (each waits 0.2 s for a token)
