"""A layer-sharded decode step: the hidden state travels member to member, the last one samples.

A decode group of N members splits the model's layers into balanced contiguous ranges
(`pdserve_common.kv_layout.shard_layers`). Member i holds the weights and the KV pool of its range only, so a
model too large for one device's KV budget still decodes with long contexts. One decode step
of a batch: member 0 embeds the batch's tokens, every member runs `run_layers` over its
range (reading and writing only its own pool), and the last member applies the final norm
and the LM head. The hop between members is a `HiddenHop` callable: in one process a plain
function call (`local_hop`), across processes an RPC carrying the hidden state.

`GroupKV` and `LayerShardDecoder` present the group to the engine's `Generator` as one model and
one pool (the Generator only needs `layout.num_slots` / `layout.max_len` of its cache and
`decode_step` of its model), so continuous batching, sampling and stop handling are the very
same code an unsharded decode runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from pdserve_common.kv_layout import KVLayout, shard_layers
from pdserve_worker.kv.cache import KVCache, torch_dtype
from pdserve_worker.model.config import ModelConfig
from pdserve_worker.model.layers.llama import LlamaModel


@dataclass(frozen=True)
class LayerShardMember:
    """One member of a decode group: a model holding (at least) `layers`, and its pool of them."""

    model: LlamaModel
    cache: KVCache

    def __post_init__(self) -> None:
        held = self.cache.layout.layer_range
        missing = [layer for layer in held if layer not in self.model.layers]
        if missing:
            raise ValueError(f"member's pool holds layers {held} but its model lacks weights of {missing}")

    @property
    def layers(self) -> range:
        return self.cache.layout.layer_range

    def forward(self, hidden: torch.Tensor, slots: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """This member's share of a step: its layers over `hidden [B, T, hidden]`."""
        return self.model.run_layers(hidden, self.layers, self.cache, slots, positions)


# (member index, hidden, slots, positions) -> the member's output hidden state.
HiddenHop = Callable[[int, torch.Tensor, Sequence[int], Sequence[int]], torch.Tensor]


def local_hop(members: Sequence[LayerShardMember]) -> HiddenHop:
    """Members in this process: the hop is a direct call."""

    def hop(index: int, hidden: torch.Tensor, slots: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        return members[index].forward(hidden, slots, positions)

    return hop


def check_group_layouts(layouts: Sequence[KVLayout], num_layers: int) -> None:
    """The members' pools must tile 0..num_layers-1 in order, with equal slots and geometry:
    a gap would skip a layer, an overlap would compute one twice."""
    if not layouts:
        raise ValueError("a decode group needs at least one member")
    expected = 0
    for i, lay in enumerate(layouts):
        if lay.first_layer != expected:
            raise ValueError(f"member {i} starts at layer {lay.first_layer}, expected {expected} (ranges must tile)")
        expected = lay.layer_range.stop
        first = layouts[0]
        for attr in ("num_slots", "max_len", "kv_heads", "head_dim", "dtype"):
            if getattr(lay, attr) != getattr(first, attr):
                raise ValueError(f"member {i} has {attr}={getattr(lay, attr)!r}, member 0 has {getattr(first, attr)!r}")
    if expected != num_layers:
        raise ValueError(f"the members hold layers 0..{expected - 1}, the model has {num_layers}")


def member_layouts(full: KVLayout, shards: int) -> list[KVLayout]:
    """The pools of a group of `shards` members for a model whose whole pool would be `full`."""
    return [replace(full, first_layer=r.start, num_layers=len(r)) for r in shard_layers(full.num_layers, shards)]


class GroupKV:
    """The group's pools seen as one: `layout` is the whole model's geometry (what the
    Generator reads: slots, max_len), `layouts` the members' own."""

    def __init__(self, layouts: Sequence[KVLayout], num_layers: int) -> None:
        check_group_layouts(layouts, num_layers)
        self.layouts = tuple(layouts)
        self.layout = replace(layouts[0], first_layer=0, num_layers=num_layers)

    @property
    def dtype(self) -> torch.dtype:
        """The members' KV dtype (check_group_layouts makes them agree): the Generator checks
        it against the model's, as it does for one pool."""
        return torch_dtype(self.layout.dtype)


class HeadModel(Protocol):
    """What a group's leader embeds and samples with: a LlamaModel, or a group engine
    (engines/base.GroupEngine) over one."""

    @property
    def config(self) -> ModelConfig: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

    def embed(self, token_ids: Sequence[Sequence[int]]) -> torch.Tensor: ...

    def head(self, hidden: torch.Tensor) -> torch.Tensor: ...


class LayerShardDecoder:
    """`decode_step` over a decode group; `head_model` embeds and applies the head (member 0's
    and the last member's LlamaModel both carry the embedding and head weights)."""

    def __init__(self, head_model: HeadModel, layouts: Sequence[KVLayout], hop: HiddenHop) -> None:
        check_group_layouts(layouts, head_model.config.num_layers)
        self.model = head_model
        self.config = head_model.config
        self.dtype = head_model.dtype
        self.device = head_model.device
        self.layouts = tuple(layouts)
        self._hop = hop

    @classmethod
    def local(cls, members: Sequence[LayerShardMember]) -> LayerShardDecoder:
        return cls(members[0].model, [m.cache.layout for m in members], local_hop(members))

    @torch.inference_mode()
    def decode_step(
        self,
        cache: GroupKV | KVCache | None,
        slots: Sequence[int],
        positions: Sequence[int],
        token_ids: Sequence[int],
    ) -> torch.Tensor:
        """Logits `[B, vocab]` of one token per slot, as `LlamaModel.decode_step` (the `cache`
        argument is the Generator's view and is not read: each member writes its own pool)."""
        if not (len(slots) == len(positions) == len(token_ids)) or not slots:
            raise ValueError(
                f"decode_step needs equally long, non-empty slots/positions/token_ids, got "
                f"{len(slots)}/{len(positions)}/{len(token_ids)}"
            )
        hidden = self.model.embed([[t] for t in token_ids])
        for index in range(len(self.layouts)):
            hidden = self._hop(index, hidden, slots, positions)
        return self.model.head(hidden[:, 0])
