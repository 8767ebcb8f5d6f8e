"""Logits processors: what a request's penalties, logit bias and min_tokens do to its logits.

Applied by the sampler (model/sampling/sampler.py) to one row of fp32 logits before temperature,
in this order, with the meanings clients expect:
- `logit_bias` (OpenAI): added to the token's logit;
- `min_tokens`: before that many tokens, EOS and the stop token ids cannot be drawn;
- `repetition_penalty` (HF's): every prompt and output token's logit divided by the penalty
  when positive, multiplied when negative;
- `presence_penalty` / `frequency_penalty` (OpenAI): a generated token's logit loses presence
  once and frequency per occurrence in the output;
- `bad_words` (token sequences: api/bad_words.py): a sequence's last token cannot be drawn where
  the output ends with the rest of it.
A request that uses none pays nothing. One that does keeps a `ProcessorState`: masks and bias
built once, output counts updated by new tokens only (benchmarks/processors.py measures it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pdserve_worker.model.sampling.params import SamplingParams


@dataclass
class ProcessorState:
    """One request's processor tensors over a vocabulary of `vocab`, kept between draws: the
    distinct tokens of prompt and output (repetition_penalty) and of the output with their
    counts (presence/frequency), grown by the new tokens only, so a draw touches those few
    indices rather than the whole vocabulary."""

    vocab: int
    counted: int = 0  # output tokens already counted
    out_counts: dict[int, int] = field(default_factory=dict)
    seen: set[int] = field(default_factory=set)
    seen_ids: torch.Tensor | None = None
    bias: tuple[torch.Tensor, torch.Tensor] | None = None
    _stops: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)
    _out: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, counts) of out_counts

    def update(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        if self.seen_ids is None or len(output_ids) < self.counted:  # new, or another history
            self.counted, self.out_counts, self._out = 0, {}, None
            self.seen = {t for t in prompt_ids if 0 <= t < self.vocab}
            self.seen_ids = torch.tensor(sorted(self.seen), dtype=torch.long)
        new = [t for t in output_ids[self.counted :] if 0 <= t < self.vocab]
        self.counted = len(output_ids)
        if not new:
            return
        for t in new:
            self.out_counts[t] = self.out_counts.get(t, 0) + 1
        self._out = None
        fresh = [t for t in dict.fromkeys(new) if t not in self.seen]
        if fresh:
            self.seen.update(fresh)
            self.seen_ids = torch.cat([self.seen_ids, torch.tensor(fresh, dtype=torch.long)])

    def output(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._out is None:
            ids = list(self.out_counts)
            self._out = (
                torch.tensor(ids, dtype=torch.long),
                torch.tensor([self.out_counts[t] for t in ids], dtype=torch.float32),
            )
        return self._out

    def biases(self, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
        if self.bias is None:
            pairs = [(t, b) for t, b in params.logit_bias if t < self.vocab]
            self.bias = (
                torch.tensor([t for t, _ in pairs], dtype=torch.long),
                torch.tensor([b for _, b in pairs], dtype=torch.float32),
            )
        return self.bias

    def stop_index(self, stop_ids: Sequence[int]) -> torch.Tensor:
        key = tuple(stop_ids)
        if key not in self._stops:
            self._stops[key] = torch.tensor([t for t in key if 0 <= t < self.vocab], dtype=torch.long)
        return self._stops[key]


def apply(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    stop_ids: Sequence[int] = (),
    state: ProcessorState | None = None,
) -> torch.Tensor:
    """`logits` [vocab] fp32, processed (a new tensor; the input is not changed). `state`
    carries the request's tensors from one call to the next (a fresh one when None)."""
    out = logits.to(torch.float32).clone()
    st = state if state is not None and state.vocab == out.numel() else ProcessorState(out.numel())
    if params.logit_bias:
        ids, bias = st.biases(params)
        out.index_add_(0, ids, bias)
    if params.min_tokens and len(output_ids) < params.min_tokens and stop_ids:
        out[st.stop_index(stop_ids)] = float("-inf")
    if params.bad_words:
        banned = [t for t in banned_tokens(params.bad_words, output_ids) if t < out.numel()]
        if banned:
            out[torch.tensor(banned, dtype=torch.long)] = float("-inf")
    penalised = params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty
    if not penalised:
        return out
    st.update(prompt_ids, output_ids)
    if params.repetition_penalty != 1.0 and st.seen_ids is not None and st.seen_ids.numel():
        rp = params.repetition_penalty
        values = out[st.seen_ids]
        out[st.seen_ids] = torch.where(values > 0, values / rp, values * rp)
    if (params.presence_penalty or params.frequency_penalty) and st.out_counts:
        ids, counts = st.output()
        out.index_add_(0, ids, -(params.frequency_penalty * counts + params.presence_penalty))
    return out


def banned_tokens(words: Sequence[Sequence[int]], output_ids: Sequence[int]) -> list[int]:
    """The tokens the next draw may not take: each sequence's last token where the output ends
    with the sequence's other tokens (a one-token word always), as vLLM's
    `_apply_bad_words_single_batch` decides (the output only, not the prompt)."""
    banned = []
    n = len(output_ids)
    for word in words:
        rest = len(word) - 1
        if rest > n:
            continue
        if rest == 0 or list(output_ids[n - rest :]) == list(word[:rest]):
            banned.append(word[-1])
    return banned
