"""Structured outputs through real processes (issue #31 item 4): `pdserve local` in PD (the prefill
masks the first token, the decode the rest) and colocated, driven by the official openai SDK.

The tiny model has random weights and is sampled at temperature 1: only the mask can make its
output valid, which is checked with the upstream's own rules (`jsonschema`, `re.fullmatch`)."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from support.local_run import LocalRun

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999},
        "capital": {"type": "boolean"},
        "region": {"enum": ["north", "south"]},
    },
    "required": ["city", "population", "capital", "region"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module", params=["pd", "colocated"])
def client(request, tiny_model_dir, tmp_path_factory):
    shape = ["--prefill", "1", "--decode", "1"] if request.param == "pd" else ["--colocated"]
    run = LocalRun.start(
        tmp_path_factory.mktemp(f"structured-{request.param}"),
        "--model",
        str(tiny_model_dir),
        "--dtype",
        "float32",
        *shape,
        "--slots",
        "4",
        "--max-len",
        "256",
        "--port",
        "0",
    )
    try:
        yield openai.OpenAI(base_url=f"{run.url}/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        run.stop_cleanly()


def test_twenty_sampled_chat_answers_validate_against_the_schema(client):
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Describe a city as JSON."}]
    for seed in range(20):
        answer = client.chat.completions.create(
            model=model, messages=messages, max_tokens=120, temperature=1.0, seed=seed, response_format=FORMAT
        )
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_a_streamed_answer_and_the_vllm_forms_follow_their_grammar(client):
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "JSON please"}],
        max_tokens=120,
        temperature=1.0,
        seed=3,
        response_format=FORMAT,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    for seed in range(5):
        regex = client.completions.create(
            model=model,
            prompt="id:",
            max_tokens=20,
            temperature=1.0,
            seed=seed,
            extra_body={"guided_regex": r"[A-Z]{2}\d{3}"},
        )
        assert re.fullmatch(r"[A-Z]{2}\d{3}", regex.choices[0].text), regex.choices[0].text
        choice = client.completions.create(
            model=model,
            prompt="pick:",
            max_tokens=10,
            temperature=1.0,
            seed=seed,
            extra_body={"guided_choice": ["left", "right"]},
        )
        assert choice.choices[0].text in ("left", "right")


def test_an_invalid_schema_is_a_400_naming_the_problem(client):
    model = client.models.list().data[0].id
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8, response_format=bad
        )
    assert "objectx" in str(caught.value) and caught.value.body["param"] == "response_format"
