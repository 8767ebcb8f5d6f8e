"""Tensor parallelism inside one instance: which share of the model each rank holds (pure).

Megatron's split: Q/K/V and gate/up by output rows (whole heads, a slice of the MLP's units),
o_proj and down_proj by input columns, so one all_reduce per projection completes each
(`ModelPart(reduce=...)`); RMSNorm, RoPE, q/k norms, attention and the KV cache run on the
rank's own heads unchanged.
- Heads: `num_heads / tp` query heads per rank; `num_kv_heads / tp` KV heads when tp divides
  them, else each KV head replicated on `tp / num_kv_heads` ranks; other sizes are refused,
  naming those that work.
- MLP units: contiguous slices in units of 32 columns where the size allows (whole quantized blocks).
- Embedding and LM head are replicated (a vocabulary split adds an all_gather per step); only
  rank 0 runs the head. o_proj's bias is added by rank 0 alone; q/k/v biases split with rows.
A rank pushes every KV head it holds except a replica: of the ranks holding one KV head, the
first pushes it (`pushed_kv_heads`), so a request's KV is pushed exactly once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from pdserve_worker.model.config import ModelConfig

if TYPE_CHECKING:  # (the shares are arithmetic: `pdserve info --tp` runs without torch)
    import torch

# The quantized routes' block of input columns (model/layers/quant_blocks.py GROUP): MLP slices
# are whole multiples of it where the intermediate size allows.
_ALIGN = 32


def valid_sizes(config: ModelConfig) -> list[int]:
    """Every tensor-parallel size the model's heads can be split into."""
    heads, kv = config.num_heads, config.num_kv_heads
    return [t for t in range(1, heads + 1) if heads % t == 0 and (kv % t == 0 or t % kv == 0)]


def check_size(config: ModelConfig, size: int) -> None:
    """ValueError naming the heads and the sizes that would work, when `size` does not split them."""
    if size in valid_sizes(config):
        return
    raise ValueError(
        f"tensor-parallel size {size} does not split the model's {config.num_heads} query heads over "
        f"{config.num_kv_heads} KV heads (each rank needs whole query heads, and the KV heads must divide "
        f"or be divided by the size); sizes that work: {valid_sizes(config)}"
    )


@dataclass(frozen=True)
class TPShard:
    """Rank `rank` of a tensor-parallel group of `size` ranks over the model `config` (the whole model's)."""

    config: ModelConfig
    size: int
    rank: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} outside 0..{self.size - 1}")
        check_size(self.config, self.size)

    @property
    def heads(self) -> range:
        """The query heads this rank computes."""
        per = self.config.num_heads // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    @property
    def kv_heads(self) -> range:
        """The KV heads this rank holds (one replicated head when the size exceeds the KV heads)."""
        kv = self.config.num_kv_heads
        if self.size <= kv:
            per = kv // self.size
            return range(self.rank * per, (self.rank + 1) * per)
        head = self.rank // (self.size // kv)
        return range(head, head + 1)

    @property
    def pushed_kv_heads(self) -> range:
        """The KV heads this rank pushes to decode: its own, unless an earlier rank holds them too."""
        kv = self.config.num_kv_heads
        if self.size <= kv or self.rank % (self.size // kv) == 0:
            return self.kv_heads
        return range(self.kv_heads.start, self.kv_heads.start)

    @property
    def intermediate(self) -> range:
        """The MLP hidden units this rank computes (contiguous, in 32-unit blocks where possible)."""
        size = self.config.intermediate_size
        unit = _ALIGN if size % _ALIGN == 0 and size // _ALIGN >= self.size else 1
        units = size // unit
        return range(self.rank * units // self.size * unit, (self.rank + 1) * units // self.size * unit)

    @property
    def local_config(self) -> ModelConfig:
        """The model as this rank runs it: its heads, its KV heads, its share of the MLP."""
        return replace(
            self.config,
            num_heads=len(self.heads),
            num_kv_heads=len(self.kv_heads),
            intermediate_size=len(self.intermediate),
        )


def shard_weights(shard: TPShard, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The rank's tensors by HF name, with the shapes its `local_config` implies: slices (views:
    nothing is copied until the model takes them) of the layers' matrices, the rest as they are."""
    import torch

    d = shard.config.head_dim
    q = slice(shard.heads.start * d, shard.heads.stop * d)
    kv = slice(shard.kv_heads.start * d, shard.kv_heads.stop * d)
    mlp = slice(shard.intermediate.start, shard.intermediate.stop)
    rows = {
        "self_attn.q_proj.weight": q,
        "self_attn.q_proj.bias": q,
        "self_attn.k_proj.weight": kv,
        "self_attn.k_proj.bias": kv,
        "self_attn.v_proj.weight": kv,
        "self_attn.v_proj.bias": kv,
        "mlp.gate_proj.weight": mlp,
        "mlp.up_proj.weight": mlp,
    }
    columns = {"self_attn.o_proj.weight": q, "mlp.down_proj.weight": mlp}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        part = name.split(".", 3)[-1] if name.startswith("model.layers.") else ""
        if part in rows:
            out[name] = tensor[rows[part]]
        elif part in columns:
            out[name] = tensor[:, columns[part]]
        elif part == "self_attn.o_proj.bias" and shard.rank:
            out[name] = torch.zeros_like(tensor)  # added once over the group: by rank 0
        else:
            out[name] = tensor
    return out
