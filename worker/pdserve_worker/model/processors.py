"""Logits processors: what a request's penalties, logit bias and min_tokens do to its logits.

Applied by the sampler (model/sampling.py) to one row of fp32 logits before temperature, in
this order, with the meanings clients expect:
- `logit_bias` (OpenAI): the bias is added to the token's logit;
- `min_tokens` (vLLM): before that many tokens were generated, EOS and the stop token ids
  cannot be drawn (vLLM's MinTokensLogitsProcessor);
- `repetition_penalty` (HF transformers' RepetitionPenaltyLogitsProcessor, also vLLM's): every
  token of the prompt and the output has its logit divided by the penalty when positive,
  multiplied when negative;
- `presence_penalty` / `frequency_penalty` (OpenAI, vLLM's `apply_penalties`): a generated
  token's logit loses presence once and frequency per occurrence in the output.
Each is a handful of vectorized torch ops on the row (a scatter, a bincount), so a request that
uses none pays nothing (the sampler skips this module), and one that uses them pays O(vocab).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve_worker.model.sampling_params import SamplingParams


def apply(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    stop_ids: Sequence[int] = (),
) -> torch.Tensor:
    """`logits` [vocab] fp32, processed (a new tensor; the input is not changed)."""
    out = logits.clone()
    vocab = out.numel()
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias if t < vocab], dtype=torch.long)
        bias = torch.tensor([b for t, b in params.logit_bias if t < vocab], dtype=out.dtype)
        out.index_add_(0, ids, bias)
    if params.min_tokens and len(output_ids) < params.min_tokens and stop_ids:
        blocked = torch.tensor([t for t in stop_ids if 0 <= t < vocab], dtype=torch.long)
        out[blocked] = float("-inf")
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({t for t in (*prompt_ids, *output_ids) if 0 <= t < vocab}), dtype=torch.long)
        if seen.numel():
            values = out[seen]
            out[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and output_ids:
        counts = torch.bincount(torch.tensor(list(output_ids), dtype=torch.long), minlength=vocab)[:vocab]
        counts = counts.to(out.dtype)
        out -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(out.dtype)
    return out
