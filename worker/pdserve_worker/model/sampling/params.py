"""What a request asks of the sampler: the one boundary type shared by router, prefill and decode.

A pydantic model because it crosses process boundaries (HTTP body → gRPC → decode) and must
reject nonsense (negative temperature, top_p of 2) with the field name in the error.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Bounds of the wire format (common.proto: uint32 max_tokens/top_k, int64 seed, int32 token ids).
UINT32_MAX = 2**32 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1
# Stop strings are matched against every token's text: their number and length bound that work
# and the size of the request on the wire.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300  # OpenAI's bound on logit_bias entries
MAX_REPETITION_PENALTY = 100.0
# Its inverse: logits are multiplied by at most 100 either way, so no value in range overflows
# a draw (1e-300 divided fp32 logits to inf and NaN: a 500, issue #58 A8).
MIN_REPETITION_PENALTY = 1.0 / MAX_REPETITION_PENALTY
# Alternatives per token a request may ask logprobs of (OpenAI's top_logprobs bound; vLLM's
# default max_logprobs is 20 too).
MAX_LOGPROBS = 20
# A structured-output grammar (model/sampling/grammar.py: llguidance's serialized form) travels in
# every PD message of its request; its size also bounds its compile.
MAX_GRAMMAR_CHARS = 64 * 1024
# Below this temperature a request is sampled greedily, as vLLM does (vllm/sampling_params.py,
# `_SAMPLING_EPS`, `SamplingParams.sampling_type`): logits divided by a vanishing temperature
# overflow float32 (below about 1.2e-38 the divisor itself rounds to 0), and the softmax of
# an infinite value is NaN, which no sampler can draw from.
GREEDY_BELOW_TEMPERATURE = 1e-5

StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


class FinishReason(enum.StrEnum):
    """Why a request's generation ended: the one vocabulary of engine, decode, router and API.

    STOP: EOS, a stop token id or a stop string; LENGTH: `max_tokens` or the slot's length;
    ABORT: taken out of the batch (cancelled, or the engine failed), never shown to a client."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class SamplingParams(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int = Field(16, ge=1, le=UINT32_MAX, description="Tokens to generate at most.")
    temperature: float = Field(1.0, ge=0.0, le=100.0, description="Below 1e-5 (0 included) greedy.")
    top_k: int = Field(0, ge=0, le=UINT32_MAX, description="Keep the k most likely tokens; 0 disables.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus mass to keep; 1 disables.")
    seed: int | None = Field(
        None, ge=INT64_MIN, le=INT64_MAX, description="Seed of the request's own generator; None draws one."
    )
    stop: tuple[StopString, ...] = Field(
        (), max_length=MAX_STOP_STRINGS, description="Strings that end generation (not included in the output)."
    )
    stop_token_ids: tuple[TokenId, ...] = Field(
        (), max_length=MAX_STOP_TOKEN_IDS, description="Token ids that end generation besides EOS."
    )
    ignore_eos: bool = Field(False, description="Keep generating past EOS (benchmarks).")
    include_stop_str_in_output: bool = Field(False, description="Keep the stop string that ended the text.")
    bad_words: tuple[Annotated[tuple[TokenId, ...], Field(min_length=1, max_length=64)], ...] = Field(
        (), max_length=128, description="Token sequences whose last token is banned after the rest (vLLM's)."
    )
    skip_special_tokens: bool = Field(True, description="Leave special tokens out of the text.")
    # Logits processors (model/sampling/processors.py), OpenAI's and vLLM's meanings.
    presence_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="Subtracted once from every generated token's logit."
    )
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="Subtracted per occurrence in the output.")
    repetition_penalty: float = Field(
        1.0,
        ge=MIN_REPETITION_PENALTY,
        le=MAX_REPETITION_PENALTY,
        description="HF's: logits of prompt and output tokens divided (>0) or multiplied.",
    )
    logit_bias: tuple[tuple[TokenId, Annotated[float, Field(ge=-100.0, le=100.0)]], ...] = Field(
        (), max_length=MAX_LOGIT_BIAS, description="(token id, bias) added to the logits."
    )
    min_tokens: int = Field(
        0, ge=0, le=UINT32_MAX, description="EOS and stop token ids are masked before this many tokens."
    )
    min_p: float = Field(
        0.0, ge=0.0, le=1.0, description="Drop tokens below min_p x the most likely one's probability."
    )
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="Report each generated token's logprob and this many most likely alternatives; None: none.",
    )
    prompt_logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="Report each prompt token's logprob (after the first) and this many alternatives; None: none.",
    )
    grammar: str | None = Field(
        None,
        max_length=MAX_GRAMMAR_CHARS,
        description="Structured outputs: the llguidance grammar the output must match (model/sampling/grammar.py).",
    )

    @model_validator(mode="after")
    def _min_within_max(self) -> SamplingParams:
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        return self

    @property
    def processed(self) -> bool:
        """Whether any logits processor applies (the sampler skips them all otherwise)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
            or self.bad_words
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1


# A token the processors banned has logprob -inf; it is reported as this, as vLLM does (JSON,
# the ready message's and the API's, has no infinity).
LOGPROB_FLOOR = -9999.0


@dataclass(frozen=True)
class TokenLogprobs:
    """A drawn token's log-probability and the `top` most likely tokens' (id, logprob), best first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    # 1 + how many tokens are at least as likely (vLLM's rank: 1 = the most likely); 0 = not known.
    rank: int = 0

    def to_wire(self) -> dict[str, Any]:
        """The JSON form the prefill's ready message carries to the decode."""
        return {"logprob": self.logprob, "top": [[i, v] for i, v in self.top], "rank": self.rank}

    @classmethod
    def from_wire(cls, data: Any, max_top: int) -> TokenLogprobs:
        """Read `to_wire`'s form back, refusing anything else (it comes from another process)."""
        if not isinstance(data, dict) or not isinstance(data.get("top"), list) or len(data["top"]) > max_top:
            raise ValueError(f"first_logprobs is not an object with at most {max_top} alternatives: {data!r:.200}")
        top = []
        for pair in data["top"]:
            if not (isinstance(pair, list) and len(pair) == 2 and is_token_id(pair[0]) and is_logprob(pair[1])):
                raise ValueError(f"first_logprobs alternative is not [token id, logprob]: {pair!r:.100}")
            top.append((pair[0], float(pair[1])))
        if not is_logprob(data.get("logprob")):
            raise ValueError(f"first_logprobs.logprob is not a logprob: {data.get('logprob')!r:.100}")
        rank = data.get("rank", 0)
        if not (type(rank) is int and 0 <= rank <= INT32_MAX):
            raise ValueError(f"first_logprobs.rank is not a rank: {rank!r:.100}")
        return cls(float(data["logprob"]), tuple(top), rank)


def is_token_id(value: Any) -> bool:
    """A token id (a tokenizer refuses a negative one with an error of its own)."""
    return type(value) is int and 0 <= value <= INT32_MAX


def is_logprob(value: Any) -> bool:
    """A logprob as this server computes them: a number in [LOGPROB_FLOOR, 0] (what another
    process sends is checked with this, in either wire form)."""
    return type(value) in (int, float) and math.isfinite(value) and LOGPROB_FLOOR <= value <= 0.0
