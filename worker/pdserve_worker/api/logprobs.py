"""Generated tokens' logprobs in OpenAI's two response shapes.

The values come from the engine (model/sampling/params.py `TokenLogprobs`: the log-softmax
after the request's logits processors, before temperature and truncation; -inf as -9999, as
vLLM sends it). Here they get their token texts and their shape:
- /v1/completions (the legacy shape, `logprobs: k`): `tokens`, `token_logprobs`,
  `top_logprobs` (per token a dict text -> logprob of the k most likely tokens, plus the chosen
  one when it is not among them: "up to logprobs+1 elements", as OpenAI documents and vLLM
  does) and `text_offset` (where each token's text starts, counted over the token texts);
  with `echo`, the prompt's tokens come first, the very first with null logprob and top;
- /v1/chat/completions (`logprobs: true, top_logprobs: k`): `content`, one entry per token
  with `token`, `logprob`, `bytes` (the UTF-8 of the token text) and exactly k `top_logprobs`.
A token's text is the tokenizer's decoding of that id alone, special tokens included; part of
a multi-byte character decodes to U+FFFD, as in vLLM.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve_worker.model.sampling.params import TokenLogprobs

TOKEN_TEXT_CACHE = 65_536  # token texts remembered (a vocabulary's worth for the bundled models)


@dataclass(frozen=True)
class Scored:
    """One token and its logprobs (None: an echoed prompt's first token, which has none)."""

    token_id: int
    logprobs: TokenLogprobs | None


def prompt_scored(prompt_ids: Sequence[int], logprobs: Sequence[TokenLogprobs]) -> list[Scored]:
    """An echoed prompt's tokens with their logprobs (those of tokens 1..n-1; the first has none)."""
    return [Scored(prompt_ids[0], None), *(Scored(t, lp) for t, lp in zip(prompt_ids[1:], logprobs, strict=True))]


class TokenText:
    """token id -> its text in logprobs, remembered (functools' bounded LRU: the vocabulary is
    finite, but a tokenizer's may be large)."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode  # (also what an echo of token ids decodes with)
        self._text = functools.lru_cache(maxsize=TOKEN_TEXT_CACHE)(lambda token_id: decode([token_id]))

    def __call__(self, token_id: int) -> str:
        return str(self._text(token_id))


def completion_block(scored: Sequence[Scored], text: TokenText, offset: int = 0) -> dict[str, Any]:
    """The legacy completions `logprobs` object of `scored`, whose first text starts at `offset`."""
    tokens: list[str] = []
    offsets: list[int] = []
    tops: list[dict[str, float] | None] = []
    for s in scored:
        token = text(s.token_id)
        tokens.append(token)
        offsets.append(offset)
        offset += len(token)
        if s.logprobs is None:
            tops.append(None)
            continue
        top = {text(i): v for i, v in s.logprobs.top}
        if s.token_id not in {i for i, _ in s.logprobs.top}:
            top = {token: s.logprobs.logprob, **top}
        tops.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": [None if s.logprobs is None else s.logprobs.logprob for s in scored],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def _chat_entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_block(scored: Sequence[Scored], text: TokenText) -> dict[str, Any]:
    """The chat `logprobs` object of `scored`."""
    content = []
    for s in scored:
        assert s.logprobs is not None  # (chat has no echo)
        entry = _chat_entry(text(s.token_id), s.logprobs.logprob)
        entry["top_logprobs"] = [_chat_entry(text(i), v) for i, v in s.logprobs.top]
        content.append(entry)
    return {"content": content, "refusal": None}


def vllm_prompt_logprobs(scored: Sequence[Scored], text: TokenText) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, None for the first, then {token id: {logprob,
    rank, decoded_token}} holding the prompt's token (its rank among the whole vocabulary) and
    the alternatives (ranks 1..k), as vLLM's `Logprob` entries serialize."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for s in scored:
        if s.logprobs is None:
            out.append(None)
            continue
        entry = {str(s.token_id): _vllm_logprob(s.logprobs.logprob, s.logprobs.rank, text(s.token_id))}
        for i, (token, value) in enumerate(s.logprobs.top):
            entry.setdefault(str(token), _vllm_logprob(value, i + 1, text(token)))
        out.append(entry)
    return out


def _vllm_logprob(value: float, rank: int, token: str) -> dict[str, Any]:
    return {"logprob": value, "rank": rank or None, "decoded_token": token}
