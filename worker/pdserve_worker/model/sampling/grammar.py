"""Structured outputs: what a request's output must match, as one llguidance grammar.

The API's forms (response_format json_object / json_schema, guided_json, guided_regex,
guided_choice, guided_grammar and structured_outputs) all become one grammar here, on the
router, where a bad one is a 400 naming the problem: `ask` checks a request's value when its
body is read, `to_grammar` builds the grammar off the event loop. It travels in
`SamplingParams.grammar`; workers turn it into a matcher and masks (grammar_mask.py). Torch-free.

Why llguidance: the cheapest masks of the three engines measured (benchmarks/README.md,
`grammar_cost.py`), no dependencies, JSON schema, regex, Lark and GBNF, and parser limits that
bound the work a hostile grammar can cause per step. JSON: the schema's `x-guidance` options
win; without them JSON is compact (free whitespace lets a small model at temperature 1 spend its
max_tokens on blank lines inside a valid prefix).
"""

from __future__ import annotations

import hashlib
import json
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import llguidance

from pdserve_worker.model.sampling.params import MAX_GRAMMAR_CHARS

if TYPE_CHECKING:
    from pdserve_worker.model.tokenizer import Tokenizer

MAX_CHOICES = 256

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
_JSON_OPTIONS = {"whitespace_flexible": False}


_lock = threading.Lock()
# Built once per tokenizer and vocabulary width (~0.3 s for 49k tokens): llguidance's view of
# the vocabulary, the token trie it walks for every mask. Here, torch-free: the router builds
# matchers with it too (api/grammar_compiler.py), the workers' masks (grammar_mask.py).
_tokenizers: weakref.WeakKeyDictionary[Tokenizer, dict[int, llguidance.LLTokenizer]] = weakref.WeakKeyDictionary()


def grammar_tokenizer(tokenizer: Tokenizer, vocab: int) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for `tokenizer` over `vocab` logits (ids past the tokenizer's are never allowed)."""
    with _lock:
        per_vocab = _tokenizers.setdefault(tokenizer, {})
        if vocab not in per_vocab:
            per_vocab[vocab] = llguidance.LLTokenizer(
                tokenizer.backend.to_str(), n_vocab=vocab, eos_token=list(tokenizer.eos_token_ids)
            )
        return per_vocab[vocab]


class GrammarError(ValueError):
    """A structured-output request that cannot be served: the message says what is wrong."""


@dataclass(frozen=True)
class Ask:
    """One grammar a request asks for, checked for shape and size but not compiled: compiling
    is CPU work of unbounded-looking cost that the router runs off its event loop
    (api/grammar_compiler.py). `field` names the request field it came from (the 400's param)."""

    kind: Kind
    value: Any
    field: str

    @property
    def key(self) -> str:
        """The SHA-256 of kind and value: equal asks compile to the same grammar."""
        return hashlib.sha256(f"{self.kind}\0{json.dumps(self.value)}".encode()).hexdigest()


def ask(kind: Kind, value: Any, field: str) -> Ask:
    """`value` as an Ask for a `kind` grammar; GrammarError naming what is wrong with its shape
    or size (what needs no compiling). `to_grammar` finishes the job."""
    if len(json.dumps(value)) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"the {kind} is larger than {MAX_GRAMMAR_CHARS} characters")
    if kind == "json_object":
        return Ask(kind, None, field)
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise GrammarError(f"the JSON schema is not JSON: {exc}") from None
        if not isinstance(value, (dict, bool)):
            raise GrammarError(f"a JSON schema is an object or a boolean, got {type(value).__name__}")
    elif kind == "choice":
        if not isinstance(value, list) or not value or len(value) > MAX_CHOICES:
            raise GrammarError(f"a choice is a list of 1 to {MAX_CHOICES} strings, got {value!r:.80}")
        if not all(isinstance(c, str) and c for c in value):
            raise GrammarError(f"every choice is a non-empty string, got {value!r:.80}")
    elif not isinstance(value, str) or not value:
        raise GrammarError(f"a {kind} is a non-empty string, got {value!r:.80}")
    return Ask(kind, value, field)


def to_grammar(asked: Ask, tokenizer: llguidance.LLTokenizer | None = None) -> str:
    """The llguidance grammar of `asked`; GrammarError if llguidance cannot serve it. With the
    model's `tokenizer`, a matcher is built too, as the workers build it: some grammars pass
    the tokenizer-free check and only then exceed llguidance's limits (its symbol count)."""
    kind, value = asked.kind, asked.value
    if kind in ("json_object", "json_schema"):
        schema = {"type": "object"} if kind == "json_object" else value
        if isinstance(schema, dict) and "x-guidance" not in schema:
            schema = {**schema, "x-guidance": _JSON_OPTIONS}
        grammar = llguidance.grammar_from("json_schema", json.dumps(schema))
    elif kind == "choice":
        grammar = llguidance.grammar_from("choice", json.dumps(value))
    else:
        try:
            grammar = llguidance.grammar_from("regex" if kind == "regex" else "grammar", value)
        except ValueError as exc:  # GBNF that does not convert
            raise GrammarError(str(exc)) from None
    check(grammar)
    if tokenizer is not None:
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(
                f"the grammar cannot be served with this model's tokenizer: {first_line(matcher.get_error())}"
            )
    return grammar


def first_line(error: str) -> str:
    """llguidance's error without the backtrace it appends to a panic."""
    return error.strip().splitlines()[0] if error.strip() else error


def build(kind: Kind, value: Any) -> str:
    """The llguidance grammar of one structured-output request, compiled here and now (the
    workers and tests; the router compiles through api/grammar_compiler.py)."""
    return to_grammar(ask(kind, value, kind))


def check(grammar: str) -> None:
    """GrammarError naming the problem if llguidance cannot build a matcher from `grammar`
    (its own check: the schema keywords, regex syntax and Lark rules it supports)."""
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"the grammar is larger than {MAX_GRAMMAR_CHARS} characters")
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(error.strip())
