"""`x @ w.T` by the fastest route the device offers for the weight's dtype (`route`; `Linear` follows it).

- oneDNN handles the dtype natively (fp32 anywhere, bf16 with AVX512-BF16/AMX): `prepare`
  reorders each weight once into oneDNN's blocked layout and `__call__` runs oneDNN's linear.
- fp32 on AVX2-only CPUs ("native-decode"), bf16 there ("native-upcast"): a decode step's rows
  (up to `DENSE_KERNEL_MAX_ROWS`) run on csrc/dense_linear.cpp, prefill chunks (up to
  `DENSE_GEMM_MAX_ROWS`) on csrc/dense_gemm.cpp, on the weight as held; longer bf16 inputs are
  upcast block by block into a cached fp32 scratch for MKL. A row's bits never depend on its batch.
- Quantized weights (CPU): our block kernel (csrc/quant_linear.cpp, `BlockMatrix`) multiplies
  each block's own `d * q + m` in fp32; without it, torch's `_weight_int4pack_mm_for_cpu` on bf16
  activations, 8-bit values as two 4-bit planes. Opt-in `PDSERVE_QUANT_INPUTS=int8`: inputs
  quantized per block as llama.cpp does (`BlockMatrix.int8_inputs`).
- GPU, NPU, and fp16 with native fp16 GEMM: plain `F.linear`. The private torch ops pin torch.
Why each route, with measurements: benchmarks/README.md, "`model/layers/matmul.py`".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve_common.logs import kv
from pdserve_worker.model.layers import native
from pdserve_worker.model.layers.quant import GROUP, QuantizedTensor, nibbles

log = logging.getLogger(__name__)

# fp32 elements per upcast block: 4 MiB, inside L3 with room for the activations.
BLOCK_ELEMENTS = 1 << 20


def native_gemm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether multi-row GEMM in `dtype` is fast on `device` as it is."""
    if device.type != "cpu" or dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return True


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN's prepacked linear runs `dtype` natively on `device` (CPU only)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False  # fp16: oneDNN's CPU fp16 needs AVX512-FP16/AMX-FP16; not measured, so not used


def native_dense(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `dtype` weights take the native small-M kernel for decode (fp32 on an AVX2 CPU)."""
    return device.type == "cpu" and dtype == torch.float32 and native.dense_serves()


def native_upcast(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `dtype` weights without native GEMM support take the native fp32 kernels as they
    are (bf16 on an AVX2 CPU: the kernels widen each weight in registers)."""
    return device.type == "cpu" and dtype == torch.bfloat16 and native.dense_serves()


def route(device: torch.device, dtype: torch.dtype) -> str:
    """The route `Linear` takes for weights of `dtype` on `device` (`pdserve info` shows it)."""
    if not native_gemm(device, dtype):
        return "native-upcast" if native_upcast(device, dtype) else "fp32-upcast"
    if native_dense(device, dtype):
        return "native-decode"
    return "onednn-prepacked" if can_prepack(device, dtype) else "plain"


# Input rows up to which fp32 products take the small-M kernel (csrc/dense_linear.cpp: a decode
# step's rows, whose bits must not depend on the batch, so every batch up to this size takes the
# same kernel); up to DENSE_GEMM_MAX_ROWS the register-tile GEMM (csrc/dense_gemm.cpp: prefill
# chunks; its own bits, also independent of the other rows); beyond, torch's GEMM on the same
# weight (MKL's cache blocking wins there; the crossovers' measurements are in
# benchmarks/README.md, "fp32 prefill chunks on a register-tile GEMM"). A prefill's bits depend on its pass's row count, as they
# did before (a prompt prefilled alone or packed with others, whole or in chunks, may take
# another of the three); a decode step's rows do not, while the batch stays within
# DENSE_KERNEL_MAX_ROWS (8 slots by default).
DENSE_KERNEL_MAX_ROWS = 32
DENSE_GEMM_MAX_ROWS = 384


# What each quantized route is, for `pdserve info` and the load log.
QUANT_ROUTES = {
    "int4": "4-bit groups of 32 on the native block kernel (fp32 activations and sums, AVX2), else torch "
    "_weight_int4pack_mm_for_cpu (bf16 activations)",
    "int8": "8-bit groups of 32 on the native block kernel (fp32 activations and sums, AVX2), else torch "
    "_weight_int4pack_mm_for_cpu as two 4-bit planes (bf16 activations)",
}
_ROW_MULTIPLE = 16  # torch's CPU int4 packing takes rows in multiples of 16: fewer are padded with zero rows


@dataclass(frozen=True)
class Int4Matrix:
    """A `[rows, cols]` weight packed for torch's CPU int4 kernel on this CPU, in `planes` 4-bit planes."""

    packed: torch.Tensor  # uint8, `_convert_weight_to_int4pack_for_cpu`'s layout (ISA dependent)
    scales_zeros: torch.Tensor  # bf16 [planes * cols // 32, padded rows, 2]: (scale, zero) per group and row
    shape: tuple[int, int]
    planes: int = 1

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales_zeros.numel() * self.scales_zeros.element_size()


def _compensated_zero(values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The zero that makes each group's error mean-free once the kernel rounds `scale` to bf16.

    With scale d' = bf16(d), nibble q gives (q - 8) d' + z against the true (q - 8) d + zero:
    z = zero + (mean q - 8)(d - d') leaves the error (q - mean q)(d' - d), summing to zero over
    the group, instead of (q - 8)(d' - d), which shifts all 32 weights of a group one way (the
    least-squares zero for the rounded scale; exact where d is a bf16 value). Measured on the
    default model in bf16: without it the int4 route turned the demo question's first token
    (a 0.08 near-tie in fp32) to another and the answer into nonsense; with it the answer is
    the dequantized route's.
    """
    rows, cols = values.shape
    mean = values.reshape(rows, cols // GROUP, GROUP).float().mean(-1)
    return zero + (mean - 8) * (scale - scale.to(torch.bfloat16).float())


def _planes(t: QuantizedTensor, planes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(nibbles [rows, planes * cols], scales, zeros [rows, planes * groups]) of `t`, hi plane first."""
    if t.kind == "q4":
        lo, lo_scale = nibbles(t), t.scale
        lo_zero = _compensated_zero(lo, t.scale, t.minimum + 8 * t.scale)
        if planes == 1:
            return lo, lo_scale, lo_zero
        hi = torch.full_like(lo, 8)  # (8 - 8) * 0 + 0: an all-zero hi plane
        hi_scale = hi_zero = torch.zeros_like(lo_scale)
    else:
        if planes == 1:
            raise ValueError("8-bit values need two 4-bit planes")
        q = t.q.to(torch.int16)
        hi, lo = ((q >> 4) + 8).to(torch.uint8), (q & 0x0F).to(torch.uint8)  # q = 16 * (hi - 8) + lo
        hi_scale, hi_zero = 16 * t.scale, torch.zeros_like(t.scale)
        lo_scale, lo_zero = t.scale, 8 * t.scale
    return torch.cat([hi, lo], 1), torch.cat([hi_scale, lo_scale], 1), torch.cat([hi_zero, lo_zero], 1)


def pack_int4(parts: list[QuantizedTensor], planes: int = 1) -> Int4Matrix:
    """Row-stacked `parts` packed for the int4 kernel in `planes` planes (1: q4 parts only; 2: any)."""
    widths = {p.shape[1] for p in parts}
    if len(widths) != 1:
        raise ValueError(f"cannot stack matrices of widths {sorted(widths)}")
    cols = widths.pop()
    if cols % GROUP:
        raise ValueError(f"the int4 kernel takes rows of whole groups of {GROUP}, got {cols} columns")
    values, scales, zeros = (torch.cat(x) for x in zip(*(_planes(p, planes) for p in parts)))
    rows = values.shape[0]
    pad = -rows % _ROW_MULTIPLE
    if pad:  # zero rows: nibble 8, scale 0, zero 0
        values = torch.cat([values, torch.full((pad, values.shape[1]), 8, dtype=values.dtype)])
        scales = torch.cat([scales, scales.new_zeros(pad, scales.shape[1])])
        zeros = torch.cat([zeros, zeros.new_zeros(pad, zeros.shape[1])])
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values.to(torch.int32), 1)
    scales_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).to(torch.bfloat16).contiguous()
    return Int4Matrix(packed, scales_zeros, (rows, cols), planes)


@dataclass(frozen=True)
class BlockMatrix:
    """A `[rows, cols]` weight in blocks of 32 for the native kernel (csrc/quant_linear.cpp): each
    block's own integers (4-bit, or 8-bit where `wide`) with its fp16 scale and minimum."""

    values: torch.Tensor  # uint8, the kernel's layout (pack_native)
    scales: torch.Tensor  # fp16 [row blocks, groups, 2, 32]: d then m of each block
    shape: tuple[int, int]
    wide: bool
    int8_inputs: bool = False  # 4-bit only: the input quantized per block of 32, integer dot products

    @property
    def nbytes(self) -> int:
        return self.values.numel() + self.scales.numel() * 2


def _block_parts(t: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(integers [rows, cols] as int16, scale, minimum [rows, groups] fp32) of `t`: value d * q + m."""
    if t.kind == "q4":
        assert t.minimum is not None
        return nibbles(t).to(torch.int16), t.scale, t.minimum
    return t.q.to(torch.int16), t.scale, torch.zeros_like(t.scale)


def pack_native(parts: list[QuantizedTensor], wide: bool, int8_inputs: bool = False) -> BlockMatrix | None:
    """Row-stacked `parts` in the native kernel's layout (4-bit: q4 parts only), or None where a
    scale or minimum is not an fp16 value (the kernel reads them as fp16, as GGUF stores them;
    Q4_0's minimum -8 d is one too): the caller then takes torch's route."""
    widths = {p.shape[1] for p in parts}
    if len(widths) != 1:
        raise ValueError(f"cannot stack matrices of widths {sorted(widths)}")
    cols = widths.pop()  # whole blocks of 32: QuantizedTensor holds no other
    if not wide and any(p.kind != "q4" for p in parts):
        raise ValueError("8-bit values need the wide (8-bit) layout")
    values, scales, minimums = (torch.cat(x) for x in zip(*(_block_parts(p) for p in parts)))
    exact = torch.stack([scales, minimums])
    half = exact.half()
    if not torch.equal(half.float(), exact):
        return None
    rows = values.shape[0]
    pad = -rows % GROUP  # zero rows: value 0, scale 0, minimum 0
    values = torch.cat([values, values.new_zeros(pad, cols)])
    half = torch.cat([half, half.new_zeros(2, pad, half.shape[2])], 1)
    blocks, groups = (rows + pad) // GROUP, cols // GROUP
    if wide:  # [NB][G][32 inputs][32 rows]
        v = values.view(blocks, GROUP, groups, GROUP).permute(0, 2, 3, 1).to(torch.int8).view(torch.uint8)
    else:  # [NB][G][16 pairs][32 rows], input 2p in the low nibble, 2p + 1 in the high
        v = values.view(blocks, GROUP, groups, GROUP // 2, 2).permute(0, 2, 3, 1, 4).to(torch.uint8)
        v = v[..., 0] | (v[..., 1] << 4)
    packed = half.view(2, blocks, GROUP, groups).permute(1, 3, 0, 2).contiguous()
    return BlockMatrix(v.contiguous().view(-1), packed, (rows, cols), wide, int8_inputs and not wide)


# The input rows oneDNN's reorder is told to expect, by weight dtype: bf16 one (decode's GEMV),
# fp32 128 (faster than a hint of one from 1 to 256 rows; benchmarks/README.md, "Model
# measurements behind the module docstrings").
REORDER_ROWS = {torch.bfloat16: 1, torch.float32: 128}


def _reorder(w: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked copy of `w`, laid out for `REORDER_ROWS` input rows."""
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), REORDER_ROWS.get(w.dtype, 1))


def _prepacked_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Linear:
    """Callable `linear(x, w, out_dtype=None, bias=None)`; holds the scratch buffer, so one per model and thread.

    Weights pass through `prepare` once at load; `__call__` takes what `prepare` returned.
    """

    def __init__(
        self,
        device: torch.device,
        dtype: torch.dtype,
        upcast: bool | None = None,
        prepack: bool | None = None,
        native_quant: bool | None = None,
        int8_inputs: bool | None = None,
        native_decode: bool | None = None,
    ) -> None:
        chosen = route(device, dtype)
        self.dtype = dtype
        self.device = device
        self.upcast = chosen in ("fp32-upcast", "native-upcast") if upcast is None else upcast
        if native_decode is None:  # a route asked for by name (upcast, prepack) is that route alone
            native_decode = chosen in ("native-decode", "native-upcast") and upcast is None and prepack is None
        self.native_decode = native_decode
        self.prepack = (
            (not self.upcast and not self.native_decode and chosen == "onednn-prepacked")
            if prepack is None
            else prepack
        )
        self._scratch = torch.empty(BLOCK_ELEMENTS, dtype=torch.float32, device=device) if self.upcast else None
        self.native_quant = device.type == "cpu" and native.quant_serves() if native_quant is None else native_quant
        self.int8_inputs = native.quant_inputs() == "int8" if int8_inputs is None else int8_inputs

    def prepare(self, w: torch.Tensor) -> torch.Tensor:
        """`w` as `__call__` runs it fastest: oneDNN's blocked copy where `prepack`, else `w` itself.

        A packed weight is an opaque oneDNN tensor (shape and dtype kept, no slicing): it is
        for this class only. The reorder is laid out for `REORDER_ROWS` rows; other row counts
        run on it correctly and, measured, no slower than on the plain weight.
        """
        if self.native_decode and w.dtype in (torch.float32, torch.bfloat16):
            return w.contiguous()  # the kernels (and torch's GEMM, or the upcast blocks) read it as it is
        if not self.prepack:
            return w
        try:
            return _reorder(w)
        except RuntimeError as exc:
            # A CPU or build where oneDNN declines: serve on the plain weights, slower but right.
            self.prepack = False
            log.warning(
                kv(
                    event="prepack_unavailable",
                    dtype=str(w.dtype).removeprefix("torch."),
                    shape="x".join(map(str, w.shape)),
                    error=str(exc).splitlines()[0][:200],
                )
            )
            return w

    def prepare_quantized(self, parts: list[QuantizedTensor], route: str) -> Int4Matrix | BlockMatrix:
        """Row-stacked `parts` held for the `route`: "int4" (q4 parts) or "int8" (q4 or q8 parts,
        each exact). On the native kernel where it serves, else on torch's int4 kernel (one
        4-bit plane, or two for int8)."""
        if route not in QUANT_ROUTES:
            raise ValueError(f"quantized route must be one of {sorted(QUANT_ROUTES)}, got {route!r}")
        if self.device.type != "cpu":
            raise ValueError(f"quantized weights run on the CPU only, this model is on {self.device}")
        if self.native_quant:
            matrix = pack_native(parts, wide=route == "int8", int8_inputs=self.int8_inputs)
            if matrix is not None:
                return matrix
            log.info(kv(event="quant_kernel_declined", route=route, why="a scale or minimum is not an fp16 value"))
        return pack_int4(parts, 1 if route == "int4" else 2)

    def __call__(
        self,
        x: torch.Tensor,
        w: torch.Tensor | Int4Matrix,
        out_dtype: torch.dtype | None = None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`x @ w.T (+ bias)`; the bias (in the weight's dtype) is added inside the product, before
        the one rounding to the output dtype, as `F.linear` with a bias does (qwen2's q/k/v).
        On the quantized routes the bias is added to the product in fp32."""
        if isinstance(w, BlockMatrix):
            return self._blocks(x, w, out_dtype, bias)
        if isinstance(w, Int4Matrix):
            return self._quantized(x, w, out_dtype, bias)
        if self.native_decode and not w.is_mkldnn and w.dtype == torch.float32 == x.dtype:
            return self._dense(x, w, out_dtype, bias)
        if self.native_decode and self.upcast and w.dtype == torch.bfloat16 and self._native_rows(x, w):
            return self._dense(x.float(), w, out_dtype or x.dtype, bias)
        if w.is_mkldnn:
            y = _prepacked_linear(x, w, bias)
            return y if out_dtype is None else y.to(out_dtype)
        features = x.shape[-1]
        rows = x.numel() // features
        if self._scratch is None or rows <= 1 or w.dtype == torch.float32:
            y = F.linear(x, w, bias)
            return y if out_dtype is None else y.to(out_dtype)
        # out^T = W x^T computed per block of W's rows: each block's output rows are contiguous.
        xt = x.reshape(rows, features).float().t()
        out_t = torch.empty(w.shape[0], rows, dtype=torch.float32, device=x.device)
        step = max(1, BLOCK_ELEMENTS // features)
        for start in range(0, w.shape[0], step):
            n = min(step, w.shape[0] - start)
            block = self._scratch[: n * features].view(n, features)
            block.copy_(w[start : start + n])
            torch.mm(block, xt, out=out_t[start : start + n])
        if bias is not None:
            out_t += bias.float()[:, None]
        # Row-major like F.linear's result (the native layer ops take contiguous rows): a bf16
        # output's conversion is the copy that transposes; an fp32 one needs its own.
        y = out_t.t().to(out_dtype or x.dtype, memory_format=torch.contiguous_format).contiguous()
        return y.reshape(*x.shape[:-1], w.shape[0])

    def _dense(
        self, x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """fp32 `x @ w.T`: the small-M kernel for a decode step's rows, the register-tile GEMM
        for a prefill chunk's, torch's GEMM for longer inputs."""
        if self._native_rows(x, w):
            rows = x.numel() // x.shape[-1]
            product = native.dense_linear if rows <= DENSE_KERNEL_MAX_ROWS else native.dense_gemm
            y = product(x.contiguous(), w, None if bias is None else bias.float().contiguous())  # (any leading shape)
        else:
            y = F.linear(x, w, bias)
        return y if out_dtype is None or y.dtype == out_dtype else y.to(out_dtype)

    @staticmethod
    def _native_rows(x: torch.Tensor, w: torch.Tensor) -> bool:
        """Whether the native kernels take `x @ w.T`: up to DENSE_GEMM_MAX_ROWS rows of a
        multiple of 8 features, on a contiguous weight."""
        features = x.shape[-1]
        return x.numel() // features <= DENSE_GEMM_MAX_ROWS and features % 8 == 0 and w.is_contiguous()

    def _quantized(
        self, x: torch.Tensor, w: Int4Matrix, out_dtype: torch.dtype | None, bias: torch.Tensor | None
    ) -> torch.Tensor:
        rows, cols = w.shape
        flat = x.reshape(-1, cols).to(torch.bfloat16)
        if w.planes > 1:
            flat = flat.repeat(1, w.planes)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat.contiguous(), w.packed, GROUP, w.scales_zeros)
        if y.shape[1] != rows:
            y = y[:, :rows]
        if bias is not None:
            y = y.float() + bias.float()
        return y.to(out_dtype or x.dtype).reshape(*x.shape[:-1], rows)

    def _blocks(
        self, x: torch.Tensor, w: BlockMatrix, out_dtype: torch.dtype | None, bias: torch.Tensor | None
    ) -> torch.Tensor:
        want = out_dtype or x.dtype
        flat = (x if x.dtype == torch.float32 else x.float()).contiguous()  # (any leading shape)
        bf16 = want == torch.bfloat16 and bias is None
        y = native.quant_linear(flat, w.values, w.scales, w.shape[0], w.wide, bf16, w.int8_inputs)
        if bias is not None:
            y = y + bias.float()
        return y if y.dtype == want else y.to(want)
