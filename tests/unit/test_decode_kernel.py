"""The native decode-attention kernel (model/layers/decode_kernel.py) against torch's SDPA, row by
row: same values within rounding, bit-identical rows alone and in any batch, and the refusals
that keep a bad table from reading outside the pool."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve_worker.model.layers import decode_kernel

pytestmark = pytest.mark.skipif(not decode_kernel.available(), reason="the native kernel could not be built here")

TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def pools(blocks: int, block_tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype, strided: bool):
    """Keys and values `[blocks, block_tokens, kv_heads, head_dim]`; `strided`: blocks interleaved
    with other memory, as a slot pool's slots are between layers."""
    g = torch.Generator().manual_seed(1)
    shape = (blocks, 3 if strided else 1, block_tokens, kv_heads, head_dim)
    k = torch.randn(shape, generator=g).to(dtype)[:, 0]
    v = torch.randn(shape, generator=g).to(dtype)[:, 0]
    return k, v


def reference(q, keys, values, tables, lengths):
    """SDPA of each row over exactly its keys (what the model did before the kernel), fp32."""
    block_tokens, kv_heads = keys.shape[1], keys.shape[2]
    out = []
    for b in range(q.shape[0]):
        j = torch.arange(int(lengths[b]))
        blocks = tables[b][j // block_tokens]
        k = keys[blocks, j % block_tokens].float().transpose(0, 1)  # [kv_heads, L, D]
        v = values[blocks, j % block_tokens].float().transpose(0, 1)
        qb = q[b].float().view(kv_heads, -1, q.shape[-1])
        out.append(F.scaled_dot_product_attention(qb, k, v).reshape(q.shape[1], q.shape[2]))
    return torch.stack(out)


def case(batch, heads, kv_heads, head_dim, block_tokens, lengths, dtype, strided=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    need = [(n + block_tokens - 1) // block_tokens for n in lengths]
    blocks = sum(need) + 3
    keys, values = pools(blocks, block_tokens, kv_heads, head_dim, dtype, strided)
    order = torch.randperm(blocks, generator=g).tolist()
    width = max(need)
    tables, at = [], 0
    for n in need:
        tables.append(order[at : at + n] + [0] * (width - n))
        at += n
    q = torch.randn(batch, heads, head_dim, generator=g).to(dtype)
    return q, keys, values, torch.tensor(tables), torch.tensor(lengths)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(9, 3, 64), (4, 4, 64), (28, 4, 128), (8, 1, 64), (16, 2, 80)],  # groups 3, 1, 7 (4 + 3), 8, 8
)
def test_the_kernel_equals_sdpa_row_by_row(dtype, heads, kv_heads, head_dim):
    lengths = [1, 63, 64, 65, 130, 300]  # across the kernel's 64-key parts
    q, keys, values, tables, lens = case(len(lengths), heads, kv_heads, head_dim, 16, lengths, dtype)
    got = decode_kernel.decode_attention(q, keys, values, tables, lens, head_dim**-0.5)
    want = reference(q, keys, values, tables, lens)
    assert got.dtype == dtype and got.shape == q.shape
    err = (got.float() - want).abs().max().item()
    assert err <= TOLERANCE[dtype], f"max |kernel - sdpa| = {err}"


def test_a_slot_pool_is_one_block_per_slot_at_its_stride():
    # KVCache's per-layer keys: [slot, max_len, kv_heads, head_dim], slots a whole layer set apart
    q, keys, values, tables, lens = case(3, 9, 3, 64, 256, [200, 17, 256], torch.float32, strided=True)
    assert not keys.is_contiguous()
    got = decode_kernel.decode_attention(q, keys, values, tables, lens, 0.125)
    assert (got - reference(q, keys, values, tables, lens)).abs().max().item() <= 2e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_bitwise_the_same_alone_and_in_any_batch(dtype):
    lengths = [70, 5, 400, 129, 64]
    q, keys, values, tables, lens = case(len(lengths), 9, 3, 64, 16, lengths, dtype, seed=3)
    together = decode_kernel.decode_attention(q, keys, values, tables, lens, 0.125)
    for row in range(len(lengths)):
        alone = decode_kernel.decode_attention(
            q[row : row + 1].contiguous(), keys, values, tables[row : row + 1].contiguous(), lens[row : row + 1], 0.125
        )
        assert torch.equal(alone[0], together[row]), f"row {row} differs beside the others"
    flipped = decode_kernel.decode_attention(
        q.flip(0).contiguous(), keys, values, tables.flip(0).contiguous(), lens.flip(0), 0.125
    )
    assert torch.equal(flipped.flip(0), together)


def test_a_table_that_points_outside_the_pool_is_refused():
    q, keys, values, tables, lens = case(2, 9, 3, 64, 16, [20, 20], torch.float32)
    bad = tables.clone()
    bad[1, 1] = keys.shape[0]  # one past the last block
    with pytest.raises(RuntimeError, match="outside the pool"):
        decode_kernel.decode_attention(q, keys, values, bad, lens, 0.125)
    bad[1, 1] = -1
    with pytest.raises(RuntimeError, match="outside the pool"):
        decode_kernel.decode_attention(q, keys, values, bad, lens, 0.125)


@pytest.mark.parametrize("keys_len", [0, 10_000])
def test_a_length_the_table_cannot_hold_is_refused(keys_len):
    q, keys, values, tables, lens = case(1, 9, 3, 64, 16, [20], torch.float32)
    with pytest.raises(RuntimeError, match="keys, its table holds"):
        decode_kernel.decode_attention(q, keys, values, tables, torch.tensor([keys_len]), 0.125)


def test_mismatched_inputs_are_refused_with_what_was_seen():
    q, keys, values, tables, lens = case(1, 9, 3, 64, 16, [20], torch.float32)
    with pytest.raises(RuntimeError, match="share a dtype"):
        decode_kernel.decode_attention(q.bfloat16(), keys, values, tables, lens, 0.125)
    with pytest.raises(RuntimeError, match="heads 8 over kv_heads 3"):
        decode_kernel.decode_attention(q[:, :8].contiguous(), keys, values, tables, lens, 0.125)
    with pytest.raises(RuntimeError, match="must be dense"):
        decode_kernel.decode_attention(q, keys.transpose(2, 3), values.transpose(2, 3), tables, lens, 0.125)
    with pytest.raises(RuntimeError, match="int64"):
        decode_kernel.decode_attention(q, keys, values, tables.int(), lens, 0.125)


def test_rows_for_declines_what_the_kernel_does_not_take():
    assert decode_kernel.rows_for([[0]], [1], 64, torch.device("cpu")) is not None
    assert decode_kernel.rows_for([[0]], [1], 72, torch.device("cpu")) is None  # not a multiple of 16
    assert decode_kernel.rows_for([[0]], [1], 64, torch.device("meta")) is None  # not a CPU pool
    rows = decode_kernel.rows_for([[4, 5, 6], [7]], [40, 3], 64, torch.device("cpu"), 16)
    assert rows is not None and rows.tables.tolist() == [[4, 5, 6], [7, 0, 0]] and rows.lengths.tolist() == [40, 3]


def test_the_torch_path_is_chosen_by_the_environment(monkeypatch):
    monkeypatch.setattr(decode_kernel, "_state", {})
    monkeypatch.setenv(decode_kernel.ENV, "torch")
    assert decode_kernel.available() is False
    monkeypatch.setattr(decode_kernel, "_state", {})
    monkeypatch.setenv(decode_kernel.ENV, "fast")
    with pytest.raises(ValueError, match="'kernel' or 'torch', got 'fast'"):
        decode_kernel.available()


def test_a_build_that_fails_leaves_the_torch_path(monkeypatch):
    def no_compiler(verbose: bool = False) -> None:
        raise RuntimeError("c++: not found")

    monkeypatch.setattr(decode_kernel, "_state", {})
    monkeypatch.delenv(decode_kernel.ENV, raising=False)
    monkeypatch.setattr(decode_kernel, "build", no_compiler)
    assert decode_kernel.available() is False


@pytest.mark.parametrize("kind", ["slots", "paged"])
def test_a_models_decode_step_is_the_same_through_the_kernel_and_row_by_row(tiny_model_dir, kind, monkeypatch):
    from dataclasses import replace

    from pdserve_worker.kv.cache import KVCache
    from pdserve_worker.kv.paged import PagedKVCache
    from pdserve_worker.model.loading.loader import load_model

    model = load_model(str(tiny_model_dir), dtype="float32").model
    layout = model.config.kv_layout(3, 256, "float32")
    if kind == "slots":
        cache = KVCache.allocate(layout)
    else:
        cache = PagedKVCache.allocate(replace(layout, block_tokens=16, num_blocks=48))
        for handle in range(3):
            cache.bind(handle, list(range(47 - handle * 16, 31 - handle * 16, -1)))  # blocks out of order
    prompts = [[5, 9, 13, 17], list(range(3, 150)), list(range(40, 110))]
    model.prefill_batch(prompts, cache, [0, 1, 2])
    steps = {}
    for impl in ("kernel", "torch"):
        monkeypatch.setattr(decode_kernel, "_state", {"ok": impl == "kernel"})
        steps[impl] = model.decode_step(cache, [0, 1, 2], [len(p) for p in prompts], [7, 8, 9])
    assert (steps["kernel"] - steps["torch"]).abs().max().item() < 1e-4
