"""Every request field a client may send, and what this server does with it: one table.

OpenAI's request schemas (chat/completions and completions) and the vLLM extensions, each:
- `supported`: implemented as the schema says;
- `refused`: a value other than the neutral one (absent, null, false, 0, the default) is a 400
  that names the field — never accepted and silently ignored (a client that sends
  `response_format` must not get unconstrained text back as if it were honoured);
- `accepted`: taken and without effect by nature (a label, a hint, a store flag of OpenAI's
  own platform), said here so that nobody mistakes it for support.
A field in neither schema passes untouched (forward compatibility: newer clients send fields
this server does not know).
docs/api.md's table is generated from this one (scripts/generate.py, checked by a test).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

Status = Literal["supported", "refused", "accepted"]
UNSUPPORTED_FIELD = "unsupported_field"  # the validation error type of a refusal (api/errors.py maps it)


def _falsy(value: Any) -> bool:
    return value is None or value is False or value == 0 or value == [] or value == {} or value == ""


def _is(*neutral: Any) -> Callable[[Any], bool]:
    return lambda value: _falsy(value) or value in neutral


def _only(*neutral: Any) -> Callable[[Any], bool]:
    """Neutral when absent or one of `neutral` (for fields whose default is true)."""
    return lambda value: value is None or any(value is n or (type(value) is type(n) and value == n) for n in neutral)


@dataclass(frozen=True)
class Field:
    name: str
    status: Status
    note: str
    neutral: Callable[[Any], bool] = _falsy  # refused fields: values that ask for nothing


S: Status = "supported"
R: Status = "refused"
A: Status = "accepted"
_COMMON = [
    Field("model", S, "must name the served model (404 otherwise)"),
    Field("max_tokens", S, "default: 16 on completions, the context left on chat"),
    Field("temperature", S, "0–2; below 1e-5 greedy"),
    Field("top_p", S, "(0, 1]"),
    Field("seed", S, "the same text for the same request, in one process or across PD"),
    Field("stop", S, "up to 16 strings, never part of the output"),
    Field("stream", S, ""),
    Field("stream_options", S, "include_usage"),
    Field("user", A, "a label, not used"),
    Field(
        "n",
        S,
        "1–64 choices (prompts × n ≤ 64); each served as a request of its own; with a prefix cache the "
        "first copy of a prompt prefills it and the others follow on the same prefill, reusing its cached "
        "blocks; on a paged decode the others share the first copy's whole prompt blocks read-only and are "
        "pushed only the tail (a layer-sharded group's slots are not shared); with a seed, choice i "
        "samples with seed + i; usage counts each prompt once",
    ),
    Field("presence_penalty", S, "-2–2, OpenAI's meaning: once per generated token"),
    Field("frequency_penalty", S, "-2–2, OpenAI's meaning: per occurrence in the output"),
    Field("logit_bias", S, "up to 300 token ids (decimal strings) → bias in [-100, 100]"),
    # vLLM's extensions
    Field("top_k", S, "-1 or 0 disables"),
    Field("ignore_eos", S, "generate past EOS (benchmarks)"),
    Field("cache_salt", S, "narrows the tenant's prefix-cache scope (docs/kv-blocks.md)"),
    Field("min_tokens", S, "EOS and stop token ids masked before that many tokens (≤ max_tokens)"),
    Field("min_p", S, "0–1: drop tokens below min_p × the most likely one's probability"),
    Field(
        "repetition_penalty",
        S,
        "HF's: prompt and output tokens' logits ÷ (>0) or × the penalty; default: generation_config's",
    ),
    Field("stop_token_ids", S, "up to 64 token ids that end generation besides EOS (not in the text; finish: stop)"),
    Field(
        "bad_words",
        S,
        "vLLM's: each word (and its space-prefixed form) as tokens; the last token is banned after the rest; "
        "at most 128 token sequences of 64 tokens",
    ),
    Field(
        "include_stop_str_in_output", S, "the stop string that ended the answer stays at its end (not a stop token id)"
    ),
    Field("skip_special_tokens", S, "false: special tokens (<|im_end|>, EOS, tool-call markers) are in the text"),
    Field("guided_json", S, "a JSON schema (object or string) the output matches (llguidance)"),
    Field("guided_regex", S, "a regular expression the output matches"),
    Field("guided_choice", S, "up to 256 strings: the output is one of them"),
    Field("guided_grammar", S, "a Lark or llama.cpp GBNF grammar the output matches"),
    Field(
        "structured_outputs",
        S,
        "vLLM's form: exactly one of json, regex, choice, grammar, json_object; one structured-output field per request",
    ),
    Field(
        "response_format",
        S,
        "text, json_object, or json_schema {name, schema}: the output matches the schema (llguidance, JSON with fixed "
        "whitespace unless the schema's x-guidance says otherwise); an invalid schema is a 400 naming the problem",
    ),
    Field("truncate_prompt_tokens", R, "a prompt that does not fit is a 400"),
]
COMPLETIONS = [
    Field(
        "prompt",
        S,
        "a string or token ids, or a list of up to 64 of either: one choice per prompt (index = its position), "
        "each prompt served as a request of its own (admission, limits, a slot), all at once",
    ),
    *_COMMON,
    Field(
        "echo",
        S,
        "the prompt before the completion; with logprobs, the prompt's tokens first (the very first with null "
        "logprob), computed by the prefill over the whole prompt (no prefix-cache reuse for it); with logprobs k, "
        "prompts up to 8 MiB / (16 B × (k+1)) tokens (24,966 at k=20)",
    ),
    Field(
        "logprobs",
        S,
        "0–20 alternatives per generated token: tokens, token_logprobs, top_logprobs, text_offset; the "
        "log-softmax after the request's logits processors, before temperature, top-k/p and min_p",
    ),
    Field("best_of", R, "only best_of=1 is supported (one sequence per request)", _is(1)),
    Field("suffix", R, "insertion is not supported"),
    Field(
        "prompt_logprobs",
        S,
        "vLLM's: 0–20 alternatives per prompt token, in vLLM's shape on the choice (not streamed; wins over echo's "
        "logprobs)",
    ),
]
CHAT = [
    Field("messages", S, "text content; system, developer, user, assistant, tool roles"),
    Field("max_completion_tokens", S, "wins over max_tokens"),
    *_COMMON,
    Field("logprobs", S, "each generated token's logprob (as on /v1/completions: after the logits processors)"),
    Field("top_logprobs", S, "0–20 alternatives per token; needs logprobs: true"),
    Field(
        "prompt_logprobs",
        S,
        "vLLM's: 0–20 alternatives per prompt token, in vLLM's shape on the response (not streamed)",
    ),
    Field(
        "tools",
        S,
        "up to 128 functions, given to the model's chat template; its answer is parsed for calls in the "
        "template's format (Hermes/Qwen <tool_call> blocks, or Llama 3's JSON) into tool_calls (api/tools.py)",
    ),
    Field("tool_choice", S, "none, auto, required or a named function; required and named enforced with a grammar"),
    Field("parallel_tool_calls", S, "false: required allows one call only (a named function always one)"),
    Field("functions", R, "deprecated tool calls: not implemented"),
    Field("function_call", R, "deprecated tool calls: not implemented", _is("none", "auto")),
    Field("modalities", R, "text only", lambda v: _falsy(v) or v == ["text"]),
    Field("audio", R, "text only"),
    Field("prediction", R, "predicted outputs are not implemented"),
    Field("reasoning_effort", R, "the served models do not reason"),
    Field("verbosity", R, "not implemented"),
    Field("web_search_options", R, "no search here"),
    Field("metadata", A, "OpenAI's stored-completion labels, not used"),
    Field("store", A, "nothing is stored"),
    Field("service_tier", A, "one tier; priority comes from the x-pdserve-priority header"),
    Field("prompt_cache_key", A, "a routing hint; prefix routing finds cached prefixes itself"),
    Field("safety_identifier", A, "a label, not used"),
    Field("chat_template_kwargs", R, "the model's template is used as it is"),
    Field("add_generation_prompt", R, "always added", _only(True)),
    Field("continue_final_message", R, "not implemented"),
]
# Fields of vLLM's protocol (vllm/entrypoints/openai/protocol.py), not OpenAI's.
VLLM_EXTENSIONS = frozenset(
    {
        "add_generation_prompt",
        "bad_words",
        "cache_salt",
        "chat_template_kwargs",
        "continue_final_message",
        "guided_choice",
        "guided_grammar",
        "guided_json",
        "guided_regex",
        "ignore_eos",
        "include_stop_str_in_output",
        "min_p",
        "min_tokens",
        "prompt_logprobs",
        "repetition_penalty",
        "skip_special_tokens",
        "stop_token_ids",
        "structured_outputs",
        "top_k",
        "truncate_prompt_tokens",
    }
)
TABLES: Mapping[str, list[Field]] = {"/v1/completions": COMPLETIONS, "/v1/chat/completions": CHAT}


def refusals(table: list[Field], body: Mapping[str, Any]) -> list[str]:
    """The messages for fields of `body` the table refuses with the value they have."""
    out = []
    for f in table:
        if f.status == "refused" and f.name in body and not f.neutral(body[f.name]):
            out.append(f"{f.name}: {f.note}")
    return out


API_DOC_HEADER = """\
# The OpenAI API: what each request field does here

Generated from `worker/pdserve_worker/api/api_fields.py` by `python scripts/generate.py`
(a test fails when it is stale): the request models refuse exactly the fields marked
*refused* — any value but the neutral one (absent, null, false, 0, the default) is a 400 whose
`param` names the field and whose `code` is `unsupported_parameter` — and nothing is accepted
and silently ignored except the fields marked *accepted*, which have no effect by nature.
Fields in neither table pass untouched (newer clients send fields this server does not know).

Besides the two endpoints below: `GET /v1/models` (with `max_model_len`), and vLLM's
`POST /tokenize` (`{"model", "prompt"}` or `{"model", "messages"}` →
`{"count", "max_model_len", "tokens"}`) and `POST /detokenize` (`{"model", "tokens"}` →
`{"prompt"}`), behind the same API keys. Every response and stream chunk carries OpenAI's
`system_fingerprint` (this server's version, the model and its revision: it changes when
what a seeded answer depends on changes).

"""


def markdown() -> str:
    """docs/api.md (scripts/generate.py writes it; a test compares)."""
    lines = [API_DOC_HEADER.rstrip("\n"), ""]
    for endpoint, table in TABLES.items():
        lines += [f"### `{endpoint}`", "", "| field | from | status | note |", "|---|---|---|---|"]
        lines += [
            f"| `{f.name}` | {'vLLM' if f.name in VLLM_EXTENSIONS else 'OpenAI'} | {f.status} | {f.note} |"
            for f in table
        ]
        lines.append("")
    return "\n".join(lines)
