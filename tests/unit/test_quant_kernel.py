"""The native block kernel (model/layers/csrc/quant_linear.cpp, `matmul.pack_native`): a GGUF
block's own integers, fp16 scale and minimum, `d * q + m` summed in fp32.

The reference for what a block means is the `gguf` package (`gguf.quants.dequantize`, llama.cpp's
reading of ggml-common.h's `block_q4_0` / `block_q4_1` / `block_q8_0`), through
`quant.dequantize`, which equals it bit for bit (test_quant.py); the product is checked against
float64 sums of those values by the fp32 inputs.
"""

from __future__ import annotations

import pytest
import torch
from test_quant import random_blocks

from pdserve_worker.model.layers import native
from pdserve_worker.model.layers.matmul import BlockMatrix, Int4Matrix, Linear, pack_native
from pdserve_worker.model.layers.quant import QuantizedTensor, dequantize, from_gguf_blocks, nibbles

CPU = torch.device("cpu")

pytestmark = pytest.mark.skipif(
    not native.quant_serves(),
    reason="the native block kernel needs the native ops built on an x86 CPU with AVX2/FMA/F16C; "
    "torch's int4 route (test_quant.py) serves elsewhere",
)


def blocks(rows: int, cols: int, type_name: str, seed: int) -> QuantizedTensor:
    return from_gguf_blocks(random_blocks(rows, cols, type_name, seed), type_name, (rows, cols))


def check_product(y: torch.Tensor, x: torch.Tensor, parts: list[QuantizedTensor]) -> None:
    """y equals x (fp32) times the parts' GGUF values, up to fp32 summation error."""
    w = torch.cat([dequantize(p) for p in parts]).double()
    xs = x.float().double()
    exact = xs @ w.t()
    bound = 64 * 2.0**-24 * (xs.abs() @ w.abs().t()) + 1e-30
    assert y.shape == exact.shape
    assert ((y.double() - exact).abs() <= bound).all(), float(((y.double() - exact).abs() / bound).max())


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 130, 300])  # register-tile remainders; 3 chunks of 128
def test_the_kernel_multiplies_by_the_files_own_values(type_name, rows):
    t = blocks(72, 96, type_name, rows)  # 72 outputs: padded to 96, the padding cut off
    matrix = pack_native([t], wide=type_name == "Q8_0")
    assert matrix is not None and matrix.shape == (72, 96)
    x = torch.randn(rows, 96)
    y = Linear(CPU, torch.float32)(x, matrix)
    assert y.dtype == torch.float32
    check_product(y, x, [t])


def test_a_fused_group_of_4_and_8_bit_parts_runs_wide_each_part_exactly():
    parts = [blocks(40, 64, "Q4_1", 1), blocks(24, 64, "Q8_0", 2), blocks(8, 64, "Q4_0", 3)]
    matrix = pack_native(parts, wide=True)
    assert matrix is not None and matrix.wide and matrix.shape == (72, 64)
    x = torch.randn(5, 64)
    check_product(Linear(CPU, torch.float32)(x, matrix), x, parts)
    with pytest.raises(ValueError, match="8-bit values need the wide"):
        pack_native(parts, wide=False)


@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_rows_product_does_not_depend_on_its_batch(type_name, dtype):
    """Issue #17: a seeded stream's tokens may not change with what else is in the step. One or
    two rows take the kernel's `direct` path, three or more the unpacked block's tiles. (fp32
    inputs too: a bf16 input times a 4- or 8-bit integer is exact in fp32, and so are most sums
    of 32 of them, so bf16 rows alone would not see a change in the order of the sums.)"""
    t = blocks(64, 128, type_name, 5)
    matrix = pack_native([t], wide=type_name == "Q8_0")
    linear = Linear(CPU, dtype)
    batch = torch.randn(131, 128).to(dtype)  # a bf16 model's rows are widened to fp32 for the kernel
    together = linear(batch, matrix, torch.float32)
    for row in (0, 2, 64, 127, 128, 130):  # tile and chunk edges
        for count in (1, 2, 3):
            assert torch.equal(linear(batch[row : row + count], matrix, torch.float32)[0], together[row])


def test_bf16_output_is_the_fp32_sum_rounded_once_and_a_bias_is_added_in_fp32():
    t = blocks(40, 64, "Q4_0", 9)
    matrix = pack_native([t], wide=False)
    linear = Linear(CPU, torch.bfloat16)
    x = torch.randn(6, 64).to(torch.bfloat16)
    wide = linear(x, matrix, torch.float32)
    narrow = linear(x, matrix)
    assert narrow.dtype == torch.bfloat16 and torch.equal(narrow, wide.to(torch.bfloat16))
    bias = torch.randn(40).to(torch.bfloat16)
    assert torch.equal(linear(x, matrix, bias=bias), (wide + bias.float()).to(torch.bfloat16))


def test_scales_the_kernel_cannot_hold_exactly_take_torchs_route(caplog):
    t = blocks(32, 64, "Q4_1", 4)
    odd = QuantizedTensor(t.kind, t.q, t.scale / 3, t.minimum)  # not fp16 values any more
    assert pack_native([odd], wide=False) is None
    with caplog.at_level("INFO", logger="pdserve_worker.model.layers.matmul"):
        assert isinstance(Linear(CPU, torch.float32).prepare_quantized([odd], "int4"), Int4Matrix)
    assert "event=quant_kernel_declined route=int4" in caplog.text
    assert isinstance(Linear(CPU, torch.float32).prepare_quantized([t], "int4"), BlockMatrix)
    assert isinstance(Linear(CPU, torch.float32, native_quant=False).prepare_quantized([t], "int4"), Int4Matrix)


def test_the_kernel_refuses_what_it_does_not_hold():
    matrix = pack_native([blocks(32, 64, "Q4_1", 4)], wide=False)
    assert matrix is not None
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="do not hold 64 x 64 4-bit values"):
        native.quant_linear(x, matrix.values, matrix.scales, 64, False, False, False)
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        native.quant_linear(x.to(torch.bfloat16), matrix.values, matrix.scales, 32, False, False, False)
    with pytest.raises(RuntimeError, match="k a multiple of 32"):
        native.quant_linear(torch.zeros(2, 48), matrix.values, matrix.scales, 32, False, False, False)
    with pytest.raises(RuntimeError, match="int8 inputs take 4-bit weights only"):
        native.quant_linear(x, matrix.values, matrix.scales, 32, True, False, True)
    with pytest.raises(ValueError, match="cannot stack matrices of widths"):
        pack_native([blocks(32, 64, "Q4_1", 4), blocks(32, 96, "Q4_1", 4)], wide=False)


def test_an_all_zero_input_row_gives_zeros_and_a_wide_ranging_block_keeps_its_small_values():
    t = blocks(32, 96, "Q4_1", 11)
    matrix = pack_native([t], wide=False)
    x = torch.randn(3, 96)
    x[0, :32] = 0
    x[1, 32:64] = torch.randn(32) * 2.0**-20
    x[1, 40] = 1.0  # one large value among tiny ones: fp32 inputs keep the tiny ones whole
    x[2] = 0
    y = Linear(CPU, torch.float32)(x, matrix)
    check_product(y, x, [t])
    assert not y[2].any()


# ---- the int8-input route (PDSERVE_QUANT_INPUTS=int8): llama.cpp's Q4 x Q8_0 -------------------


def int8_reference(x: torch.Tensor, t: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the route computes, in float64 from its definition: each input block of 32 as
    dx * xq (GGUF's Q8_0 as llama.cpp's quantize_row_q8_0 makes it: dx = max|x| / 127, xq the
    nearest integer, ties to even, of x * 127 / max|x|), times the block's d * q, plus m times
    the block's exact input sum. Returns the product and a bound of fp32 summation error."""
    rows, cols = x.shape
    xb = x.view(rows, cols // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    # A true fp32 division, as the kernel's `127.0f / top`: torch computes `127.0 / tensor` as
    # reciprocal(tensor) * 127, one rounding more, which moves an exact tie of x * inverse.
    inverse = torch.where(amax > 0, torch.full_like(amax, 127.0).div(amax), torch.zeros_like(amax))
    usable = torch.isfinite(inverse)
    xq = torch.round(xb * torch.where(usable, inverse, 0.0)).double()
    dx = torch.where(usable, amax / 127.0, 0.0).double().squeeze(-1)  # [rows, groups]
    q = nibbles(t).double().view(t.shape[0], cols // 32, 32)
    dot = torch.einsum("ngk,rgk->rng", q, xq) * t.scale.double()[None] * dx[:, None, :]
    m = t.minimum.double()[None] * xb.double().sum(-1)[:, None, :]
    size = torch.einsum("ngk,rgk->rng", q, xq.abs()) * t.scale.double().abs()[None] * dx[:, None, :]
    size = size + t.minimum.double().abs()[None] * xb.double().abs().sum(-1)[:, None, :]
    return (dot + m).sum(-1), 64 * 2.0**-24 * size.sum(-1)  # (no absolute floor: the tiny row's terms are ~1e-38)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 130])  # the integer tile's remainder (2 rows), 2 chunks
def test_int8_inputs_are_each_blocks_q8_0_times_the_files_integers(type_name, rows):
    t = blocks(72, 96, type_name, rows)
    matrix = pack_native([t], wide=False, int8_inputs=True)
    assert matrix is not None and matrix.int8_inputs
    x = torch.randn(rows, 96)
    x[:, 5] *= 40  # an outlier channel: its block's other inputs lose precision, as in llama.cpp
    x[0, 32:64] = 0  # an all-zero block: dx 0, contributes nothing
    if rows > 1:  # blocks too small to scale to 127 in fp32 (127 / max|x| overflows): zero too
        x[1] = torch.randn(96) * 1e-38
    y = Linear(CPU, torch.float32)(x, matrix)
    want, bound = int8_reference(x, t)
    assert ((y.double() - want).abs() <= bound).all(), float(((y.double() - want).abs() / bound).max())
    exact = x.double() @ dequantize(t).double().t()  # and it is not the exact product (quantized inputs)
    assert not torch.allclose(y.double(), exact, rtol=1e-5, atol=1e-5)
    assert float((y.double() - exact).norm() / exact.norm()) < 0.1


def test_int8_inputs_keep_a_rows_result_independent_of_its_batch():
    t = blocks(64, 128, "Q4_1", 6)
    matrix = pack_native([t], wide=False, int8_inputs=True)
    linear = Linear(CPU, torch.float32)
    batch = torch.randn(131, 128)
    together = linear(batch, matrix)
    for row in (0, 1, 2, 127, 128, 130):
        assert torch.equal(linear(batch[row : row + 1], matrix)[0], together[row])
        assert torch.equal(linear(batch[row : row + 2], matrix)[0], together[row])


def test_int8_inputs_are_opt_in_and_only_for_4_bit_weights(monkeypatch):
    t = blocks(32, 64, "Q4_1", 4)
    monkeypatch.delenv(native.QUANT_INPUTS_ENV, raising=False)
    assert native.quant_inputs() == "fp32"
    assert not Linear(CPU, torch.float32).prepare_quantized([t], "int4").int8_inputs
    monkeypatch.setenv(native.QUANT_INPUTS_ENV, "int8")
    assert Linear(CPU, torch.float32).prepare_quantized([t], "int4").int8_inputs
    wide = Linear(CPU, torch.float32).prepare_quantized([t, blocks(32, 64, "Q8_0", 5)], "int8")
    assert isinstance(wide, BlockMatrix) and wide.wide and not wide.int8_inputs  # 8-bit: fp32 inputs
    monkeypatch.setenv(native.QUANT_INPUTS_ENV, "int4")
    with pytest.raises(ValueError, match="PDSERVE_QUANT_INPUTS must be 'int8' or 'fp32', got 'int4'"):
        Linear(CPU, torch.float32)
