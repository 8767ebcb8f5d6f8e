"""The bf16 causal prefill kernel (csrc/prefill_attention.cpp) against attention computed in fp32
from the same bf16 inputs: no further from it than torch's own bf16 SDPA, the same bits for a
query whether its prompt is prefilled whole, in chunks or alone, the refusals, and a model's
prefill through the kernel against the same model through SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve_worker.model.layers import native

pytestmark = pytest.mark.skipif(
    not (native.available() and native._bf16_dot()),
    reason="needs the native ops on a CPU with AVX512-BF16; elsewhere bf16 prefill runs the fp32 kernel "
    "on AVX2 builds (test_prefill_attention_fp32.py) or torch's SDPA, which the other model tests cover",
)


def inputs(n: int, total: int, heads: int, kv_heads: int, head_dim: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads, head_dim, generator=g).bfloat16()
    k = torch.randn(total, kv_heads, head_dim, generator=g).bfloat16()
    v = torch.randn(total, kv_heads, head_dim, generator=g).bfloat16()
    return q, k, v


def sdpa(q, k, v, dtype):
    """torch's SDPA in `dtype` with the kernel's rule: query p sees keys j <= T - n + p."""
    n, total = q.shape[0], k.shape[0]
    allowed = torch.arange(total)[None, :] <= (total - n + torch.arange(n))[:, None]
    out = F.scaled_dot_product_attention(
        *(t.to(dtype).transpose(0, 1) for t in (q, k, v)), attn_mask=allowed, enable_gqa=True
    )
    return out.transpose(0, 1).reshape(n, -1).float()


@pytest.mark.parametrize(
    ("n", "total", "heads", "kv_heads", "head_dim"),
    [
        (1, 1, 2, 1, 64),  # one token: softmax of one key
        (5, 5, 4, 4, 32),  # no GQA, fewer keys than a tile
        (33, 40, 9, 3, 64),  # SmolLM2's heads, a chunk after 7 cached positions
        (100, 100, 8, 2, 64),  # group of 4, rows across several tiles
        (64, 300, 8, 4, 128),  # head_dim 128 (the two-row tiling), a late chunk
        (7, 1000, 6, 2, 64),  # a short chunk over a long prefix
        (257, 257, 3, 1, 64),  # more positions than a work item, odd count
    ],
)
def test_the_kernel_is_as_close_to_fp32_as_torchs_bf16_sdpa(n, total, heads, kv_heads, head_dim):
    q, k, v = inputs(n, total, heads, kv_heads, head_dim)
    want = sdpa(q, k, v, torch.float32)
    got = native.causal_attention(q, k, v)
    assert got.dtype == torch.bfloat16 and got.shape == (n, heads * head_dim)
    kernel_error = (got.float() - want).abs().max().item()
    torch_error = (sdpa(q, k, v, torch.bfloat16) - want).abs().max().item()
    assert kernel_error <= max(2 * torch_error, 2**-7), (kernel_error, torch_error)


def test_a_query_gets_the_same_bits_whole_in_chunks_and_alone():
    q, k, v = inputs(150, 150, 9, 3, 64, seed=3)
    whole = native.causal_attention(q, k, v)
    chunks = torch.cat([native.causal_attention(q[s : s + 50], k[: s + 50], v[: s + 50]) for s in (0, 50, 100)])
    assert torch.equal(chunks, whole)
    for p in (0, 31, 32, 99, 149):  # tile edges and the last
        alone = native.causal_attention(q[p : p + 1], k[: p + 1], v[: p + 1])
        assert torch.equal(alone[0], whole[p])


def test_keys_with_a_token_stride_are_read_in_place():
    """A slot pool's rows: tokens at a stride (other slots or layers between), heads dense."""
    q, k, v = inputs(20, 20, 4, 2, 32, seed=5)
    wide_k = torch.zeros(20, 3, 2, 32, dtype=torch.bfloat16)
    wide_v = torch.zeros_like(wide_k)
    wide_k[:, 1], wide_v[:, 1] = k, v
    assert torch.equal(native.causal_attention(q, wide_k[:, 1], wide_v[:, 1]), native.causal_attention(q, k, v))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda q, k, v: (q.float(), k.float(), v.float()), "bfloat16 only"),
        (lambda q, k, v: (q[..., :48], k[..., :48], v[..., :48]), "head_dim 32, 64 or 128, got 48"),
        (lambda q, k, v: (q, k[:5], v[:5]), "10 queries over 5 keys"),
        (lambda q, k, v: (q, k, v[:, :1]), "differ in shape"),
        (lambda q, k, v: (q[:, :3], k, v), "heads 3 over kv_heads 2"),
    ],
)
def test_inputs_it_cannot_take_are_refused_with_what_was_seen(change, message):
    q, k, v = inputs(10, 10, 4, 2, 64)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.pdserve.prefill_attention(*change(q, k, v), 0.125)


def test_prefill_serves_declines_what_the_kernel_does_not_take():
    q, k, v = inputs(4, 4, 4, 2, 64)
    assert native.prefill_serves(q, k, v)
    assert not native.prefill_serves(q.float(), k.float(), v.float())
    assert not native.prefill_serves(q[..., :16], k[..., :16], v[..., :16])  # head_dim 16
    assert not native.prefill_serves(q, k.transpose(0, 1), v.transpose(0, 1))  # heads not dense
    wide = torch.zeros(4, 2, 2, 64, dtype=torch.bfloat16)
    wide[:, 0] = v
    assert not native.prefill_serves(q, k, wide[:, 0])  # values at another token stride than keys


@pytest.mark.parametrize("kind", ["slots", "paged"])
def test_a_models_prefill_through_the_kernel_matches_sdpa(tmp_path, kind, monkeypatch):
    """A bf16 model whose head_dim the kernel takes: the logits of a prefill and of a prefill in
    two chunks through the kernel, against the same through SDPA (the kernel switched off)."""
    from dataclasses import replace

    from pdserve_worker.kv.cache import KVCache
    from pdserve_worker.kv.paged import PagedKVCache
    from pdserve_worker.model.layers.llama import PrefillOutputs
    from pdserve_worker.model.loading.loader import load_model
    from support.tiny_model import write_tiny_model

    folder = write_tiny_model(tmp_path / "m", hidden_size=96, num_heads=6, num_kv_heads=2, head_dim=32)
    model = load_model(str(folder), dtype="bfloat16").model
    layout = model.config.kv_layout(2, 256, "bfloat16")
    prompt = [(i * 37) % 300 + 3 for i in range(130)]

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
    monkeypatch.setitem(native._state, "bf16_dot", False)
    reference = run()
    for got, want in (*zip(kernel, reference, strict=True), (kernel[1], kernel[0])):
        assert (got - want).abs().max().item() < 0.05 * want.abs().max().item()
        assert got.argmax() == want.argmax()
