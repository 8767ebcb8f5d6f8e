"""Turning logits into tokens, and deciding when a request is done.

A request that asks for logprobs gets, with each token, its log-probability and those of the
most likely alternatives: the log-softmax of the logits after the request's logits processors
(penalties, logit_bias, min_tokens) and before temperature, top-k, top-p and min_p. With no
processor that is the model's own distribution, vLLM's default `raw_logprobs`; the processors
are in because they define which tokens a request may get at all (a banned token has logprob
-inf), while the temperature and truncation only shape the draw.

Sampling runs on the host in fp32 with a torch.Generator per request that is re-seeded for
every output index from (request seed, index). So the k-th token of a request is drawn the
same way wherever it is drawn: the prefill worker can draw the first token and a decode
worker the rest, and a seeded request still gives exactly the text it gives in one process.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from pdserve_worker.model.sampling import processors
from pdserve_worker.model.sampling.grammar_mask import GrammarMatcher
from pdserve_worker.model.sampling.params import LOGPROB_FLOOR, SamplingParams, TokenLogprobs
from pdserve_worker.model.tokenizer import Tokenizer

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads consecutive indices over the seed space


def _index_seed(seed: int, index: int) -> int:
    return (seed * _MIX + index * 0xBF58476D1CE4E5B9 + 1) % (1 << 63)


def rows_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprobs]:
    """`TokenLogprobs` of `tokens[r]` under row r of `logits` `[rows, vocab]`, each with `top`
    alternatives: one log-softmax, one gather and one top-k over all the rows."""
    logprobs = torch.log_softmax(logits.to("cpu", torch.float32), dim=-1).clamp(min=LOGPROB_FLOOR)
    picked = logprobs.gather(1, torch.as_tensor(list(tokens), dtype=torch.long)[:, None])
    # vLLM's rank (vllm/v1/sample/ops/logprobs.py, batched_count_greater_than): tokens at least as likely.
    ranks = (logprobs >= picked).sum(dim=-1).tolist()
    chosen = picked[:, 0].tolist()
    if not top:
        return [TokenLogprobs(c, rank=r) for c, r in zip(chosen, ranks, strict=True)]
    values, ids = torch.topk(logprobs, min(top, logprobs.shape[-1]), dim=-1)
    pairs = zip(ids.tolist(), values.tolist(), strict=True)
    return [
        TokenLogprobs(c, tuple(zip(i, v, strict=True)), r) for c, (i, v), r in zip(chosen, pairs, ranks, strict=True)
    ]


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """`TokenLogprobs` of `token` under `logits` `[vocab]` (fp32), with `top` alternatives."""
    return rows_logprobs(logits.reshape(1, -1), [token], top)[0]


PROMPT_LOGPROB_ROWS = 128  # prompt positions whose logits exist at once (x vocab x 4 bytes)


def prompt_token_logprobs(
    head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, prompt: Sequence[int], top: int
) -> tuple[TokenLogprobs, ...]:
    """Logprobs of prompt tokens 1..n-1, each under the model's logits at the position before it
    (no processors: they act on outputs), from the final hidden states `[n, hidden]` of the prompt.
    The head runs on `PROMPT_LOGPROB_ROWS` positions at a time, so a long prompt never holds
    its whole `[n, vocab]` logits."""
    following = list(prompt[1:])
    out: list[TokenLogprobs] = []
    for begin in range(0, len(following), PROMPT_LOGPROB_ROWS):
        tokens = following[begin : begin + PROMPT_LOGPROB_ROWS]
        out += rows_logprobs(head(hidden[begin : begin + len(tokens)]), tokens, top)
    return tuple(out)


@dataclass(frozen=True)
class Draw:
    """A sampled token, with its logprobs when the request asked for them (and, when it asked for
    them, the prompt's: tokens 1..n-1)."""

    token: int
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None


class Sampler:
    """Draws one request's tokens according to its SamplingParams."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        # A request without a seed still gets one, so its draws are reproducible once known.
        self.seed = params.seed if params.seed is not None else random.SystemRandom().randrange(1 << 62)
        self._generator = torch.Generator(device="cpu")
        self._processing: processors.ProcessorState | None = None  # built on the first processed draw

    def sample(
        self,
        logits: torch.Tensor,
        index: int,
        prompt_ids: Sequence[int] = (),
        output_ids: Sequence[int] = (),
        stop_ids: Sequence[int] = (),
    ) -> int:
        """The token for output position `index` (0 = first generated token) from logits `[vocab]`;
        the request's logits processors (model/sampling/processors.py) see its prompt, its output so far
        and the token ids that would stop it."""
        return self.draw(logits, index, prompt_ids, output_ids, stop_ids).token

    def draw(
        self,
        logits: torch.Tensor,
        index: int,
        prompt_ids: Sequence[int] = (),
        output_ids: Sequence[int] = (),
        stop_ids: Sequence[int] = (),
    ) -> Draw:
        """`sample`, and the token's logprobs when the request asks for them."""
        p = self.params
        logits = logits.detach().to("cpu", torch.float32).reshape(-1)
        if p.processed:
            if self._processing is None or self._processing.vocab != logits.numel():
                self._processing = processors.ProcessorState(logits.numel())
            logits = processors.apply(logits, p, prompt_ids, output_ids, stop_ids, self._processing)
        token = self._choose(logits, index)
        return Draw(token, None if p.logprobs is None else token_logprobs(logits, token, p.logprobs))

    def _choose(self, logits: torch.Tensor, index: int) -> int:
        p = self.params
        if p.greedy:
            return int(torch.argmax(logits))
        scaled = logits / p.temperature
        if p.top_k and p.top_k < scaled.numel():
            values, candidates = torch.topk(scaled, p.top_k)
        else:
            values, candidates = torch.sort(scaled, descending=True)
        probs = torch.softmax(values, dim=-1)
        if p.min_p > 0.0:  # vLLM's min_p: below min_p x the most likely token's probability is out
            probs = torch.where(probs >= p.min_p * probs[0], probs, torch.zeros_like(probs))
        if p.top_p < 1.0:
            # Keep the smallest prefix whose mass reaches top_p. The most likely token always
            # stays, explicitly: a top_p that rounds to 0 in float32 would keep nothing (vLLM's
            # `apply_top_k_top_p` likewise never masks the last token of its ascending sort).
            before = torch.cumsum(probs, dim=-1) - probs
            keep = before < p.top_p
            keep[0] = True
            probs = torch.where(keep, probs, torch.zeros_like(probs))
        self._generator.manual_seed(_index_seed(self.seed, index))
        choice = torch.multinomial(probs, 1, generator=self._generator)
        return int(candidates[choice])


def draw_first(
    logits: torch.Tensor,
    params: SamplingParams,
    tokens: Sequence[int],
    num_generated: int,
    stop_ids: Sequence[int],
    tokenizer: Tokenizer | None = None,
) -> Draw:
    """The token a prefill draws after `tokens`: the prompt, then (resuming) the `num_generated`
    tokens already streamed, which are the request's output to its logits processors (and to its
    grammar, which only a `tokenizer` can turn into masks)."""
    split = len(tokens) - num_generated
    if params.grammar is not None:
        if tokenizer is None:
            raise ValueError("a request with a grammar is drawn with the tokenizer (none was given)")
        matcher = GrammarMatcher.start(tokenizer, logits.shape[-1], params.grammar)
        matcher.consume(tokens[split:])
        logits = matcher.mask(logits.detach().to("cpu", torch.float32).reshape(-1).clone())
    return Sampler(params).draw(logits, num_generated, tokens[:split], tokens[split:], stop_ids)


def sample_first(
    logits: torch.Tensor,
    params: SamplingParams,
    tokens: Sequence[int],
    num_generated: int,
    stop_ids: Sequence[int],
    tokenizer: Tokenizer | None = None,
) -> int:
    """`draw_first`'s token."""
    return draw_first(logits, params, tokens, num_generated, stop_ids, tokenizer).token


@dataclass
class StopStringMatcher:
    """Finds stop strings in streamed text without ever emitting a part of one.

    The one place that decides a stop string ended a request (the router does not cut text).
    The longest tail of the text that could still begin a stop string is held back until the
    next delta settles it. The stop string that completes first wins: the earliest end, the
    longest of those ending there; the text is cut right before it. That is what a
    character-by-character stream would see, so the answer does not depend on how the text
    was split into tokens or deltas. Upstream servers decide per token instead, and differ when
    one token completes two stops (stops "abcd" and "bc", token "abcd"): llama.cpp's
    `find_stopping_strings` keeps the earliest start (""), vLLM's `StopChecker` the first of
    the request's list; here "bc" completed first, so the answer is "a", as for tokens
    "a", "bc", "d".

    `include` (vLLM's include_stop_str_in_output) keeps the matched stop string at the end of
    the text instead of cutting it; the text after it is cut either way.
    """

    stop: tuple[str, ...]
    include: bool = False
    _pending: str = ""
    matched: str | None = None

    def feed(self, delta: str) -> str:
        """Text safe to emit now; after a match, `matched` is set and nothing more comes out."""
        if self.matched is not None:
            return ""
        text = self._pending + delta
        if not self.stop:
            self._pending = ""
            return text
        # Emitted text holds no stop string and no stop string's beginning, so every occurrence
        # ends in this delta; `find` gives each stop's first, hence earliest-ending, occurrence.
        hits = [(i + len(s), i, s) for s in self.stop if (i := text.find(s)) >= 0]
        if hits:
            end, index, self.matched = min(hits)
            self._pending = ""
            return text[: end if self.include else index]
        hold = self._held_tail(text)
        self._pending = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold]

    def finish(self) -> str:
        """At the end of generation the held tail is plain text."""
        rest, self._pending = ("" if self.matched is not None else self._pending), ""
        return rest

    def _held_tail(self, text: str) -> int:
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if s.startswith(text[len(text) - n :]):
                    longest = n
                    break
        return longest


def stop_token_ids(params: SamplingParams, eos_token_ids: Iterable[int]) -> frozenset[int]:
    """Token ids that end this request (EOS unless ignore_eos, plus the request's own)."""
    ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        ids.update(eos_token_ids)
    return frozenset(ids)
