"""pdserve's own engine: the torch model of model/ (LlamaModel) as an `Engine`.

It runs dense LLaMA-block models in torch eager on the CPU (with the native kernels), CUDA or
an NPU. It declares TENSOR_PARALLEL and LAYER_SHARDS, so it is also a `GroupEngine`: the groups
reach its model through `layers`, `device`, `embed`, `forward_layers` and `head`, which delegate
to the LlamaModel.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pdserve_common.kv_layout import KVLayout
from pdserve_worker.engines.base import LAYER_SHARDS, TENSOR_PARALLEL, EngineLoad, PrefillPass
from pdserve_worker.kv.cache import KVCache
from pdserve_worker.kv.paged import PagedKVCache
from pdserve_worker.model.engine import warm_up
from pdserve_worker.model.layers.llama import LlamaModel, PrefillOutputs
from pdserve_worker.model.loading.loader import LoadedModel, load_model
from pdserve_worker.model.sampling.params import TokenLogprobs
from pdserve_worker.model.sampling.sampler import prompt_token_logprobs


class NativeEngine:
    """A `LoadedModel` behind the `Engine` and `GroupEngine` contracts (engines/base.py)."""

    capabilities = frozenset({TENSOR_PARALLEL, LAYER_SHARDS})

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self.model: LlamaModel = loaded.model
        self.name, self.config, self.tokenizer = loaded.name, loaded.config, loaded.tokenizer
        self.generation, self.tp = loaded.generation, loaded.tp

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def layers(self) -> range:
        return self.model.layer_range

    @property
    def device(self) -> torch.device:
        return self.model.device

    def kv_layout(self, num_slots: int, max_len: int, dtype: str, first_head: int = 0) -> KVLayout:
        return self.config.kv_layout(num_slots, max_len, dtype, first_head=first_head)

    def bind_pool(self, layout: KVLayout, memory: torch.Tensor) -> KVCache | PagedKVCache:
        held = layout.layer_range
        if held.start < self.layers.start or held.stop > self.layers.stop:
            raise ValueError(f"a pool of layers {held} needs their weights; engine {self.name!r} holds {self.layers}")
        return PagedKVCache(layout, memory) if layout.paged else KVCache(layout, memory)

    def bind_blocks(self, cache: Any, slot: int, blocks: Sequence[int]) -> None:
        if cache.layout.paged:
            cache.bind(slot, blocks)

    def free_blocks(self, cache: Any, slot: int) -> None:
        if cache.layout.paged:
            cache.unbind(slot)

    def prefill(self, cache: KVCache, work: PrefillPass) -> torch.Tensor:
        outputs = PrefillOutputs(work.logits, work.on_final)
        if len(work.prompts) == 1:
            logits = self.model.prefill(
                list(work.prompts[0]),
                cache,
                work.slots[0],
                work.layers_per_chunk,
                work.on_chunk,
                start=work.starts[0],
                outputs=outputs,
            )
            return logits[None] if work.logits else logits
        return self.model.prefill_batch(
            [list(p) for p in work.prompts],
            cache,
            list(work.slots),
            work.layers_per_chunk,
            work.on_chunk,
            starts=list(work.starts),
            outputs=outputs,
        )

    def decode_step(
        self, cache: Any, slots: Sequence[int], positions: Sequence[int], token_ids: Sequence[int]
    ) -> torch.Tensor:
        return self.model.decode_step(cache, slots, positions, token_ids)

    def embed(self, token_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        return self.model.embed(token_ids)

    def forward_layers(
        self, hidden: torch.Tensor, cache: Any, slots: Sequence[int], positions: Sequence[int]
    ) -> torch.Tensor:
        return self.model.run_layers(hidden, cache.layout.layer_range, cache, slots, positions)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.head(hidden)

    def prompt_logprobs(self, states: torch.Tensor, prompt: Sequence[int], top: int) -> tuple[TokenLogprobs, ...]:
        return prompt_token_logprobs(self.model.head, states, prompt, top)

    def warm_up(self) -> float:
        return warm_up(self.model)

    @classmethod
    def check_installed(cls) -> None:
        """Nothing to check: the native engine is this package's own (torch is a dependency)."""

    @classmethod
    def load(cls, request: EngineLoad) -> NativeEngine:
        """Load the model `request` names (model/loading/loader.py); check its context length."""
        tp = {} if request.tp is None else {"tp": request.tp, "reduce": request.reduce}
        loaded = load_model(request.source, request.dtype, request.device, request.layers, request.weights, **tp)
        loaded.config.check_max_len(request.max_length)  # spec.model.maxLength against the model's context
        return cls(loaded)
