"""The native fp32 kernels (model/layers/csrc/dense_linear.cpp for a decode step's rows,
csrc/dense_gemm.cpp for prefill chunks) and `Linear`'s routes to them.

The reference is the float64 product of the same fp32 values; the kernels' sums are fp32 and
must sit within fp32 summation error of it, for every tile remainder (dense_linear: 4 input rows
by 3 weight rows a tile; dense_gemm: 6 input rows by 16 outputs), with and without a bias, on both
threads' ranges. Their other promise is batch invariance: a row's bits are the same whatever rows
come with it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve_worker.model.layers import native
from pdserve_worker.model.layers.matmul import (
    DENSE_GEMM_MAX_ROWS,
    DENSE_KERNEL_MAX_ROWS,
    Linear,
    native_dense,
    route,
)

CPU = torch.device("cpu")

pytestmark = pytest.mark.skipif(
    not (native.available() and torch.ops.pdserve.dense_linear_supported()),
    reason="the native fp32 decode kernel needs the native ops built on an x86 CPU with AVX2/FMA; "
    "oneDNN's prepacked route (test_matmul.py) serves elsewhere",
)


def check_product(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """y equals x @ w.T (+ bias) of these fp32 values up to fp32 summation error (k terms)."""
    exact = x.double() @ w.double().t()
    if bias is not None:
        exact = exact + bias.double()
    k = x.shape[-1]
    bound = (
        (k + 2) * 2.0**-24 * ((x.double().abs() @ w.double().abs().t()) + (0 if bias is None else bias.double().abs()))
    )
    assert y.dtype == torch.float32 and y.shape == exact.shape
    excess = (y.double() - exact).abs() / bound
    assert (excess <= 1).all(), float(excess.max())


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 16, 17, 64, 130])  # 130: chunks of 64 at k 1,536
@pytest.mark.parametrize(("n", "k"), [(1, 8), (2, 16), (3, 8), (97, 576), (192, 1536)])
def test_the_kernel_is_the_fp32_product_at_every_tile_remainder(rows, n, k):
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    check_product(native.dense_linear(x, w, None), x, w)


def test_the_bias_is_each_outputs_own():
    gen = torch.Generator().manual_seed(5)
    x, w, b = torch.randn(7, 64, generator=gen), torch.randn(100, 64, generator=gen), torch.randn(100, generator=gen)
    y = native.dense_linear(x, w, b)
    check_product(y, x, w, b)
    torch.testing.assert_close(y - native.dense_linear(x, w, None), b.expand(7, -1), atol=1e-5, rtol=0)


def test_a_rows_product_does_not_depend_on_its_batch():
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(128, 576, generator=gen)
    w = torch.randn(301, 576, generator=gen)
    alone = torch.cat([native.dense_linear(x[i : i + 1], w, None) for i in range(x.shape[0])])
    for start, size in [(0, 128), (1, 2), (3, 5), (10, 16), (7, 33)]:
        together = native.dense_linear(x[start : start + size].contiguous(), w, None)
        assert torch.equal(together, alone[start : start + size]), (start, size)
    wide = torch.randn(128, 1536, generator=gen)  # passes the weights in chunks of 64 rows
    w = torch.randn(37, 1536, generator=gen)
    alone = torch.cat([native.dense_linear(wide[i : i + 1], w, None) for i in range(wide.shape[0])])
    assert torch.equal(native.dense_linear(wide, w, None), alone)


def test_the_kernel_refuses_what_it_does_not_take():
    x, w = torch.randn(2, 16), torch.randn(4, 16)
    with pytest.raises(RuntimeError, match="k must be a positive multiple of 8, got 12"):
        native.dense_linear(torch.randn(2, 12), torch.randn(4, 12), None)
    with pytest.raises(RuntimeError, match="x must be a contiguous fp32"):
        native.dense_linear(x.to(torch.bfloat16), w, None)
    with pytest.raises(RuntimeError, match="x must be a contiguous fp32"):
        native.dense_linear(torch.randn(16, 2).t(), w, None)
    with pytest.raises(RuntimeError, match=r"w must be a contiguous fp32 or bf16 \[n, 16\], got \[4, 8\] Float"):
        native.dense_linear(x, torch.randn(4, 8), None)
    with pytest.raises(RuntimeError, match=r"w must be a contiguous fp32 or bf16 \[n, 16\]"):
        native.dense_linear(x, torch.randn(16, 4).t(), None)
    with pytest.raises(RuntimeError, match=r"w must be a contiguous fp32 or bf16 \[n, 16\], got \[4, 16\] Half"):
        native.dense_linear(x, w.half(), None)
    with pytest.raises(RuntimeError, match=r"bias must be a contiguous fp32 \[4\]"):
        native.dense_linear(x, w, torch.randn(5))
    assert native.dense_linear(torch.randn(0, 16), w, None).shape == (0, 4)


def test_linear_takes_the_kernel_for_a_decode_steps_rows_the_gemm_for_a_chunks_and_torch_beyond():
    linear = Linear(CPU, torch.float32, native_decode=True)
    assert linear.native_decode and not linear.prepack
    gen = torch.Generator().manual_seed(3)
    w = linear.prepare(torch.randn(96, 64, generator=gen))
    assert not w.is_mkldnn, "the kernels read the weight as the model holds it"
    b = torch.randn(96, generator=gen)
    few = torch.randn(2, 3, 64, generator=gen)  # 6 rows, as [batch, tokens, features]
    y = linear(few, w, bias=b)
    assert y.shape == (2, 3, 96)
    assert torch.equal(y.reshape(6, 96), native.dense_linear(few.reshape(6, 64), w, b))
    edge = torch.randn(DENSE_KERNEL_MAX_ROWS, 64, generator=gen)
    assert torch.equal(linear(edge, w), native.dense_linear(edge, w, None))
    chunk = torch.randn(DENSE_KERNEL_MAX_ROWS + 1, 64, generator=gen)
    assert torch.equal(linear(chunk, w, bias=b), native.dense_gemm(chunk, w, b))
    longest = torch.randn(DENSE_GEMM_MAX_ROWS, 64, generator=gen)
    assert torch.equal(linear(longest, w), native.dense_gemm(longest, w, None))
    many = torch.randn(DENSE_GEMM_MAX_ROWS + 1, 64, generator=gen)
    assert torch.equal(linear(many, w), F.linear(many, w))
    odd = torch.randn(40, 12, generator=gen)  # k not a multiple of 8: torch's GEMM
    assert torch.equal(linear(torch.ones(3, 12), odd), F.linear(torch.ones(3, 12), odd))
    assert torch.equal(linear(torch.ones(50, 12), odd), F.linear(torch.ones(50, 12), odd))
    assert linear(few, w, out_dtype=torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 11, 12, 13, 33, 100])
@pytest.mark.parametrize(("n", "k"), [(1, 8), (7, 16), (16, 8), (17, 24), (97, 576), (192, 1536)])
def test_the_gemm_is_the_fp32_product_at_every_tile_remainder(rows, n, k):
    gen = torch.Generator().manual_seed(rows * 1000 + n + 7)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    check_product(native.dense_gemm(x, w, None), x, w)


def test_the_gemms_bias_is_each_outputs_own():
    gen = torch.Generator().manual_seed(15)
    x, w, b = torch.randn(13, 64, generator=gen), torch.randn(21, 64, generator=gen), torch.randn(21, generator=gen)
    y = native.dense_gemm(x, w, b)
    check_product(y, x, w, b)
    torch.testing.assert_close(y - native.dense_gemm(x, w, None), b.expand(13, -1), atol=1e-5, rtol=0)


def test_a_rows_gemm_product_does_not_depend_on_its_batch_or_the_chunks():
    gen = torch.Generator().manual_seed(19)
    x = torch.randn(100, 576, generator=gen)
    w = torch.randn(37, 576, generator=gen)
    alone = torch.cat([native.dense_gemm(x[i : i + 1], w, None) for i in range(x.shape[0])])
    for start, size in [(0, 100), (1, 2), (3, 5), (10, 16), (7, 33), (50, 49)]:
        together = native.dense_gemm(x[start : start + size].contiguous(), w, None)
        assert torch.equal(together, alone[start : start + size]), (start, size)
    long = torch.randn(400, 1536, generator=gen)  # more rows than fit in one pass (2 MB): two chunks
    w = torch.randn(19, 1536, generator=gen)
    alone = torch.cat([native.dense_gemm(long[i : i + 6], w, None) for i in range(0, 400, 6)])
    assert torch.equal(native.dense_gemm(long, w, None), alone)
    check_product(alone, long, w)


def test_the_gemm_refuses_what_it_does_not_take():
    x, w = torch.randn(2, 16), torch.randn(4, 16)
    with pytest.raises(RuntimeError, match="dense_gemm: k must be a positive multiple of 8, got 12"):
        native.dense_gemm(torch.randn(2, 12), torch.randn(4, 12), None)
    with pytest.raises(RuntimeError, match="dense_gemm: x must be a contiguous fp32"):
        native.dense_gemm(x.to(torch.bfloat16), w, None)
    with pytest.raises(RuntimeError, match=r"dense_gemm: w must be a contiguous fp32 or bf16 \[n, 16\]"):
        native.dense_gemm(x, torch.randn(16, 4).t(), None)
    with pytest.raises(RuntimeError, match=r"dense_gemm: w must be a contiguous fp32 or bf16 \[n, 16\], got .* Half"):
        native.dense_gemm(x, w.half(), None)
    with pytest.raises(RuntimeError, match=r"dense_gemm: bias must be a contiguous fp32 \[4\]"):
        native.dense_gemm(x, w, torch.randn(5))
    assert native.dense_gemm(torch.randn(0, 16), w, None).shape == (0, 4)


def test_the_route_is_fp32_on_avx2_cpus_only():
    """Measured on AVX2 only: AVX512 CPUs keep oneDNN (twice as wide there), other dtypes their routes."""
    on_avx2 = torch.backends.cpu.get_cpu_capability() == "AVX2"
    assert native_dense(CPU, torch.float32) == on_avx2
    assert route(CPU, torch.float32) == ("native-decode" if on_avx2 else "onednn-prepacked")
    assert not native_dense(CPU, torch.bfloat16) and not native_dense(torch.device("meta"), torch.float32)
    bf16_native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert route(CPU, torch.bfloat16) == (
        "onednn-prepacked" if bf16_native else "native-upcast" if on_avx2 else "fp32-upcast"
    )
    assert Linear(CPU, torch.float32).native_decode == on_avx2
    assert not Linear(CPU, torch.float32, prepack=True).native_decode, "a route asked for by name is that route"


# bf16 weights (a bf16 model on a CPU without native bf16: matmul.route "native-upcast"): the
# kernels widen each weight to fp32 in registers, which is exact, so the product's bits are the
# fp32 kernel's on the same values, while reading half the bytes.


@pytest.mark.parametrize("rows", [1, 4, 7, 16, 32, 33, 100, 384])
@pytest.mark.parametrize(("n", "k"), [(3, 8), (17, 24), (97, 576), (192, 1536)])
def test_bf16_weights_give_the_bits_of_the_same_values_in_fp32(rows, n, k):
    gen = torch.Generator().manual_seed(rows * 100 + n)
    x = torch.randn(rows, k, generator=gen)
    w, b = torch.randn(n, k, generator=gen).bfloat16(), torch.randn(n, generator=gen)
    kernel = native.dense_linear if rows <= DENSE_KERNEL_MAX_ROWS else native.dense_gemm
    y = kernel(x, w, b)
    assert torch.equal(y, kernel(x, w.float(), b))
    check_product(y, x, w.float(), b)


@pytest.mark.skipif(
    route(CPU, torch.bfloat16) != "native-upcast",
    reason="bf16 takes oneDNN here (native bf16) or the upcast blocks (not an AVX2 build): test_matmul.py",
)
def test_a_bf16_linear_runs_the_kernels_on_fp32_inputs_and_rounds_once():
    linear = Linear(CPU, torch.bfloat16)
    assert linear.upcast and linear.native_decode, route(CPU, torch.bfloat16)
    gen = torch.Generator().manual_seed(11)
    w = linear.prepare(torch.randn(96, 64, generator=gen).bfloat16())
    b = torch.randn(96, generator=gen).bfloat16()
    for rows in (1, DENSE_KERNEL_MAX_ROWS, DENSE_KERNEL_MAX_ROWS + 1, DENSE_GEMM_MAX_ROWS):
        x = torch.randn(rows, 64, generator=gen).bfloat16()
        kernel = native.dense_linear if rows <= DENSE_KERNEL_MAX_ROWS else native.dense_gemm
        y = linear(x, w, bias=b)
        assert y.dtype == torch.bfloat16, "the activation dtype, rounded once from the fp32 sum"
        assert torch.equal(y, kernel(x.float(), w, b.float()).bfloat16())
    # a decode step's rows: each row's bits the same alone or in a batch
    batch = torch.randn(DENSE_KERNEL_MAX_ROWS, 64, generator=gen).bfloat16()
    alone = torch.cat([linear(batch[i : i + 1], w) for i in range(batch.shape[0])])
    assert torch.equal(linear(batch, w), alone)
    # beyond the GEMM's rows: the upcast blocks on torch's GEMM, the same product up to its sums
    many = torch.randn(DENSE_GEMM_MAX_ROWS + 1, 64, generator=gen).bfloat16()
    torch.testing.assert_close(linear(many, w), F.linear(many.float(), w.float()).bfloat16(), atol=2e-2, rtol=1e-2)
    assert not Linear(CPU, torch.bfloat16, upcast=True).native_decode, "a route asked for by name is that route"
