"""The native ops (model/layers/native.py) against the torch ops they replace: decode attention
against SDPA row by row, RMSNorm, the residual add, RoPE and SiLU(gate) * up against the model's
torch path — same values within rounding, bit-identical rows alone and in any batch, and the
refusals that keep a bad table from reading outside the pool."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pdserve_worker.model.layers import native

pytestmark = pytest.mark.skipif(not native.available(), reason="the native kernel could not be built here")

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
    [(9, 3, 64), (4, 4, 64), (28, 4, 128), (8, 1, 64), (16, 2, 80), (8, 2, 32)],
    # groups 3, 1, 7 (4 + 3), 8, 8, 4; head_dim in 4, 8 and 16 vectors of 8 (a tile's value chunks
    # in one or more passes over the keys: decode_attention.cpp's chunks_in_registers) and 80 (any)
)
def test_the_kernel_equals_sdpa_row_by_row(dtype, heads, kv_heads, head_dim):
    lengths = [1, 63, 64, 65, 130, 300]  # across the kernel's 64-key parts
    q, keys, values, tables, lens = case(len(lengths), heads, kv_heads, head_dim, 16, lengths, dtype)
    got = native.decode_attention(q, keys, values, tables, lens, head_dim**-0.5)
    want = reference(q, keys, values, tables, lens)
    assert got.dtype == dtype and got.shape == q.shape
    err = (got.float() - want).abs().max().item()
    assert err <= TOLERANCE[dtype], f"max |kernel - sdpa| = {err}"


def test_a_slot_pool_is_one_block_per_slot_at_its_stride():
    # KVCache's per-layer keys: [slot, max_len, kv_heads, head_dim], slots a whole layer set apart
    q, keys, values, tables, lens = case(3, 9, 3, 64, 256, [200, 17, 256], torch.float32, strided=True)
    assert not keys.is_contiguous()
    got = native.decode_attention(q, keys, values, tables, lens, 0.125)
    assert (got - reference(q, keys, values, tables, lens)).abs().max().item() <= 2e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_bitwise_the_same_alone_and_in_any_batch(dtype):
    lengths = [70, 5, 400, 129, 64]
    q, keys, values, tables, lens = case(len(lengths), 9, 3, 64, 16, lengths, dtype, seed=3)
    together = native.decode_attention(q, keys, values, tables, lens, 0.125)
    for row in range(len(lengths)):
        alone = native.decode_attention(
            q[row : row + 1].contiguous(), keys, values, tables[row : row + 1].contiguous(), lens[row : row + 1], 0.125
        )
        assert torch.equal(alone[0], together[row]), f"row {row} differs beside the others"
    flipped = native.decode_attention(
        q.flip(0).contiguous(), keys, values, tables.flip(0).contiguous(), lens.flip(0), 0.125
    )
    assert torch.equal(flipped.flip(0), together)


def test_a_table_that_points_outside_the_pool_is_refused():
    q, keys, values, tables, lens = case(2, 9, 3, 64, 16, [20, 20], torch.float32)
    bad = tables.clone()
    bad[1, 1] = keys.shape[0]  # one past the last block
    with pytest.raises(RuntimeError, match="outside the pool"):
        native.decode_attention(q, keys, values, bad, lens, 0.125)
    bad[1, 1] = -1
    with pytest.raises(RuntimeError, match="outside the pool"):
        native.decode_attention(q, keys, values, bad, lens, 0.125)


@pytest.mark.parametrize("keys_len", [0, 10_000])
def test_a_length_the_table_cannot_hold_is_refused(keys_len):
    q, keys, values, tables, lens = case(1, 9, 3, 64, 16, [20], torch.float32)
    with pytest.raises(RuntimeError, match="keys, its table holds"):
        native.decode_attention(q, keys, values, tables, torch.tensor([keys_len]), 0.125)


def test_mismatched_inputs_are_refused_with_what_was_seen():
    q, keys, values, tables, lens = case(1, 9, 3, 64, 16, [20], torch.float32)
    with pytest.raises(RuntimeError, match="share a dtype"):
        native.decode_attention(q.bfloat16(), keys, values, tables, lens, 0.125)
    with pytest.raises(RuntimeError, match="heads 8 over kv_heads 3"):
        native.decode_attention(q[:, :8].contiguous(), keys, values, tables, lens, 0.125)
    with pytest.raises(RuntimeError, match="must be dense"):
        native.decode_attention(q, keys.transpose(2, 3), values.transpose(2, 3), tables, lens, 0.125)
    with pytest.raises(RuntimeError, match="int64"):
        native.decode_attention(q, keys, values, tables.int(), lens, 0.125)


def test_rows_for_declines_what_the_kernel_does_not_take():
    assert native.rows_for([[0]], [1], 64, torch.device("cpu")) is not None
    assert native.rows_for([[0]], [1], 72, torch.device("cpu")) is None  # not a multiple of 16
    assert native.rows_for([[0]], [1], 64, torch.device("meta")) is None  # not a CPU pool
    rows = native.rows_for([[4, 5, 6], [7]], [40, 3], 64, torch.device("cpu"), 16)
    assert rows is not None and rows.tables.tolist() == [[4, 5, 6], [7, 0, 0]] and rows.lengths.tolist() == [40, 3]


def test_the_torch_path_is_chosen_by_the_environment(monkeypatch):
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv(native.ENV, "torch")
    assert native.available() is False
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv(native.ENV, "fast")
    with pytest.raises(ValueError, match="'kernel' or 'torch', got 'fast'"):
        native.available()


def test_a_build_that_fails_leaves_the_torch_path(monkeypatch):
    def no_compiler(verbose: bool = False) -> None:
        raise RuntimeError("c++: not found")

    monkeypatch.setattr(native, "_state", {})
    monkeypatch.delenv(native.ENV, raising=False)
    monkeypatch.setattr(native, "build", no_compiler)
    assert native.available() is False


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
        monkeypatch.setattr(native, "_state", {"ok": impl == "kernel"})
        steps[impl] = model.decode_step(cache, [0, 1, 2], [len(p) for p in prompts], [7, 8, 9])
    assert (steps["kernel"] - steps["torch"]).abs().max().item() < 1e-4


LAYER_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 0.0, torch.float16: 0.0}


def close_or_one_ulp(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32: within 1e-5 (one fp32 sum taken in another order); bf16/fp16: equal, or one unit in
    the last place where the fp32 value sat on a rounding boundary."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if dtype == torch.float32:
        assert (got - want).abs().max().item() <= LAYER_TOLERANCE[dtype] * max(1.0, want.abs().max().item())
        return
    diff = (got.float() - want.float()).abs()
    ulp = want.float().abs().clamp(min=1e-3) * (2**-7 if dtype == torch.bfloat16 else 2**-10)
    assert bool((diff <= ulp).all()), f"max diff {diff.max().item()}"
    assert (diff > 0).float().mean().item() < 0.01  # nearly every element identical


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_and_the_residual_add_match_the_torch_path(dtype):
    from pdserve_worker.model.layers.decoder_block import rms_norm

    g = torch.Generator().manual_seed(5)
    x = (torch.randn(7, 576, generator=g) * 3).to(dtype)
    delta = torch.randn(7, 576, generator=g).to(dtype)
    w = (torch.rand(576, generator=g) + 0.5).to(dtype)
    close_or_one_ulp(native.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5), dtype)
    total, normed = native.add_rms_norm(x, delta, w, 1e-5)
    assert torch.equal(total, x + delta)  # the add rounds once, as torch's does
    close_or_one_ulp(normed, rms_norm(x + delta, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_silu_mul_matches_silu_of_gate_times_up(dtype):
    g = torch.Generator().manual_seed(6)
    gate_up = (torch.randn(5, 2 * 1536 + 2 * 7, generator=g) * 4).to(dtype)  # an inter size with a tail
    gate, up = gate_up.chunk(2, dim=-1)
    close_or_one_ulp(native.silu_mul(gate_up), F.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_qkv_matches_the_split_rotate_path(dtype, qk_norm):
    from pdserve_worker.model.layers.decoder_block import rms_norm
    from pdserve_worker.model.layers.rope import apply_rotary, cos_sin

    heads, kv_heads, head_dim, batch, tokens = 9, 3, 64, 2, 5
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(batch, tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    positions = torch.arange(batch * tokens).view(batch, tokens) * 37
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cos, sin = cos_sin(inv_freq, positions, dtype)
    cos, sin = cos[:, :, None], sin[:, :, None]
    norm = (torch.rand(heads + kv_heads, head_dim, generator=g) + 0.5).to(dtype) if qk_norm else None
    q, k, v = native.rope_qkv(qkv, cos, sin, heads, kv_heads, norm, 1e-6)
    qk = qkv[..., : (heads + kv_heads) * head_dim].view(batch, tokens, heads + kv_heads, head_dim)
    if norm is not None:
        qk = rms_norm(qk, norm, 1e-6)
    qk = apply_rotary(qk, cos, sin)
    close_or_one_ulp(q, qk[:, :, :heads].contiguous(), dtype)
    close_or_one_ulp(k, qk[:, :, heads:].contiguous(), dtype)
    assert torch.equal(v, qkv[..., (heads + kv_heads) * head_dim :].view(batch, tokens, kv_heads, head_dim))


def test_the_layer_ops_give_a_row_the_same_bits_alone_and_in_a_batch():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(9, 576, generator=g).bfloat16()
    w = torch.rand(576, generator=g).bfloat16()
    gate_up = torch.randn(9, 3072, generator=g).bfloat16()
    for row in range(9):
        assert torch.equal(native.rms_norm(x[row : row + 1], w, 1e-5)[0], native.rms_norm(x, w, 1e-5)[row])
        assert torch.equal(native.silu_mul(gate_up[row : row + 1])[0], native.silu_mul(gate_up)[row])


def test_the_ops_take_any_leading_shape_as_rows_and_keep_it():
    """csrc/rows.h: the model calls the ops on its [batch, tokens, width] activations as they are
    (no reshape before, no view after); a 3-D input gives the 2-D flattened input's results, in
    the input's leading shape."""
    from pdserve_worker.model.layers.matmul import pack_native
    from pdserve_worker.model.layers.quant import quantize

    g = torch.Generator().manual_seed(11)
    lead = (2, 3)
    x, w = torch.randn(*lead, 576, generator=g), torch.rand(576, generator=g)
    flat = x.reshape(6, 576)
    assert torch.equal(torch.ops.pdserve.rms_norm(x, w, 1e-5), torch.ops.pdserve.rms_norm(flat, w, 1e-5).view(x.shape))
    total, normed = torch.ops.pdserve.add_rms_norm(x, x * 0.5, w, 1e-5)
    total2, normed2 = torch.ops.pdserve.add_rms_norm(flat, flat * 0.5, w, 1e-5)
    assert torch.equal(total, total2.view(x.shape)) and torch.equal(normed, normed2.view(x.shape))
    gate_up = torch.randn(*lead, 256, generator=g)
    out = torch.ops.pdserve.silu_mul(gate_up)
    assert out.shape == (*lead, 128) and torch.equal(
        out, torch.ops.pdserve.silu_mul(gate_up.reshape(6, 256)).view(out.shape)
    )
    qkv = torch.randn(*lead, 15 * 64, generator=g)
    cos, sin = torch.randn(*lead, 1, 64, generator=g), torch.randn(*lead, 1, 64, generator=g)
    q, k, v = torch.ops.pdserve.rope_qkv(qkv, cos, sin, 9, 3, None, 1e-6)
    q2, k2, v2 = torch.ops.pdserve.rope_qkv(
        qkv.reshape(6, -1), cos.reshape(6, 64), sin.reshape(6, 64), 9, 3, None, 1e-6
    )
    assert (q.shape, k.shape, v.shape) == ((*lead, 9, 64), (*lead, 3, 64), (*lead, 3, 64))
    assert torch.equal(q, q2.view(q.shape)) and torch.equal(k, k2.view(k.shape)) and torch.equal(v, v2.view(v.shape))
    weight = torch.randn(96, 576, generator=g)
    for op in (native.dense_linear, native.dense_gemm):
        y = op(x, weight, None)
        assert y.shape == (*lead, 96) and torch.equal(y, op(flat, weight, None).view(y.shape))
    blocks = pack_native([quantize(weight, "q4")], wide=False)
    assert blocks is not None
    y = native.quant_linear(x, blocks.values, blocks.scales, 96, False, False, False)
    assert y.shape == (*lead, 96)
    assert torch.equal(
        y, native.quant_linear(flat, blocks.values, blocks.scales, 96, False, False, False).view(y.shape)
    )
    # Zero-width rows are still rows: x @ W.T over k = 0 is zeros, a norm keeps the shape.
    zeros = native.quant_linear(
        torch.randn(5, 0), torch.empty(0, dtype=torch.uint8), torch.empty(0).half(), 7, False, False, False
    )
    assert zeros.shape == (5, 7) and bool((zeros == 0).all())
    assert torch.ops.pdserve.rms_norm(torch.randn(2, 3, 0), torch.randn(0), 1e-5).shape == (2, 3, 0)
    with pytest.raises(RuntimeError, match=r"contiguous CPU \[\.\.\., width\]"):
        torch.ops.pdserve.rms_norm(x.transpose(0, 1), w, 1e-5)  # rows must be dense
    with pytest.raises(RuntimeError, match=r"cos and sin of 6 rows of 64"):
        torch.ops.pdserve.rope_qkv(qkv, cos[:1], sin[:1], 9, 3, None, 1e-6)


def test_the_layer_ops_refuse_what_does_not_fit():
    x = torch.randn(3, 64)
    with pytest.raises(RuntimeError, match=r"weight \[64\] in x's dtype"):
        native.rms_norm(x, torch.ones(32), 1e-5)
    with pytest.raises(RuntimeError, match="dtype float32, bfloat16 or float16"):
        native.rms_norm(x.double(), torch.ones(64, dtype=torch.float64), 1e-5)
    with pytest.raises(RuntimeError, match="2 \\* inter"):
        native.silu_mul(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="is not \\(9 \\+ 2 \\* 3\\) heads"):
        torch.ops.pdserve.rope_qkv(torch.randn(2, 100), torch.randn(2, 4), torch.randn(2, 4), 9, 3, None, 1e-6)


def test_the_isa_pick_is_kept_per_cpu_and_read_back(monkeypatch, tmp_path):
    """Inductor's pick (2.3 s of imports per process) is made once per CPU and torch version; a
    damaged record is picked again, and a CPU that says nothing of its features is never cached."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    picked = native._pick_isa()
    assert native._isa() == picked  # (the first: inductor's pick, now recorded)
    records = list((tmp_path / "kernels").glob("isa-*.json"))
    assert len(records) == 1 and json.loads(records[0].read_text())["flags"] == picked[1]

    def no_inductor() -> tuple[str, list[str], list[str]]:
        raise AssertionError("picked again where the record serves")

    monkeypatch.setattr(native, "_pick_isa", no_inductor)
    assert native._isa() == picked
    records[0].write_text('{"name": "avx2"')  # cut short
    monkeypatch.setattr(native, "_pick_isa", lambda: ("other", ["-mother"], ["-DOTHER"]))
    assert native._isa() == ("other", ["-mother"], ["-DOTHER"])
    assert json.loads(records[0].read_text())["name"] == "other"  # rewritten whole
    monkeypatch.setattr(native, "_cpu_key", lambda: "another-cpu")
    monkeypatch.setattr(native, "_pick_isa", lambda: ("third", [], []))
    assert native._isa() == ("third", [], []) and (tmp_path / "kernels" / "isa-another-cpu.json").is_file()
    monkeypatch.setattr(native, "_cpu_key", lambda: None)
    monkeypatch.setattr(native, "_pick_isa", lambda: ("fourth", [], []))
    assert native._isa() == ("fourth", [], [])
    assert len(list((tmp_path / "kernels").glob("isa-*.json"))) == 2


def test_the_cpu_key_follows_the_cpus_flags_and_torchs_version(monkeypatch):
    key = native._cpu_key()
    if not Path("/proc/cpuinfo").is_file():
        assert key is None
        return
    assert key is not None and len(key) == 16
    monkeypatch.setattr(native.torch, "__version__", "0.0.0-other")
    assert native._cpu_key() != key


def test_the_build_digest_covers_every_source_and_header(monkeypatch, tmp_path):
    csrc = Path(native.__file__).with_name("csrc")
    assert {p.name for p in csrc.iterdir() if p.suffix == ".cpp"} == {p.name for p in native.SOURCES}
    assert {p.name for p in csrc.iterdir() if p.suffix == ".h"} == {p.name for p in native.HEADERS}
    for source in native.SOURCES:  # every header a source includes is one the digest reads
        for line in source.read_text().splitlines():
            if line.startswith('#include "'):
                assert csrc / line.split('"')[1] in native.HEADERS, f"{source.name}: {line}"
    flags = ["-O3"]
    digest = native._digest(flags)
    header = tmp_path / "cpu_features.h"
    header.write_text(native.HEADERS[0].read_text() + "\n// changed\n")
    monkeypatch.setattr(native, "HEADERS", (header,))
    assert native._digest(flags) != digest  # a header's change rebuilds the library
    assert native._digest(["-O2"]) != native._digest(flags)
