"""Structured outputs: what a request's output must match, as one llguidance grammar.

The API's forms (response_format json_object / json_schema, and vLLM's guided_json,
guided_regex, guided_choice, guided_grammar and structured_outputs) all become one grammar
here, on the router, where a bad one is a 400 naming the problem. The grammar travels in
`SamplingParams.grammar`; the workers turn it into a matcher and masks
(model/sampling/grammar_mask.py). Torch-free, so the API side does not load torch for it.

Why llguidance (over xgrammar and outlines-core, all three measured by
benchmarks/grammar_cost.py, batch 16, this tokenizer): a decode step's masks cost 0.7 ms
against xgrammar's 2.4 ms and outlines-core's 16 ms; it has no dependencies, where xgrammar
pulls transformers and triton (~1 GB); it takes JSON schema, regex, Lark and llama.cpp's GBNF;
and its parser limits bound the work a hostile grammar can make a worker do per step.

JSON: the schema's own `x-guidance` options win; without them the JSON is compact (no whitespace
between tokens), as with vLLM's `disable_any_whitespace`: with free whitespace a small model at
temperature 1 can spend its max_tokens on blank lines inside a valid prefix.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import llguidance

from pdserve_worker.model.sampling.params import MAX_GRAMMAR_CHARS

MAX_CHOICES = 256

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
_JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A structured-output request that cannot be served: the message says what is wrong."""


def _json_schema(schema: Any) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"the JSON schema is not JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"a JSON schema is an object or a boolean, got {type(schema).__name__}")
    if isinstance(schema, dict) and "x-guidance" not in schema:
        schema = {**schema, "x-guidance": _JSON_OPTIONS}
    return llguidance.grammar_from("json_schema", json.dumps(schema))


def _choice(choices: Any) -> str:
    if not isinstance(choices, list) or not choices or len(choices) > MAX_CHOICES:
        raise GrammarError(f"a choice is a list of 1 to {MAX_CHOICES} strings, got {choices!r:.80}")
    if not all(isinstance(c, str) and c for c in choices):
        raise GrammarError(f"every choice is a non-empty string, got {choices!r:.80}")
    return llguidance.grammar_from("choice", json.dumps(choices))


def _text(kind: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise GrammarError(f"a {kind} is a non-empty string, got {value!r:.80}")
    try:
        return llguidance.grammar_from("regex" if kind == "regex" else "grammar", value)
    except ValueError as exc:  # GBNF that does not convert
        raise GrammarError(str(exc)) from None


def build(kind: Kind, value: Any) -> str:
    """The llguidance grammar of one structured-output request; GrammarError if it is not one."""
    if len(json.dumps(value)) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"the {kind} is larger than {MAX_GRAMMAR_CHARS} characters")
    if kind == "json_object":
        grammar = _json_schema({"type": "object"})
    elif kind == "json_schema":
        grammar = _json_schema(value)
    elif kind == "choice":
        grammar = _choice(value)
    else:
        grammar = _text(kind, value)
    check(grammar)
    return grammar


def check(grammar: str) -> None:
    """GrammarError naming the problem if llguidance cannot build a matcher from `grammar`
    (its own check: the schema keywords, regex syntax and Lark rules it supports)."""
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"the grammar is larger than {MAX_GRAMMAR_CHARS} characters")
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(error.strip())
