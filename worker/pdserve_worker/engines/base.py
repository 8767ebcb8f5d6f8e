"""What the prefill and decode roles need from a model engine, and nothing more.

A role reaches the model only through `Engine`: it describes the KV pool the engine writes
(`kv_layout`), binds the pool memory the role registered with its transfer backend (`bind_pool`),
prefills a pass of prompts into given slots of that pool layer chunk by layer chunk (`prefill`,
calling `on_chunk` after each chunk so the push can overlap the compute), runs one decode step
for a batch (`decode_step`, the `Decoder` of model/engine.py), is told when a request's blocks
become readable and when they are freed (`bind_blocks`, `free_blocks`), and turns a prompt's kept
hidden states into logprobs. The role's slot table owns slots and blocks (their one release
path); the engine only stops reading what `free_blocks` names. An engine that declares
TENSOR_PARALLEL or LAYER_SHARDS also is a `GroupEngine` (its layers, device, embedding, a
layer range's forward, head): `group_engine` hands it to the groups by that declaration.
A new engine is one package with an `EngineType` and one line in registry.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch

from pdserve_common.kv_layout import KVLayout
from pdserve_worker.kv.cache import KVCache
from pdserve_worker.kv.paged import PagedKVCache
from pdserve_worker.model.config import ModelConfig
from pdserve_worker.model.layers.tensor_parallel import TPShard
from pdserve_worker.model.loading.generation_config import GenerationDefaults
from pdserve_worker.model.sampling.params import TokenLogprobs
from pdserve_worker.model.tokenizer import Tokenizer

# What an engine can run besides plain prefill and decode (the roles refuse the rest by name).
TENSOR_PARALLEL = "tensor_parallel"
LAYER_SHARDS = "layer_shards"


class EngineError(ValueError):
    """An engine that is not registered, cannot load, or is asked for what it does not run."""


@dataclass(frozen=True)
class EngineLoad:
    """What a worker asks an engine to load: the model source and where its share lies."""

    source: str | None  # a model folder or GGUF file; None: the bundled default
    dtype: str  # "bfloat16", "float32", ...
    device: str  # "cpu", "cuda:0", "npu:0"
    weights: str  # the weight route ("auto", "int4", ...)
    max_length: int  # the longest sequence the worker serves
    layers: range | None = None  # a layer-sharded member's layers (None: all)
    tp: tuple[int, int] | None = None  # (size, rank) of a tensor-parallel group
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # the group's all-reduce


@dataclass(frozen=True)
class PrefillPass:
    """One forward pass over prompts, each into its slot, each from its first uncached position."""

    prompts: Sequence[Sequence[int]]
    slots: Sequence[int]
    starts: Sequence[int]  # tokens of each prompt whose KV the slot already holds
    layers_per_chunk: int | None = None  # None: all layers in one chunk
    on_chunk: Callable[[range], None] | None = None  # after each chunk's KV is in the cache
    on_final: Callable[[torch.Tensor], None] | None = None  # the computed positions' final states
    logits: bool = True  # False: a tensor-parallel rank past 0 runs no head


class Engine(Protocol):
    """A loaded model, as the roles drive it (module doc). `capabilities` names what it runs
    besides plain prefill and decode (TENSOR_PARALLEL, LAYER_SHARDS)."""

    name: str
    config: ModelConfig  # a tensor-parallel rank's share
    tokenizer: Tokenizer
    generation: GenerationDefaults
    tp: TPShard | None
    capabilities: frozenset[str]

    @property
    def dtype(self) -> torch.dtype: ...

    def kv_layout(self, num_slots: int, max_len: int, dtype: str, first_head: int = 0) -> KVLayout:
        """The geometry of a pool of `num_slots` slots this engine writes and reads."""
        ...

    def bind_pool(self, layout: KVLayout, memory: torch.Tensor) -> KVCache | PagedKVCache:
        """The cache view this engine writes and reads over `memory`: the pool of `layout` (paged
        or not) that the role allocated and registered with its transfer backend."""
        ...

    def bind_blocks(self, cache: Any, slot: int, blocks: Sequence[int]) -> None:
        """A paged pool: the request in `slot` has its KV in `blocks` (token order); steps read them."""
        ...

    def free_blocks(self, cache: Any, slot: int) -> None:
        """The request in `slot` left: no step reads its blocks again (the role's table frees them)."""
        ...

    def prefill(self, cache: KVCache, work: PrefillPass) -> torch.Tensor:
        """Write the prompts' KV into their slots; each prompt's last-position logits `[B, vocab]`."""
        ...

    def decode_step(
        self, cache: Any, slots: Sequence[int], positions: Sequence[int], token_ids: Sequence[int]
    ) -> torch.Tensor:
        """Logits `[B, vocab]` of one token per slot (the token's KV is written at its position)."""
        ...

    def prompt_logprobs(self, states: torch.Tensor, prompt: Sequence[int], top: int) -> tuple[TokenLogprobs, ...]:
        """Logprobs of prompt tokens 1..n-1 from the prompt's final hidden states."""
        ...

    def warm_up(self) -> float:
        """Run what the first request would pay for; the seconds it took."""
        ...


class GroupEngine(Engine, Protocol):
    """What tensor-parallel ranks and layer-sharded members drive besides `Engine`: an engine
    declaring TENSOR_PARALLEL or LAYER_SHARDS implements it (reach it through `group_engine`)."""

    @property
    def layers(self) -> range:
        """The layers whose weights this engine holds (a layer-sharded member's share, else all)."""
        ...

    @property
    def device(self) -> torch.device: ...

    def embed(self, token_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """Hidden states `[B, T, hidden]` of token ids `[B, T]` (a group's first member runs it)."""
        ...

    def forward_layers(
        self, hidden: torch.Tensor, cache: Any, slots: Sequence[int], positions: Sequence[int]
    ) -> torch.Tensor:
        """`hidden [B, T, hidden]` through the layers `cache` holds, writing their KV at `positions`."""
        ...

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of hidden states `[..., hidden]` after the final norm (a group's leader samples)."""
        ...


def group_engine(engine: Engine, capability: str) -> GroupEngine:
    """`engine` as a group runs it, by its declared `capabilities`; EngineError names an engine
    that does not declare `capability` (the registry refuses those first: registry.load_engine)."""
    if capability not in engine.capabilities:
        raise EngineError(
            f"engine {engine.name!r} does not run {capability}: its capabilities are {sorted(engine.capabilities)}"
        )
    return cast(GroupEngine, engine)


class EngineType(Protocol):
    """An engine's class, as the registry names it: what it runs, and how it loads."""

    capabilities: frozenset[str]

    def check_installed(self) -> None:
        """Raise ModuleNotFoundError naming what the engine runs that is missing here (vLLM's own
        environment, say); return where nothing is. The launcher calls it before any process."""
        ...

    def load(self, request: EngineLoad) -> Engine:
        """The engine with the model `request` names, loaded and ready to warm up."""
        ...
