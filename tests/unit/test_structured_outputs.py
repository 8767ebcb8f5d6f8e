"""Structured outputs (issue #31): the API's forms become one llguidance grammar (or a 400 that
names the problem), the prefill's first draw and every decode step are masked by it, a request
ends when its grammar is complete, and its state survives a resume on another worker.

Outputs are checked against the upstream rule, not against the grammar engine: JSON with
`jsonschema`, regexes with `re.fullmatch`, choices by membership, on a random-weight model
sampled at temperature 1 (nothing but the mask can make it produce valid output)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from pdserve_worker.model.engine import Generator, colocated_cache, generate
from pdserve_worker.model.sampling import grammar as grammars
from pdserve_worker.model.sampling.grammar_mask import GrammarMatcher, mask_rows
from pdserve_worker.model.sampling.params import FinishReason, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "fish"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
PROMPT = [5, 9, 13, 17]


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    from pdserve_worker.model.loading.loader import load_model

    return load_model(str(tiny_model_dir), dtype="float32")


def sample(loaded, grammar: str, n: int = 20, max_tokens: int = 160) -> list:
    params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=s, grammar=grammar) for s in range(n)]
    return generate(loaded.model, loaded.tokenizer, [PROMPT] * n, params, max_len=256)


def test_twenty_samples_at_temperature_one_validate_against_the_json_schema(loaded):
    for done in sample(loaded, grammars.build("json_schema", SCHEMA)):
        assert done.finish_reason is FinishReason.STOP, done.text
        jsonschema.validate(json.loads(done.text), SCHEMA)


def test_json_object_regex_choice_and_lark_grammars_are_followed(loaded):
    for done in sample(loaded, grammars.build("json_object", None), n=6, max_tokens=200):
        if done.finish_reason is FinishReason.STOP:  # (an object may be cut by max_tokens: then no check)
            assert isinstance(json.loads(done.text), dict)
    pattern = r"[a-c]{3}-\d{2}"
    for done in sample(loaded, grammars.build("regex", pattern), n=8):
        assert re.fullmatch(pattern, done.text), done.text
    choices = ["red", "green", "blue"]
    assert {d.text for d in sample(loaded, grammars.build("choice", choices), n=12)} <= set(choices)
    lark = 'start: "x" ("y" | "z")+ "!"'
    for done in sample(loaded, grammars.build("grammar", lark), n=6, max_tokens=40):
        if done.finish_reason is FinishReason.STOP:
            assert re.fullmatch(r"x[yz]+!", done.text), done.text


@pytest.mark.parametrize(
    ("kind", "value", "message"),
    [
        ("json_schema", {"type": "objectx"}, "objectx"),
        ("json_schema", "{not json", "not JSON"),
        ("json_schema", 7, "object or a boolean"),
        ("regex", "(", "unclosed group"),
        ("regex", "", "non-empty"),
        ("choice", [], "list of 1 to 256"),
        ("choice", ["a", 3], "non-empty string"),
        ("grammar", "start: undefined_rule", "undefined_rule"),
        ("json_schema", {"description": "x" * 70_000}, "larger than"),
    ],
)
def test_a_grammar_that_cannot_be_served_is_refused_naming_the_problem(kind, value, message):
    with pytest.raises(grammars.GrammarError, match=re.escape(message)):
        grammars.build(kind, value)


def test_masks_touch_only_rows_with_a_grammar_and_leave_only_what_may_follow(loaded):
    vocab = loaded.config.vocab_size
    grammar = grammars.build("choice", ["cat", "dog"])
    first = GrammarMatcher.start(loaded.tokenizer, vocab, grammar)
    third = GrammarMatcher.start(loaded.tokenizer, vocab, grammar)
    third.consume(loaded.tokenizer.encode("ca"))
    logits = torch.randn(3, vocab)
    plain = logits[1].clone()
    mask_rows(logits, [first, None, third])
    assert torch.equal(logits[1], plain)
    for row in (0, 2):
        allowed = torch.isfinite(logits[row]).nonzero().flatten().tolist()
        assert allowed and len(allowed) < vocab
        for token in allowed:  # every token left is one the grammar takes next
            probe = GrammarMatcher.start(loaded.tokenizer, vocab, grammar)
            probe.consume(loaded.tokenizer.encode("ca") if row == 2 else [])
            probe.consume([token])
    assert GrammarMatcher.start(loaded.tokenizer, vocab, None) is None


def test_a_first_token_the_grammar_forbids_is_refused_and_leaves_nothing_running(loaded):
    gen = Generator(loaded.model, loaded.tokenizer, colocated_cache(loaded.model, 1, 64))
    grammar = grammars.build("choice", ["cat", "dog"])
    bad = loaded.tokenizer.encode("z")[0]
    with pytest.raises(ValueError, match="does not follow the grammar"):
        gen.add_prefilled(PROMPT, 0, bad, SamplingParams(max_tokens=8, grammar=grammar))
    assert not gen.has_work()
    gen.add_prefilled(PROMPT, 0, loaded.tokenizer.encode("c")[0], SamplingParams(max_tokens=8, grammar=grammar))
    assert gen.has_work()  # the slot was not left behind by the refusal


def test_a_resumed_request_continues_its_grammar_exactly(loaded):
    """A stream resumed elsewhere (a migration, a decode that died) rebuilds the grammar's state
    from the tokens already emitted: the same seeded text as if it had never moved."""
    grammar = grammars.build("json_schema", SCHEMA)
    params = SamplingParams(max_tokens=160, temperature=1.0, seed=11, grammar=grammar)
    [whole] = generate(loaded.model, loaded.tokenizer, [PROMPT], params, max_len=256)
    assert len(whole.output_ids) > 8
    cache = colocated_cache(loaded.model, 1, 256)
    gen = Generator(loaded.model, loaded.tokenizer, cache)
    history = PROMPT + whole.output_ids[:6]  # what the new worker holds the KV of
    loaded.model.prefill(history, cache, 0)
    _, first = gen.add_prefilled(history, 0, whole.output_ids[6], params, num_generated=6)
    rest = [first, *gen.stream()]
    assert whole.output_ids[:6] + [o.token_id for o in rest] == whole.output_ids
    assert "".join(o.text for o in rest) == whole.text[len(loaded.tokenizer.decode(whole.output_ids[:6])) :]


# ---- the API's forms (a router over a scripted backend) -----------------------------------------


@pytest.fixture
def api(port):
    from pdserve_worker.api.app import create_app
    from support.router_fakes import ScriptedBackend, running_router

    backend = ScriptedBackend()
    with running_router(create_app(backend), port) as url:
        yield url, backend


CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"model": "fake-model", "prompt": "hi", "max_tokens": 4}


@pytest.mark.parametrize(
    ("body", "kind", "value"),
    [
        (
            {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}},
            "json_schema",
            SCHEMA,
        ),
        ({**CHAT, "response_format": {"type": "json_object"}}, "json_object", None),
        ({**COMPLETION, "response_format": {"type": "json_object"}}, "json_object", None),
        ({**COMPLETION, "guided_json": json.dumps(SCHEMA)}, "json_schema", SCHEMA),
        ({**COMPLETION, "guided_regex": "[0-9]+"}, "regex", "[0-9]+"),
        ({**CHAT, "guided_choice": ["yes", "no"]}, "choice", ["yes", "no"]),
        ({**COMPLETION, "guided_grammar": 'start: "a"+'}, "grammar", 'start: "a"+'),
        ({**CHAT, "structured_outputs": {"regex": "[ab]+"}}, "regex", "[ab]+"),
        ({**CHAT, "structured_outputs": {"json_object": True}}, "json_object", None),
    ],
)
def test_each_form_reaches_the_backend_as_the_grammar_it_names(api, body, kind, value):
    import httpx

    url, backend = api
    endpoint = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(f"{url}{endpoint}", json=body, timeout=10)
    assert r.status_code == 200, r.text
    assert backend.calls[-1].params.grammar == grammars.build(kind, value)


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "objectx"}}}},
            "response_format",
            "objectx",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}},
            "response_format",
            "schema is missing",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format", "text, json_object or json_schema"),
        ({"guided_regex": "("}, "guided_regex", "unclosed group"),
        ({"guided_choice": []}, "guided_choice", "list of 1 to 256"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one of"),
        ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, None, "not several"),
    ],
)
def test_a_structured_output_that_cannot_be_served_is_a_400_naming_it(api, extra, param, words):
    import httpx

    url, backend = api
    r = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, **extra}, timeout=10)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error["message"], error
    if param is not None:
        assert error["param"] == param, error
    assert not backend.calls  # nothing reached the backend
