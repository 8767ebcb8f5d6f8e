"""`Linear`: every route (plain, prepacked oneDNN, blocked upcast) computes the same `x @ w.T`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve_worker.model.layers.matmul import BLOCK_ELEMENTS, Linear, can_prepack

CPU = torch.device("cpu")


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp64 product of the same values: what every route approximates."""
    return F.linear(x.double(), w.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64,), (1, 1, 64), (3, 5, 64), (17, 64)])
def test_prepacked_matches_plain_linear(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if not can_prepack(CPU, dtype):
        pytest.skip(f"oneDNN cannot prepack {dtype} on this CPU; the plain route is tested below")
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=gen).to(dtype)
    x = torch.randn(*shape, generator=gen).to(dtype)
    linear = Linear(CPU, dtype, upcast=False, prepack=True)
    packed = linear.prepare(w)
    assert packed.is_mkldnn and packed.shape == w.shape and packed.dtype == dtype
    y = linear(x, packed)
    assert y.shape == (*shape[:-1], 96) and y.dtype == dtype
    plain = F.linear(x, w)
    if dtype == torch.bfloat16:
        torch.testing.assert_close(y, plain, atol=0, rtol=0)  # measured bit-identical in bf16
    else:
        torch.testing.assert_close(y, plain, atol=1e-5, rtol=1e-5)
    logits = linear(x, packed, torch.float32)
    assert logits.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_route_leaves_weight_alone(dtype: torch.dtype) -> None:
    linear = Linear(CPU, dtype, upcast=False, prepack=False)
    w = torch.randn(8, 4).to(dtype)
    assert linear.prepare(w) is w
    x = torch.randn(2, 4).to(dtype)
    torch.testing.assert_close(linear(x, w), F.linear(x, w), atol=0, rtol=0)


def test_upcast_route_equals_fp32_gemm_of_the_bf16_values() -> None:
    """The blocked fp32 upcast (CPUs without bf16 GEMM) spans several blocks and keeps bf16 output."""
    features = 256
    rows_out = BLOCK_ELEMENTS // features * 2 + 7  # three blocks, the last partial
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(rows_out, features, generator=gen).to(torch.bfloat16)
    x = torch.randn(4, 3, features, generator=gen).to(torch.bfloat16)
    linear = Linear(CPU, torch.bfloat16, upcast=True, prepack=False)
    assert linear.prepare(w) is w
    y = linear(x, w)
    assert y.shape == (4, 3, rows_out) and y.dtype == torch.bfloat16
    # Row-major as F.linear's (the native layer ops refuse other layouts: rope_qkv did on AVX2).
    assert y.is_contiguous() and linear(x, w, torch.float32).is_contiguous()
    expected = F.linear(x.float(), w.float()).to(torch.bfloat16)
    torch.testing.assert_close(y, expected, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(linear(x, w, torch.float32), _reference(x, w).float(), atol=1e-3, rtol=1e-3)


def test_prepack_is_cpu_only() -> None:
    assert not can_prepack(torch.device("meta"), torch.float32)
    assert not can_prepack(CPU, torch.float16)


def test_a_reorder_that_fails_falls_back_to_plain_weights(monkeypatch, caplog) -> None:
    """A CPU/build where oneDNN declines the reorder must serve (slower), not fail to load."""
    from pdserve_worker.model.layers import matmul

    def declined(w: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("could not create a primitive descriptor for a reorder primitive")

    monkeypatch.setattr(matmul, "_reorder", declined)
    linear = Linear(CPU, torch.float32, upcast=False, prepack=True)
    w = torch.randn(8, 4)
    with caplog.at_level("WARNING", logger="pdserve_worker.model.layers.matmul"):
        assert linear.prepare(w) is w
    assert not linear.prepack, "later weights would try (and log) again"
    assert "event=prepack_unavailable" in caplog.text and "shape=8x4" in caplog.text
    x = torch.randn(3, 4)
    torch.testing.assert_close(linear(x, w), F.linear(x, w), atol=0, rtol=0)


@pytest.mark.parametrize(
    ("dtype", "upcast", "prepack"),
    [
        (torch.float32, False, False),
        (torch.float32, False, True),
        (torch.bfloat16, False, False),
        (torch.bfloat16, False, True),
        (torch.bfloat16, True, False),
    ],
    ids=["fp32-plain", "fp32-prepacked", "bf16-plain", "bf16-prepacked", "bf16-upcast"],
)
@pytest.mark.parametrize("shape", [(1, 1, 64), (3, 5, 64)])
def test_every_route_adds_the_bias_as_f_linear_does(dtype, upcast, prepack, shape) -> None:
    """qwen2's q/k/v bias goes into the product on every route (one rounding, like F.linear with a bias)."""
    if prepack and not can_prepack(CPU, dtype):
        pytest.skip(f"oneDNN cannot prepack {dtype} on this CPU")
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(96, 64, generator=gen).to(dtype)
    b = torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(*shape, generator=gen).to(dtype)
    linear = Linear(CPU, dtype, upcast=upcast, prepack=prepack)
    y = linear(x, linear.prepare(w), bias=b)
    expected = F.linear(x.double(), w.double(), b.double())
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(y.double(), expected, atol=tol * 8, rtol=tol)
    assert not torch.allclose(linear(x, linear.prepare(w)).double(), expected, atol=0.1)  # the bias is there
