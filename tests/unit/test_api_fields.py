"""The OpenAI request fields (api/api_fields.py, issue #31 item 6): every field the table
refuses is a 400 naming it when it asks for something, and passes with its neutral value;
every accepted field passes; a field outside both schemas passes. Also token-id prompts and
vLLM's /tokenize and /detokenize (item 7)."""

from __future__ import annotations

import httpx
import pytest

from pdserve_worker.api import api_fields
from pdserve_worker.api.app import create_app
from pdserve_worker.api.keys import KeyStore
from support.router_fakes import ScriptedBackend, running_router

MODEL = "fake-model"
# A value that asks for something, for every refused field (a new refused field needs one here).
ASKING = {
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "logit_bias": {"5": 10},
    "min_tokens": 40,
    "min_p": 0.1,
    "repetition_penalty": 1.5,
    "stop_token_ids": [7],
    "guided_json": {"type": "object"},
    "guided_regex": "a+",
    "guided_choice": ["a", "b"],
    "guided_grammar": "root ::= 'a'",
    "structured_outputs": {"json": {}},
    "truncate_prompt_tokens": 10,
    "echo": True,
    "logprobs": 2,
    "best_of": 2,
    "suffix": "end",
    "top_logprobs": 3,
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "tool_choice": "required",
    "functions": [{"name": "f"}],
    "function_call": {"name": "f"},
    "response_format": {"type": "json_object"},
    "modalities": ["text", "audio"],
    "audio": {"voice": "alloy"},
    "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "high",
    "verbosity": "low",
    "web_search_options": {},  # falsy: neutral; replaced below by a real ask
    "chat_template_kwargs": {"enable_thinking": True},
    "add_generation_prompt": False,
    "continue_final_message": True,
}
ASKING["web_search_options"] = {"search_context_size": "low"}
ACCEPTED = {
    "user": "u-1",
    "prompt_logprobs": 1,
    "bad_words": ["x"],
    "include_stop_str_in_output": True,
    "skip_special_tokens": False,
    "n": 2,
    "parallel_tool_calls": True,
    "metadata": {"k": "v"},
    "store": True,
    "service_tier": "auto",
    "prompt_cache_key": "k",
    "safety_identifier": "s",
}


def base(endpoint: str) -> dict:
    if endpoint == "/v1/completions":
        return {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def cases(status: str):
    for endpoint, table in api_fields.TABLES.items():
        for f in table:
            if f.status == status:
                yield endpoint, f


@pytest.fixture
def url(port):
    with running_router(create_app(ScriptedBackend()), port) as u:
        yield u


def test_every_refused_field_has_a_sample_and_the_table_has_no_duplicates():
    for endpoint, table in api_fields.TABLES.items():
        names = [f.name for f in table]
        assert len(names) == len(set(names)), endpoint
    assert {f.name for _, f in cases("refused")} <= set(ASKING)
    assert {f.name for _, f in cases("accepted")} <= set(ACCEPTED)


def test_refused_fields_are_400s_naming_them_and_their_neutral_values_pass(url):
    with httpx.Client(timeout=10) as http:
        for endpoint, f in cases("refused"):
            r = http.post(f"{url}{endpoint}", json={**base(endpoint), f.name: ASKING[f.name]})
            assert r.status_code == 400, (endpoint, f.name, r.text)
            error = r.json()["error"]
            assert f.name in error["message"], (f.name, error)
            assert error["param"] == f.name and error["code"] == "unsupported_parameter", (f.name, error)
            assert f.neutral(None)
            assert http.post(f"{url}{endpoint}", json={**base(endpoint), f.name: None}).status_code == 200, f.name


def test_accepted_fields_and_unknown_ones_pass(url):
    with httpx.Client(timeout=10) as http:
        for endpoint, f in cases("accepted"):
            r = http.post(f"{url}{endpoint}", json={**base(endpoint), f.name: ACCEPTED[f.name]})
            assert r.status_code == 200, (endpoint, f.name, r.text)
        for endpoint in api_fields.TABLES:
            r = http.post(f"{url}{endpoint}", json={**base(endpoint), "a_field_from_2030": {"x": 1}})
            assert r.status_code == 200, r.text
        chat = base("/v1/chat/completions")
        for neutral in ({"response_format": {"type": "text"}}, {"tool_choice": "none"}, {"modalities": ["text"]}):
            assert http.post(f"{url}/v1/chat/completions", json={**chat, **neutral}).status_code == 200, neutral


def test_a_prompt_of_token_ids_is_served_as_those_ids(port):
    backend = ScriptedBackend()
    backend.vocab_size = 1000  # type: ignore[attr-defined]
    with running_router(create_app(backend), port) as url, httpx.Client(timeout=10) as http:
        for prompt in ([5, 6, 7], [[8, 9]]):
            r = http.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == (3 if prompt == [5, 6, 7] else 2)
        refused = [
            ([5, 1000], "out of the vocabulary"),
            ([[1], [2, 1000]], "out of the vocabulary"),
            ([-1], "prompt"),  # a negative id: a 400 on prompt (pydantic reports the union's first branch)
            ([], "prompt"),
        ]
        for prompt, words in refused:
            r = http.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
            assert r.status_code == 400 and words in r.json()["error"]["message"], (prompt, r.text)
    # (a refused prompt of a list may find its sibling started: cancelled, its generator closed)
    assert [c.prompt_ids for c in backend.calls][:2] == [[5, 6, 7], [8, 9]]
    assert all(c.prompt_ids == [1] and c.closed for c in backend.calls[2:])


def test_tokenize_and_detokenize_in_vllms_shape_behind_the_keys(port):
    key = "sk-tokenize-0123456789abcdef"
    keys = KeyStore.parse(f'tenants:\n  - name: t\n    keys: ["{key}"]\n')
    with running_router(create_app(ScriptedBackend(), keys=keys), port) as url, httpx.Client(timeout=10) as http:
        auth = {"Authorization": f"Bearer {key}"}
        assert http.post(f"{url}/tokenize", json={"model": MODEL, "prompt": "hi"}).status_code == 401
        r = http.post(f"{url}/tokenize", json={"model": MODEL, "prompt": "hi"}, headers=auth)
        assert r.json() == {"count": 2, "max_model_len": 64, "tokens": [ord("h"), ord("i")]}
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "yo"}]}
        r = http.post(f"{url}/tokenize", json=chat, headers=auth)
        assert r.json()["tokens"] == [ord(c) for c in "<user>yo<assistant>"]
        assert http.post(f"{url}/tokenize", json={"model": MODEL}, headers=auth).status_code == 400
        assert http.post(f"{url}/tokenize", json={"model": "other", "prompt": "x"}, headers=auth).status_code == 404
        r = http.post(f"{url}/detokenize", json={"model": MODEL, "tokens": [104, 105]}, headers=auth)
        assert r.json() == {"prompt": "hi"}


def test_more_ids_than_a_context_are_refused_before_they_are_scanned(port):
    backend = ScriptedBackend(max_model_len=64)
    with running_router(create_app(backend), port) as url, httpx.Client(timeout=10) as http:
        r = http.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": list(range(65)), "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        r = http.post(f"{url}/detokenize", json={"model": MODEL, "tokens": [104] * 65})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
        r = http.post(f"{url}/detokenize", json={"model": MODEL, "tokens": [104] * 64})
        assert r.json() == {"prompt": "h" * 64}
    assert backend.calls == []


def test_a_long_detokenize_runs_off_the_event_loop(port):
    with running_router(create_app(ScriptedBackend(max_model_len=1024)), port) as url:
        r = httpx.post(f"{url}/detokenize", json={"model": MODEL, "tokens": [105] * 600}, timeout=10)
    assert r.json() == {"prompt": "i" * 600}
