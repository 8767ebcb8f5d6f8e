"""The fp32 causal prefill kernel of AVX2 builds (csrc/prefill_attention_fp32.cpp; fp32 models,
and bf16 models on CPUs without AVX512-BF16) against attention in float64 from the same inputs:
within fp32 error (bf16: one rounding of the output), the same bits for a query whether its
prompt is prefilled whole, in chunks or alone, the refusals, and a model's prefill through the
kernel against the same model through torch's SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve_worker.model.layers import native

pytestmark = pytest.mark.skipif(
    not (native.available() and native._fp32_attention()),
    reason="the kernel is built for AVX2 CPUs (inductor's ISA pick) only; elsewhere the model runs "
    "torch's SDPA or the bf16 kernel, which the other model tests cover",
)


def inputs(n: int, total: int, heads: int, kv_heads: int, head_dim: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(total, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(total, kv_heads, head_dim, generator=g).to(dtype)
    return q, k, v


def exact(q, k, v):
    """Attention in float64 with the kernel's rule: query p sees keys j <= T - n + p."""
    n, total = q.shape[0], k.shape[0]
    allowed = torch.arange(total)[None, :] <= (total - n + torch.arange(n))[:, None]
    out = F.scaled_dot_product_attention(
        *(t.double().transpose(0, 1) for t in (q, k, v)), attn_mask=allowed, enable_gqa=True
    )
    return out.transpose(0, 1).reshape(n, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("n", "total", "heads", "kv_heads", "head_dim"),
    [
        (1, 1, 2, 1, 64),  # one token: softmax of one key
        (5, 5, 4, 4, 32),  # no GQA, fewer keys than a tile
        (33, 40, 9, 3, 64),  # SmolLM2's heads, a chunk after 7 cached positions
        (100, 100, 8, 2, 64),  # group of 4: micro-blocks across positions
        (64, 300, 8, 4, 128),  # head_dim 128 (values in two passes of 64), a late chunk
        (7, 1000, 6, 2, 64),  # a short chunk over a long prefix
        (257, 257, 3, 1, 24),  # head_dim 24 (16 + a last 8), more positions than a work item
        (9, 9, 2, 2, 8),  # the smallest head_dim
    ],
)
def test_the_kernel_is_attention_within_rounding(dtype, n, total, heads, kv_heads, head_dim):
    q, k, v = inputs(n, total, heads, kv_heads, head_dim, dtype)
    got = native.causal_attention(q, k, v)
    assert got.dtype == dtype and got.shape == (n, heads * head_dim)
    error = (got.double() - exact(q, k, v)).abs().max().item()
    # fp32: sums of up to T terms of |p v| <= max|v| (~4 here); bf16: one rounding of an output
    # below ~4 (2^-7 relative), the inputs being exact bf16 values.
    assert error <= (1e-5 if dtype == torch.float32 else 4 * 2**-8), error


def test_a_query_gets_the_same_bits_whole_in_chunks_and_alone():
    q, k, v = inputs(150, 150, 9, 3, 64, seed=3)
    whole = native.causal_attention(q, k, v)
    chunks = torch.cat([native.causal_attention(q[s : s + 50], k[: s + 50], v[: s + 50]) for s in (0, 50, 100)])
    assert torch.equal(chunks, whole)
    for p in (0, 15, 16, 99, 149):  # tile edges and the last
        alone = native.causal_attention(q[p : p + 1], k[: p + 1], v[: p + 1])
        assert torch.equal(alone[0], whole[p])


def test_keys_with_a_token_stride_are_read_in_place():
    """A slot pool's rows: tokens at a stride (other slots or layers between), heads dense."""
    q, k, v = inputs(20, 20, 4, 2, 32, seed=5)
    wide_k = torch.zeros(20, 3, 2, 32)
    wide_v = torch.zeros_like(wide_k)
    wide_k[:, 1], wide_v[:, 1] = k, v
    assert torch.equal(native.causal_attention(q, wide_k[:, 1], wide_v[:, 1]), native.causal_attention(q, k, v))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda q, k, v: (q.half(), k.half(), v.half()), "all float32 or all bfloat16, got Half"),
        (lambda q, k, v: (q, k.bfloat16(), v), "all float32 or all bfloat16, got Float, BFloat16"),
        (lambda q, k, v: (q[..., :12], k[..., :12], v[..., :12]), "multiple of 8 up to 128, got 12"),
        (lambda q, k, v: (q, k[:5], v[:5]), "10 queries over 5 keys"),
        (lambda q, k, v: (q, k, v[:, :1]), "differ in shape"),
        (lambda q, k, v: (q[:, :3], k, v), "heads 3 over kv_heads 2"),
        (lambda q, k, v: (q, *(t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))), "must be dense"),
    ],
)
def test_inputs_it_cannot_take_are_refused_with_what_was_seen(change, message):
    q, k, v = inputs(10, 10, 4, 2, 64)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.pdserve.prefill_attention_fp32(*change(q, k, v), 0.125)


def test_a_head_dim_beyond_the_kernels_is_refused():
    q, k, v = inputs(3, 3, 2, 1, 136)
    with pytest.raises(RuntimeError, match="got 136"):
        torch.ops.pdserve.prefill_attention_fp32(q, k, v, 0.1)
    assert not native.prefill_serves(q, k, v)


def test_prefill_serves_fp32_and_bf16_and_declines_the_rest():
    q, k, v = inputs(4, 4, 4, 2, 64)
    assert native.prefill_serves(q, k, v)
    assert native.prefill_serves(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert not native.prefill_serves(q.half(), k.half(), v.half())
    assert not native.prefill_serves(q, k.bfloat16(), v.bfloat16())  # mixed dtypes
    assert not native.prefill_serves(q[..., :12], k[..., :12], v[..., :12])  # head_dim 12
    assert not native.prefill_serves(q, k.transpose(0, 1), v.transpose(0, 1))  # heads not dense
    wide = torch.zeros(4, 2, 2, 64)
    wide[:, 0] = v
    assert not native.prefill_serves(q, k, wide[:, 0])  # values at another token stride than keys


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["slots", "paged"])
def test_a_models_prefill_through_the_kernel_matches_sdpa(tmp_path, kind, dtype, monkeypatch):
    """The logits of a prefill and of a prefill in two chunks through the kernel, against the same
    through SDPA (the kernel switched off)."""
    from dataclasses import replace

    from pdserve_worker.kv.cache import KVCache
    from pdserve_worker.kv.paged import PagedKVCache
    from pdserve_worker.model.layers.llama import PrefillOutputs
    from pdserve_worker.model.loading.loader import load_model
    from support.tiny_model import write_tiny_model

    folder = write_tiny_model(tmp_path / "m", hidden_size=96, num_heads=6, num_kv_heads=2, head_dim=32)
    model = load_model(str(folder), dtype=dtype).model
    layout = model.config.kv_layout(2, 256, dtype)
    prompt = [(i * 37) % 300 + 3 for i in range(130)]
    used = []
    kernel_op = native.causal_attention
    monkeypatch.setattr(native, "causal_attention", lambda *a: used.append(1) or kernel_op(*a))

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        if kind == "slots":
            cache = KVCache.allocate(layout)
        else:
            cache = PagedKVCache.allocate(replace(layout, block_tokens=16, num_blocks=32))
            cache.bind(0, list(range(15, -1, -1)))
            cache.bind(1, list(range(31, 15, -1)))
        whole = model.prefill(prompt, cache, 0).float()
        model.prefill(prompt[:70], cache, 1, outputs=PrefillOutputs(logits=False))
        chunked = model.prefill(prompt, cache, 1, start=70).float()
        return whole, chunked

    kernel = run()
    assert used, "the prefill went through the kernel"
    monkeypatch.setitem(native._state, "fp32_attention", False)
    used.clear()
    reference = run()
    assert not used, "with the kernel off, SDPA"
    tolerance = 1e-4 if dtype == "float32" else 0.05
    for got, want in (*zip(kernel, reference, strict=True), (kernel[1], kernel[0])):
        assert (got - want).abs().max().item() < tolerance * want.abs().max().item()
        assert got.argmax() == want.argmax()
