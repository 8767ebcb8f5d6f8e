"""A request's grammar at work: a matcher per request, masks over a batch (llguidance).

The prefill draws the first token with a fresh matcher; the decode builds its own and feeds
it that token and every later one. A matcher's state is a function of the tokens it consumed,
so a resumed or migrated request gets it back exactly by consuming its output again
(`Generator._replay`): there is no grammar state to send.

In a decode step every row with a grammar fills its row of one `[batch, vocab/32]` bitmask,
and one masking op sets the disallowed logits of the whole batch to -inf, before the logits
processors and the draw (so logprobs are those of what the request may get, like the other
processors'). A batch without grammars pays nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import llguidance.numpy as ln
import numpy as np
import torch

from pdserve_worker.model.sampling.grammar import GrammarError, first_line, grammar_tokenizer
from pdserve_worker.model.tokenizer import Tokenizer


@dataclass
class GrammarMatcher:
    """One request's matcher. `done` once the grammar is complete: nothing but EOS could follow,
    so the request ends there (finish reason stop), as vLLM ends a terminated grammar."""

    matcher: llguidance.LLMatcher

    @classmethod
    def start(cls, tokenizer: Tokenizer, vocab: int, grammar: str | None) -> GrammarMatcher | None:
        """A fresh matcher for `grammar` (None: the request has none)."""
        if grammar is None:
            return None
        matcher = llguidance.LLMatcher(grammar_tokenizer(tokenizer, vocab), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"grammar refused by the worker: {first_line(matcher.get_error())}")
        return cls(matcher)

    def consume(self, tokens: Sequence[int]) -> None:
        """Advance by `tokens`; GrammarError if the grammar does not allow one of them."""
        for token in tokens:
            if not self.matcher.consume_token(token):
                raise GrammarError(f"token {token} does not follow the grammar: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        return self.matcher.is_stopped()

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` `[vocab]` with every token the grammar does not allow next at -inf (in place)."""
        mask_rows(logits.view(1, -1), [self])
        return logits


@torch.inference_mode()  # (the decode step's logits are inference tensors)
def mask_rows(logits: torch.Tensor, grammars: Sequence[GrammarMatcher | None]) -> None:
    """Set, in place, the logits `[rows, vocab]` (fp32, host) of tokens each row's grammar does
    not allow next to -inf; rows whose grammar is None are left as they are."""
    rows = [row for row, g in enumerate(grammars) if g is not None]
    if not rows:
        return
    vocab = logits.shape[-1]
    # llguidance's numpy helpers, not its torch ones: importing llguidance.torch imports torch's
    # compiler stack (a torch.compile decorator at module level), ~1.2 s of every worker's start.
    bitmask = ln.allocate_token_bitmask(len(rows), vocab)
    for index, row in enumerate(rows):
        ln.fill_next_token_bitmask(grammars[row].matcher, bitmask, index)  # type: ignore[union-attr]
    # Unpacked here rather than with llguidance's apply_token_bitmask_inplace: its torch one is a
    # torch.compile kernel, which on a CPU host compiles C++ with gcc at the first request
    # (about 2 s, measured) and needs a compiler in the image. Bit i of an int32 word is bit i % 8
    # of its byte i // 8 (little-endian), which is what unpackbits' little bit order reads.
    bits = np.unpackbits(bitmask.view(np.uint8), axis=-1, bitorder="little", count=vocab)
    banned = ~torch.from_numpy(bits.view(np.bool_))
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(banned, float("-inf"))
    else:
        index = torch.tensor(rows)
        logits[index] = logits[index].masked_fill(banned, float("-inf"))
