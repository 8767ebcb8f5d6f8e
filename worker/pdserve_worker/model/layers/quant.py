"""Quantized matrices in a plain, CPU-independent form: GGUF's Q4_0, Q4_1 and Q8_0 blocks, split.

A GGUF block covers 32 consecutive values of one row: Q4_1 holds an fp16 scale `d`, an fp16
minimum `m` and 16 bytes of nibbles (value j in the low nibble of byte j, value j + 16 in the
high one), meaning `d * q + m`; Q4_0 `d * (q - 8)`; Q8_0 `d` and 32 int8 values, `d * q`
(ggml-common.h). `QuantizedTensor` keeps exactly that as three arrays (nibbles or int8 values in
the file's byte order, fp32 scales and minimums), so that:
- `dequantize` gives bit for bit what `gguf.quants.dequantize` gives (tests/unit/test_quant.py);
- it does not depend on the CPU: torch packs int4 differently on AVX512 and AVX2, so the
  conversion cache stores this form and packing happens at load (`matmul.Linear.prepare`);
- rows can be permuted (Q/K unpermutation) and concatenated (fused QKV, gate/up) untouched.
Float weights become this form through `gguf.quants.quantize` (llama.cpp's reference rounding)
when `--weights int4` or `int8` asks for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdserve_worker.model.layers.quant_blocks import GROUP, Kind

_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


@dataclass(frozen=True)
class QuantizedTensor:
    """A `[rows, cols]` matrix stored in blocks of 32 values along each row.

    q4: `q` uint8 `[rows, cols // 2]` (each block's 16 bytes as GGUF stores them), value
    `scale * nibble + minimum`. q8: `q` int8 `[rows, cols]`, value `scale * q`.
    `scale` and `minimum` are fp32 `[rows, cols // 32]`.
    """

    kind: Kind
    q: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor | None = None

    def __post_init__(self) -> None:
        rows, groups = self.scale.shape
        width = groups * (GROUP // 2 if self.kind == "q4" else GROUP)
        if tuple(self.q.shape) != (rows, width):
            raise ValueError(
                f"{self.kind} values of shape {tuple(self.q.shape)} do not match scales {tuple(self.scale.shape)}"
            )
        if (self.kind == "q4") != (self.minimum is not None):
            raise ValueError(f"{self.kind} tensor {'needs' if self.kind == 'q4' else 'has no'} minimums")
        if self.minimum is not None and self.minimum.shape != self.scale.shape:
            raise ValueError(
                f"minimums of shape {tuple(self.minimum.shape)} differ from scales {tuple(self.scale.shape)}"
            )

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.scale.shape[0]), int(self.scale.shape[1]) * GROUP

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.minimum) if t is not None)

    def rows(self, index: torch.Tensor) -> QuantizedTensor:
        """The rows `index` (a permutation or a selection), values untouched."""
        return QuantizedTensor(
            self.kind,
            self.q[index].contiguous(),
            self.scale[index].contiguous(),
            None if self.minimum is None else self.minimum[index].contiguous(),
        )

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """The arrays under `prefix.qweight` / `.scales` / `.mins`, for a safetensors file."""
        out = {f"{prefix}.qweight": self.q, f"{prefix}.scales": self.scale}
        if self.minimum is not None:
            out[f"{prefix}.mins"] = self.minimum
        return out

    @classmethod
    def from_tensors(cls, get, prefix: str) -> QuantizedTensor:
        """Inverse of `tensors`; `get(name)` returns a stored array (the kind follows from q's dtype)."""
        q = get(f"{prefix}.qweight")
        if q.dtype == torch.uint8:
            return cls("q4", q, get(f"{prefix}.scales"), get(f"{prefix}.mins"))
        if q.dtype == torch.int8:
            return cls("q8", q, get(f"{prefix}.scales"))
        raise ValueError(f"{prefix}.qweight has dtype {q.dtype}; expected uint8 (q4) or int8 (q8)")


def from_gguf_blocks(data: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantizedTensor:
    """Split the raw blocks of a GGUF Q4_0/Q4_1/Q8_0 tensor (`uint8 [rows, bytes per row]`) exactly."""
    if type_name not in _BLOCK_BYTES:
        raise ValueError(f"GGUF type {type_name} is not kept quantized; expected one of {sorted(_BLOCK_BYTES)}")
    rows, cols = shape
    if cols % GROUP:
        raise ValueError(f"a {type_name} row of {cols} values is not whole blocks of {GROUP}")
    groups = cols // GROUP
    blocks = np.ascontiguousarray(data).reshape(rows, groups, _BLOCK_BYTES[type_name])
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if type_name == "Q8_0":
        q = blocks[..., 2:].copy().view(np.int8).reshape(rows, cols)
        return QuantizedTensor("q8", torch.from_numpy(q), torch.from_numpy(scale))
    if type_name == "Q4_1":
        minimum = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        nibbles = blocks[..., 4:]
    else:  # Q4_0: d * (q - 8) = d * q + (-8 d), exact in fp32
        minimum = scale * np.float32(-8)
        nibbles = blocks[..., 2:]
    q = np.ascontiguousarray(nibbles).reshape(rows, cols // 2)
    return QuantizedTensor("q4", torch.from_numpy(q), torch.from_numpy(scale), torch.from_numpy(minimum))


def quantize(weight: torch.Tensor, kind: Kind) -> QuantizedTensor:
    """`weight [rows, cols]` in the form `kind`, rounded by llama.cpp's reference quantizer
    (`gguf.quants.quantize` as Q4_1 for q4, Q8_0 for q8): what `--weights int4/int8` does to
    float checkpoints."""
    import gguf

    if weight.dim() != 2 or weight.shape[1] % GROUP:
        raise ValueError(
            f"only matrices whose rows are whole blocks of {GROUP} quantize, got shape {tuple(weight.shape)}"
        )
    type_name = "Q4_1" if kind == "q4" else "Q8_0"
    array = weight.detach().to(torch.float32).cpu().contiguous().numpy()
    blocks = gguf.quants.quantize(array, gguf.GGMLQuantizationType[type_name])
    return from_gguf_blocks(blocks, type_name, (int(weight.shape[0]), int(weight.shape[1])))


def nibbles(t: QuantizedTensor) -> torch.Tensor:
    """A q4 tensor's values 0..15 as uint8 `[rows, cols]`, in column order."""
    if t.kind != "q4":
        raise ValueError(f"nibbles of a {t.kind} tensor")
    rows, cols = t.shape
    packed = t.q.reshape(rows, cols // GROUP, GROUP // 2)
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1).reshape(rows, cols)


def dequantize(t: QuantizedTensor) -> torch.Tensor:
    """fp32 `[rows, cols]`, bit for bit what `gguf.quants.dequantize` gives for the source blocks."""
    rows, cols = t.shape
    if t.kind == "q8":
        values = t.q.reshape(rows, cols // GROUP, GROUP).to(torch.float32)
        return (t.scale[..., None] * values).reshape(rows, cols)
    values = nibbles(t).reshape(rows, cols // GROUP, GROUP).to(torch.float32)
    # Two roundings, product then sum, as numpy does (the product is exact anyway).
    return (t.scale[..., None] * values + t.minimum[..., None]).reshape(rows, cols)


def to_kind(t: QuantizedTensor, kind: Kind) -> QuantizedTensor:
    """`t` in the form `kind`: itself, or its values requantized (lossy: a Q8_0 row in 4 bits)."""
    return t if t.kind == kind else quantize(dequantize(t), kind)
