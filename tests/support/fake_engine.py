"""An engine package outside pdserve, for the engine seam's test: `PDSERVE_ENGINE=support.fake_engine:FakeEngine`.

It computes nothing a model would. Its KV is the prompt itself: at every layer, a token's keys
hold its id and its values its position. Its next token is (sum of the ids its KV holds + their
count) mod vocab, read from the KV at every layer, so the decode's tokens are right only if
every layer chunk the prefill wrote arrived whole in the decode's own blocks. `expected()` is
that rule in plain Python. It reads only config.json and the tokenizer of a model folder.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from pdserve_common.kv_layout import KVLayout
from pdserve_worker.engines.base import EngineError, EngineLoad, PrefillPass
from pdserve_worker.kv.cache import KVCache, torch_dtype
from pdserve_worker.kv.paged import PagedKVCache
from pdserve_worker.model.config import ModelConfig
from pdserve_worker.model.loading.generation_config import GenerationDefaults
from pdserve_worker.model.sampling.params import TokenLogprobs
from pdserve_worker.model.tokenizer import Tokenizer

LOGIT = 50.0  # the picked token's logit (every other is 0): greedy and sampled draws agree


def expected(prompt: Sequence[int], count: int, vocab: int) -> list[int]:
    """The `count` tokens the fake engine generates after `prompt`."""
    seq, out = list(prompt), []
    for _ in range(count):
        out.append((sum(seq) + len(seq)) % vocab)
        seq.append(out[-1])
    return out


class FakeEngine:
    capabilities: frozenset[str] = frozenset()  # no tensor-parallel or layer-sharded groups

    def __init__(self, folder: Path, dtype: str) -> None:
        self.config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
        self.tokenizer = Tokenizer.from_dir(folder, extra_eos_token_ids=self.config.eos_token_ids)
        self.generation = GenerationDefaults.from_folder(folder)
        self.name, self.tp = f"fake-{folder.name}", None
        self._dtype = torch_dtype(dtype)

    @classmethod
    def check_installed(cls) -> None:
        """Nothing runs elsewhere: the fake engine is this file."""

    @classmethod
    def load(cls, request: EngineLoad) -> FakeEngine:
        if request.source is None:
            raise EngineError("the fake engine needs a model folder (its config.json and tokenizer)")
        return cls(Path(request.source), request.dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def kv_layout(self, num_slots: int, max_len: int, dtype: str, first_head: int = 0) -> KVLayout:
        return self.config.kv_layout(num_slots, max_len, dtype, first_head=first_head)

    def bind_pool(self, layout: KVLayout, memory: torch.Tensor) -> KVCache | PagedKVCache:
        self.bound: set[int] = set()  # slots whose blocks a step may read (bind_blocks .. free_blocks)
        return PagedKVCache(layout, memory) if layout.paged else KVCache(layout, memory)

    def bind_blocks(self, cache: Any, slot: int, blocks: Sequence[int]) -> None:
        cache.bind(slot, blocks)
        self.bound.add(slot)

    def free_blocks(self, cache: Any, slot: int) -> None:
        if cache.layout.paged:
            cache.unbind(slot)
            self.bound.discard(slot)

    def prefill(self, cache: KVCache, work: PrefillPass) -> torch.Tensor:
        layers = self.config.num_layers
        step = work.layers_per_chunk or layers
        for first in range(0, layers, step):
            chunk = range(first, min(first + step, layers))
            for prompt, slot, start in zip(work.prompts, work.slots, work.starts, strict=True):
                ids = torch.tensor(prompt[start:], dtype=self._dtype)
                positions = torch.arange(start, len(prompt), dtype=self._dtype)
                for layer in chunk:
                    cache.keys(layer)[slot, start : len(prompt)] = ids[:, None, None]
                    cache.values(layer)[slot, start : len(prompt)] = positions[:, None, None]
            if work.on_chunk is not None:
                work.on_chunk(chunk)
        rows = [
            self._next(cache.keys, _prompt_rows(slot, len(p))) for p, slot in zip(work.prompts, work.slots, strict=True)
        ]
        return torch.stack(rows) if work.logits else torch.empty(0)

    def decode_step(
        self, cache: Any, slots: Sequence[int], positions: Sequence[int], token_ids: Sequence[int]
    ) -> torch.Tensor:
        rows = []
        for slot, position, token in zip(slots, positions, token_ids, strict=True):
            read, write = self._where(cache, slot, position)
            for layer in range(self.config.num_layers):
                cache.keys(layer)[write] = float(token)
                cache.values(layer)[write] = float(position)
            rows.append(self._next(cache.keys, lambda layer, r=read: r))
        return torch.stack(rows)

    def _where(self, cache: Any, slot: int, position: int) -> tuple[Any, Any]:
        """Indexes of a slot's tokens 0..position (read) and of its token at `position` (write)."""
        if isinstance(cache, PagedKVCache):
            if slot not in self.bound:  # the role must bind a request's blocks before it decodes
                raise EngineError(f"decode step of slot {slot}, whose blocks were never bound or were freed")
            rows = cache.token_rows(slot, 0, position + 1)
            return rows, rows[-1:]
        return (slot, slice(0, position + 1)), (slot, slice(position, position + 1))

    def _next(self, keys: Any, index: Any) -> torch.Tensor:
        """One-hot logits of the rule's token, from the KV of every layer (all must agree)."""
        sums = {int(keys(layer)[index(layer)][..., 0, 0].sum()) for layer in range(self.config.num_layers)}
        count = int(keys(0)[index(0)][..., 0, 0].numel())
        logits = torch.zeros(self.config.vocab_size)
        if len(sums) == 1:  # a layer that disagrees (a lost chunk) picks token 0 instead
            logits[(sums.pop() + count) % self.config.vocab_size] = LOGIT
        return logits

    def prompt_logprobs(self, states: torch.Tensor, prompt: Sequence[int], top: int) -> tuple[TokenLogprobs, ...]:
        raise EngineError("the fake engine keeps no hidden states")

    def warm_up(self) -> float:
        return 0.0


def _prompt_rows(slot: int, length: int) -> Any:
    """Per layer, the index of a slot's first `length` tokens in a slot pool."""
    return lambda layer: (slot, slice(0, length))
