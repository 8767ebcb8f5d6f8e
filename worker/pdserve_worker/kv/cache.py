"""The KV pool as a tensor: typed views over memory that someone else may own.

A decode worker's pool is registered with the transfer engine before any request arrives, and
the engine may hand us a tensor built with `torch.frombuffer` over shared memory. Prefill
pushes bytes straight into that memory, so the model must read and write the very same
storage: `KVCache` only ever views the tensor it is given and never reallocates, copies or
resizes it. The layout (slot, layer, K|V, token, kv_head, head_dim) is DESIGN.md's and
`KVLayout`'s; a pool that holds only a layer range is indexed by `layer - first_layer`.
"""

from __future__ import annotations

import torch

from pdserve_common.kv_layout import K, KVLayout, V, local_layer_index

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a layout/config dtype name ("bfloat16", ...)."""
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; expected one of {sorted(TORCH_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """The layout/config name of a torch dtype (inverse of `torch_dtype`)."""
    for name, value in TORCH_DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported torch dtype {dtype}; expected one of {sorted(TORCH_DTYPES)}")


class KVCache:
    """A KV pool of `layout.shape`, viewed per layer as K and V of `[slot, token, kv_head, head_dim]`."""

    def __init__(self, layout: KVLayout, tensor: torch.Tensor) -> None:
        if tuple(tensor.shape) != layout.shape:
            raise ValueError(f"KV pool tensor has shape {tuple(tensor.shape)}, layout needs {layout.shape}")
        if tensor.dtype != torch_dtype(layout.dtype):
            raise ValueError(f"KV pool tensor has dtype {tensor.dtype}, layout needs {layout.dtype}")
        if not tensor.is_contiguous():
            # Offsets in KVLayout are byte offsets from the base: a strided view would break them.
            raise ValueError(f"KV pool tensor must be contiguous, got strides {tensor.stride()}")
        self.layout = layout
        self.tensor = tensor
        # Per-layer views made once: a decode step asks for them 60 times.
        self._keys = [tensor[:, i, K] for i in range(layout.num_layers)]
        self._values = [tensor[:, i, V] for i in range(layout.num_layers)]

    @classmethod
    def allocate(cls, layout: KVLayout, device: str | torch.device = "cpu") -> KVCache:
        """A zeroed pool of its own (tests, prefill workers, colocated generation)."""
        return cls(layout, torch.zeros(layout.shape, dtype=torch_dtype(layout.dtype), device=device))

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    def local_layer(self, layer: int) -> int:
        """Index into this pool of model layer `layer`; an error if the pool does not hold it."""
        return local_layer_index(self.layout.layer_range, layer)

    def keys(self, layer: int) -> torch.Tensor:
        """View `[slot, token, kv_head, head_dim]` of layer `layer`'s keys (writes go to the pool)."""
        return self._keys[self.local_layer(layer)]

    def values(self, layer: int) -> torch.Tensor:
        """View `[slot, token, kv_head, head_dim]` of layer `layer`'s values (writes go to the pool)."""
        return self._values[self.local_layer(layer)]

    def slot(self, slot: int) -> torch.Tensor:
        """View `[layer, K|V, token, kv_head, head_dim]` of one slot."""
        if not 0 <= slot < self.layout.num_slots:
            raise IndexError(f"slot {slot} outside pool of {self.layout.num_slots} slots")
        return self.tensor[slot]

    def clear_slot(self, slot: int) -> None:
        """Zero one slot, in place (a released slot must not leak a previous request's KV)."""
        self.slot(slot).zero_()

    def __repr__(self) -> str:
        return f"KVCache(layout={self.layout!r}, device={self.device})"
