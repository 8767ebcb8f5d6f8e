"""Property: no request body, however odd, makes the router answer 5xx; every error it gives
is OpenAI's envelope, and every success is a well-formed answer. Runs the ASGI app in-process
(starlette's TestClient) for speed."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve_worker.api.app import create_app
from support.router_fakes import ScriptedBackend

MODEL = ScriptedBackend.model_name

scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
# Plausible values per field, mixed with anything at all, so both the happy path and every
# validator get exercised.
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "bot"]) | json_values},
    optional={
        "content": st.text(max_size=10)
        | st.lists(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["text", "image_url"])}, optional={"text": st.text(max_size=5)}
            ),
            max_size=2,
        )
        | json_values
    },
)
fields = {
    "model": st.just(MODEL) | json_values,
    "max_tokens": st.integers(-2, 80) | json_values,
    "max_completion_tokens": st.integers(-2, 80) | json_values,
    "temperature": st.floats(-1, 3) | json_values,
    "top_p": st.floats(-0.5, 1.5) | json_values,
    "top_k": st.integers(-3, 5) | json_values,
    "seed": st.integers(-(2**65), 2**65) | json_values,
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=20) | json_values,
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}) | json_values,
    "n": st.integers(0, 3) | json_values,
    "ignore_eos": st.booleans() | json_values,
}
completion_bodies = st.fixed_dictionaries(
    {},
    optional={
        **fields,
        "prompt": st.text(max_size=70) | st.lists(st.text(max_size=5), max_size=2) | json_values,
        "echo": st.booleans(),
        "logprobs": st.none() | st.integers(0, 2),
    },
)
chat_bodies = st.fixed_dictionaries(
    {}, optional={**fields, "messages": st.lists(message, max_size=3) | json_values, "logprobs": st.booleans()}
)
# JSON.dumps writes NaN/Infinity, which Python's parser (and so the server's) accepts.
payloads = (
    completion_bodies.map(json.dumps) | json_values.map(json.dumps) | st.binary(max_size=40) | st.text(max_size=40)
)


@pytest.fixture(scope="module")
def client():
    with TestClient(create_app(ScriptedBackend()), raise_server_exceptions=False) as c:
        yield c


def echoed_prompt(payload: object) -> str | None:
    """The text a success's first choice starts with: "" without `echo`, the first prompt with it,
    None where that prompt is not text (token ids come back decoded)."""
    try:
        body = json.loads(payload) if isinstance(payload, (str, bytes)) else None
    except ValueError:
        return ""
    if not isinstance(body, dict) or body.get("echo") is not True:
        return ""
    prompt = body.get("prompt")
    first = prompt[0] if isinstance(prompt, list) and prompt else prompt
    return first if isinstance(first, str) else None


def check(response, chat: bool, echo: str | None = "") -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"]
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.endswith("data: [DONE]\n\n")
        return
    body = response.json()
    choice = body["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    if echo is None:  # echoed token ids: only the shape of the answer is checked
        echo = text = ""
    assert text.startswith(echo)
    text = text[len(echo) :]
    assert "Hello, world!".startswith(text) and choice["finish_reason"] in ("stop", "length")
    assert body["usage"]["completion_tokens"] >= 1


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=payloads)
def test_no_completion_body_causes_a_server_error(client, payload):
    response = client.post("/v1/completions", content=payload, headers={"content-type": "application/json"})
    check(response, chat=False, echo=echoed_prompt(payload))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=chat_bodies)
def test_no_chat_body_causes_a_server_error(client, body):
    response = client.post(
        "/v1/chat/completions", content=json.dumps(body), headers={"content-type": "application/json"}
    )
    check(response, chat=True)


PIECES = ScriptedBackend().pieces


def expected(max_tokens: int) -> tuple[str, str]:
    """The scripted answer as the router must return it: the backend's, `max_tokens` of it (the
    stop strings are the backend's to apply: this one ignores them)."""
    text = "".join(PIECES[:max_tokens])
    return text, "length" if max_tokens < len(PIECES) else "stop"


def answer_of(response, chat: bool) -> tuple[str, str]:
    if not response.headers["content-type"].startswith("text/event-stream"):
        choice = response.json()["choices"][0]
        return (choice["message"]["content"] if chat else choice["text"]), choice["finish_reason"]
    text, finish = "", None
    for line in response.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                text += (choice["delta"].get("content") or "") if chat else choice["text"]
                finish = choice["finish_reason"] or finish
    return text, finish


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    chat=st.booleans(),
    prompt=st.text(min_size=1, max_size=30),
    max_tokens=st.integers(1, 6),
    temperature=st.floats(0, 2),
    top_p=st.floats(0.01, 1),
    stream=st.booleans(),
    stops=st.lists(st.text(alphabet="Helo, wrd!x", min_size=1, max_size=4), max_size=3),
)
def test_every_valid_request_is_answered_with_the_scripted_text(
    client, chat, prompt, max_tokens, temperature, top_p, stream, stops
):
    body = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "stream": stream,
        "stop": stops,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    response = client.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert answer_of(response, chat) == expected(max_tokens)
