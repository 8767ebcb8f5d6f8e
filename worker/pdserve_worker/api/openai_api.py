"""The OpenAI wire format of requests: models that validate, and OpenAI's error envelope.

Requests are strict pydantic models: a wrong JSON type is a 400 naming the field, never a
silent coercion ("5" is not 5, true is not 1.0), and a field of OpenAI's or vLLM's schema we
do not implement (best_of > 1, suffix, ...) is refused with a 400
naming it instead of being ignored: api/api_fields.py is the one table (docs/api.md is
generated from it). Keys in neither schema are ignored, as newer clients send fields this
server does not know about.

Every field is bounded here, at the API, so that nothing past it can fail on a value a client
chose: integers to what the worker protocol carries (uint32 max_tokens/top_k, int64 seed), stop
strings in number and length, messages in number, the model name in length.

The bodies and chunks we answer are api/response_format.py's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator
from pydantic_core import PydanticCustomError

from pdserve_worker.api import api_fields
from pdserve_worker.api import tools as api_tools
from pdserve_worker.api.bad_words import MAX_BAD_WORD_SEQUENCES
from pdserve_worker.model.sampling import grammar as grammars
from pdserve_worker.model.sampling.params import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MIN_REPETITION_PENALTY,
    UINT32_MAX,
    SamplingParams,
    TokenId,
)


def _utf8_text(value: str) -> str:
    """JSON can carry lone surrogates ("\\ud800"); no tokenizer can encode them, so refuse them here."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"text is not valid Unicode (lone surrogate at position {exc.start})") from None
    return value


Text = Annotated[str, AfterValidator(_utf8_text)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS), AfterValidator(_utf8_text)]

# A conversation longer than this is refused before its template is rendered.
MAX_MESSAGES = 2048
MAX_MODEL_NAME_CHARS = 256

MAX_PROMPT_IDS = 1 << 20  # token ids of one prompt sent as ids (the context bounds it further)
# Prompts of one /v1/completions request (each is served as a request of its own: admission,
# limits and a slot each; lm-eval sends its batch this way).
MAX_PROMPTS = 64
# n > 1 is served as n requests of the prompt (api/fan_out.py); prompts × n shares the bound
# of a prompt list, so one request cannot open more sequences than a list of prompts could.
MAX_N = MAX_PROMPTS
MAX_CACHE_SALT_CHARS = 256  # a salt names a group of requests; longer is a mistake
MAX_TOOL_ARGUMENT_CHARS = 64 * 1024  # a tool call's arguments sent back in a conversation


def _structured(kind: grammars.Kind, field: str) -> Any:
    """A validator turning a structured-output field's value into what it asks for, checked in
    shape and size (GrammarError, a ValueError, is the 400 that names the field and what is
    wrong with it); the router compiles it off its event loop (api/grammar_compiler.py)."""

    def check(value: Any) -> grammars.Ask | None:
        return None if value is None else grammars.ask(kind, value, field)

    return AfterValidator(check)


def _response_format(value: Any) -> grammars.Ask | None:
    """OpenAI's `response_format`: text (no grammar), json_object, or json_schema with its schema."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return grammars.ask("json_object", None, "response_format")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ValueError("json_schema needs {name, schema}: the schema is missing")
        return grammars.ask("json_schema", spec["schema"], "response_format")
    raise ValueError(f"type is text, json_object or json_schema, got {kind!r}")


def _structured_outputs(value: Any) -> grammars.Ask | None:
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"an object with one of json, regex, choice, grammar, json_object, got {type(value).__name__}")
    given = {k: v for k, v in value.items() if k in _STRUCTURED_KINDS and v not in (None, False)}
    if len(given) != 1:
        raise ValueError(f"exactly one of {', '.join(_STRUCTURED_KINDS)} is given, got {sorted(given) or 'none'}")
    [(key, spec)] = given.items()
    return grammars.ask(_STRUCTURED_KINDS[key], None if key == "json_object" else spec, "structured_outputs")


_STRUCTURED_KINDS: dict[str, grammars.Kind] = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
}
# The fields that ask for structured outputs (a request may use one).
STRUCTURED_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = False


class _GenerationRequest(BaseModel):
    """Fields shared by `/v1/completions` and `/v1/chat/completions`."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    model: Annotated[Text, Field(max_length=MAX_MODEL_NAME_CHARS)]
    max_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(
        None, ge=-1, le=UINT32_MAX, description="Extension: keep the k most likely tokens; -1 or 0 disables."
    )
    # torch seeds a generator with a 64-bit integer; anything wider cannot be honoured.
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: StopString | list[StopString] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=MAX_N)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    # OpenAI's shape: token id (as a string) -> bias in [-100, 100].
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    # vLLM's extensions (model/sampling/processors.py).
    repetition_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    min_tokens: int | None = Field(None, ge=0, le=UINT32_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    ignore_eos: bool = Field(False, description="Extension: keep generating past EOS (benchmarks).")
    # vLLM's: keep the stop string that ended the answer; show special tokens in the text.
    include_stop_str_in_output: bool = False
    # vLLM's: the prompt's logprobs with this many alternatives (api/logprobs.py `vllm_prompt_logprobs`).
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM's: words the answer must not contain (api/bad_words.py turns them into token sequences).
    bad_words: list[StopString] | None = Field(None, max_length=MAX_BAD_WORD_SEQUENCES)
    skip_special_tokens: bool = True
    # vLLM's extension: token ids that end generation besides EOS (not part of the text).
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    user: str | None = None
    # vLLM's field: only requests naming the same salt (of the same tenant) share cached
    # prefix KV (api/cache_scope.py).
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    # Structured outputs (model/sampling/grammar.py): each field, when given, becomes the grammar
    # the output must match; OpenAI's response_format and vLLM's structured_outputs / guided_*.
    response_format: Annotated[Any, AfterValidator(_response_format)] = None
    structured_outputs: Annotated[Any, AfterValidator(_structured_outputs)] = None
    guided_json: Annotated[Any, _structured("json_schema", "guided_json")] = None
    guided_regex: Annotated[Any, _structured("regex", "guided_regex")] = None
    guided_choice: Annotated[Any, _structured("choice", "guided_choice")] = None
    guided_grammar: Annotated[Any, _structured("grammar", "guided_grammar")] = None

    @model_validator(mode="before")
    @classmethod
    def _refused_fields(cls, data: Any) -> Any:
        """A field of the schema this server does not implement, with a value that asks for
        something, is a 400 naming it (api/api_fields.py), before any other check."""
        if isinstance(data, dict):
            table = api_fields.CHAT if "messages" in cls.model_fields else api_fields.COMPLETIONS
            for f in table:
                if f.status == "refused" and f.name in data:
                    if not f.neutral(data[f.name]):
                        raise PydanticCustomError(
                            api_fields.UNSUPPORTED_FIELD,
                            "is not supported: {note} (got {field}={value})",
                            {"field": f.name, "note": f.note, "value": repr(data[f.name])[:80]},
                        )
        return data

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self) -> _GenerationRequest:
        if self.prompt_logprobs is not None and self.stream:
            # (vLLM refuses the same: they would all come before the first token)
            raise ValueError("prompt_logprobs are not available when stream is true")
        return self

    @model_validator(mode="after")
    def _sequences_bounded(self) -> _GenerationRequest:
        if self.sequences() > MAX_PROMPTS:
            raise ValueError(
                f"prompts × n is at most {MAX_PROMPTS} sequences per request, got {self.sequences()} "
                f"({len(self.prompt_list())} prompt(s) × n={self.n})"
            )
        return self

    def prompt_list(self) -> list[Any]:
        """The request's prompts (a chat request has one: its conversation)."""
        return [None]

    def sequences(self) -> int:
        """How many sequences the request asks for: prompts × n."""
        return len(self.prompt_list()) * (self.n or 1)

    def copies(self, **update: Any) -> list[Any]:
        """The request as n requests of one sequence each (api/fan_out.py). With a seed, copy i
        samples with seed + i (wrapped to int64), as vLLM's parallel sampling does, so the n
        answers differ and a repeated request repeats them all."""
        n = self.n or 1
        out = []
        for i in range(n):
            seed = None if self.seed is None else (self.seed + i - INT64_MIN) % (1 << 64) + INT64_MIN
            out.append(self.model_copy(update={**update, "n": None, "seed": seed}))
        return out

    def split(self) -> list[Any]:
        """One request per sequence, in choice order (prompt-major, as vLLM indexes them)."""
        return self.copies()

    @model_validator(mode="after")
    def _one_grammar(self) -> _GenerationRequest:
        asked = [name for name in STRUCTURED_FIELDS if getattr(self, name) is not None]
        if len(asked) > 1:
            raise ValueError(f"structured outputs take one of {', '.join(asked)}, not several")
        return self

    @property
    def grammar(self) -> grammars.Ask | None:
        """The grammar the output must match, if the request asks for structured outputs (not
        compiled yet: the router compiles it, api/grammar_compiler.py)."""
        return next((getattr(self, name) for name in STRUCTURED_FIELDS if getattr(self, name) is not None), None)

    @field_validator("stop", mode="before")
    @classmethod
    def _few_stops(cls, value: Any) -> Any:
        # Before the items are validated: a list of a million strings is refused by its length.
        if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(value)}")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isdigit() or int(key) > INT32_MAX:
                raise ValueError(f"keys are token ids (decimal strings), got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"biases are in [-100, 100], got {bias} for token {key}")
        return value

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(dict.fromkeys(self.stop))

    @property
    def include_usage_chunk(self) -> bool:
        return bool(self.stream) and self.stream_options is not None and self.stream_options.include_usage

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        """Alternatives per token the response reports logprobs of (None: no logprobs)."""
        return None

    def requested_prompt_logprobs(self) -> int | None:
        """The same for the prompt's tokens (vLLM's prompt_logprobs, or echo with logprobs)."""
        return self.prompt_logprobs

    def sampling_params(
        self,
        max_tokens: int,
        defaults: Mapping[str, float | int] | None = None,
        bad_words: tuple[tuple[int, ...], ...] = (),
        grammar: str | None = None,
    ) -> SamplingParams:
        """The engine's view of this request, once the router has settled `max_tokens` and
        compiled its `grammar` (of `self.grammar` or the tools').

        A field the request leaves unset takes the model's `defaults` (its generation_config:
        model/loading/generation_config.py's `sampling_defaults`), else OpenAI's (temperature and top_p
        1, no top_k), as transformers' `generate` and vLLM's default `--generation-config auto` do."""
        d = defaults or {}
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=float(d.get("temperature", 1.0)) if self.temperature is None else self.temperature,
            top_p=float(d.get("top_p", 1.0)) if self.top_p is None else self.top_p,
            top_k=max(int(d.get("top_k", 0)) if self.top_k is None else self.top_k, 0),
            seed=self.seed,
            stop=self.stop_strings,
            stop_token_ids=tuple(dict.fromkeys(self.stop_token_ids or ())),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=float(d.get("repetition_penalty", 1.0))
            if self.repetition_penalty is None
            else self.repetition_penalty,
            logit_bias=tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items()),
            min_tokens=self.min_tokens or 0,
            min_p=self.min_p or 0.0,
            logprobs=self.requested_logprobs(),
            prompt_logprobs=self.requested_prompt_logprobs(),
            grammar=grammar,
            bad_words=bad_words,
        )


PromptIds = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_IDS)]


class CompletionRequest(_GenerationRequest):
    # A string, or token ids (OpenAI's and vLLM's forms), alone or as a list of several (one choice each).
    prompt: Text | PromptIds | list[Text] | list[PromptIds]
    echo: bool | None = None
    # The legacy shape: how many alternatives per token (OpenAI allows 5, vLLM 20: 20 here).
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def requested_prompt_logprobs(self) -> int | None:
        if self.prompt_logprobs is not None:  # (vLLM: prompt_logprobs wins over echo's logprobs)
            return self.prompt_logprobs
        return self.logprobs if self.echo else None

    @field_validator("prompt", mode="before")
    @classmethod
    def _few_prompts(cls, value: Any) -> Any:
        # Before the items are validated: a list of a million prompts is refused by its length.
        if isinstance(value, list) and not value:
            raise ValueError("prompt is an empty list")
        if isinstance(value, list) and isinstance(value[0], (str, list)) and len(value) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts are supported in one request, got {len(value)}")
        return value

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request: one, or the several of a list of strings or of id lists."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)  # type: ignore[arg-type]

    def prompt_list(self) -> list[Any]:
        return self.prompts()

    def split(self) -> list[Any]:
        """The request once per prompt and copy (the same fields otherwise), prompt-major."""
        return [c for prompt in self.prompts() for c in self.copies(prompt=prompt)]

    @property
    def prompt_ids(self) -> list[int] | None:
        """The prompt's token ids when it was sent as ids, else None (text: to be tokenized)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], list):
            p = p[0]
        return list(p) if isinstance(p, list) and p and isinstance(p[0], int) else None

    @property
    def prompt_text(self) -> str:
        p = self.prompt
        return p if isinstance(p, str) else (p[0] if isinstance(p[0], str) else "")


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: str
    text: Text | None = None

    @model_validator(mode="after")
    def _text_only(self) -> ContentPart:
        if self.type != "text" or self.text is None:
            raise ValueError(f"only text content parts are supported, got type={self.type!r}")
        return self


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    name: Annotated[Text, Field(max_length=64)]
    arguments: Annotated[Text, Field(max_length=MAX_TOOL_ARGUMENT_CHARS)]  # JSON text, as OpenAI sends it


class ToolCallIn(BaseModel):
    """A tool call of an earlier assistant turn, sent back with the conversation."""

    model_config = ConfigDict(strict=True, extra="ignore")

    id: Annotated[Text, Field(max_length=256)] = ""
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = Field(None, max_length=api_tools.MAX_TOOLS)  # an assistant turn's
    tool_call_id: Annotated[Text, Field(max_length=256)] | None = None  # a tool turn's

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it: role and plain-text content, and an assistant
        turn's tool calls (arguments as an object, as HF templates write them with `tojson`)."""
        if self.content is None:
            text = ""
        elif isinstance(self.content, str):
            text = self.content
        else:
            text = "".join(part.text or "" for part in self.content)
        out: dict[str, Any] = {"role": self.role, "content": text}
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": _arguments(c)}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _arguments(call: ToolCallIn) -> Any:
    try:
        return json.loads(call.function.arguments)
    except json.JSONDecodeError:
        raise ValueError(f"tool call {call.id or call.function.name}: arguments are not JSON") from None


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # Tool calls (api/tools.py): checked into `tool_spec` below.
    tools: list[Any] | None = Field(None, max_length=api_tools.MAX_TOOLS)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    _tool_spec: api_tools.ToolSpec | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _tools(self) -> ChatCompletionRequest:
        self._tool_spec = api_tools.parse(self.tools, self.tool_choice, self.parallel_tool_calls)
        spec = self._tool_spec
        if spec is not None and spec.choice in ("required", "named") and self.grammar is not None:
            raise ValueError(
                "tool_choice required or a named function is enforced with a grammar: no structured output with it"
            )
        return self

    @property
    def tool_spec(self) -> api_tools.ToolSpec | None:
        """The request's tools, when it has some."""
        return self._tool_spec

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        # OpenAI's rule (and vLLM's ChatCompletionRequest.check_logprobs).
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("messages", mode="before")
    @classmethod
    def _few_messages(cls, value: Any) -> Any:
        # Before the items are validated: 200k messages are refused by their number alone.
        if isinstance(value, list) and len(value) > MAX_MESSAGES:
            raise ValueError(f"at most {MAX_MESSAGES} messages are supported, got {len(value)}")
        return value

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(BaseModel):
    """vLLM's POST /tokenize: a completion prompt or a conversation (after the chat template)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: Annotated[Text, Field(max_length=MAX_MODEL_NAME_CHARS)]
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)

    @model_validator(mode="after")
    def _one_of(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(BaseModel):
    """vLLM's POST /detokenize."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: Annotated[Text, Field(max_length=MAX_MODEL_NAME_CHARS)]
    tokens: PromptIds


# --- errors ---------------------------------------------------------------------------------


def error_body(
    message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error envelope; clients (the openai package) read `error.message` from it."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
