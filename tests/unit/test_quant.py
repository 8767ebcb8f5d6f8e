"""Quantized weights kept quantized: GGUF blocks split exactly, packed for torch's int4 kernel
exactly, and a model on them equal to its dequantized self where it should be.

The reference for what a block means is the `gguf` package (`gguf.quants.dequantize`, which
reads ggml-common.h's `block_q4_0` / `block_q4_1` / `block_q8_0` as llama.cpp does); for the
kernel, torch's own `_weight_int4pack_mm_for_cpu` (int4mm_kernel.cpp: value = (nibble - 8) *
scale + zero, scale and zero in the activation dtype, fp32 accumulation).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pdserve_worker.kv.cache import KVCache
from pdserve_worker.model.layers.matmul import Int4Matrix, Linear, pack_int4
from pdserve_worker.model.layers.quant import dequantize, from_gguf_blocks, nibbles, quantize, to_kind
from pdserve_worker.model.layers.weight_routes import group_route, loaded_weight_bytes, plan, summary
from pdserve_worker.model.loading import loader
from pdserve_worker.model.loading.convert import quantized_gguf
from pdserve_worker.model.loading.loader import load_model, loaded_bytes
from pdserve_worker.model.loading.weights import read_gguf, read_gguf_quantized, read_quantized_dir
from support.tiny_model import write_tiny_gguf

TYPES = ("Q4_0", "Q4_1", "Q8_0")
CPU = torch.device("cpu")


def gguf_blocks(values: np.ndarray, type_name: str) -> np.ndarray:
    return gguf.quants.quantize(values.astype(np.float32), gguf.GGMLQuantizationType[type_name])


def gguf_values(blocks: np.ndarray, type_name: str, shape) -> torch.Tensor:
    return torch.from_numpy(
        np.asarray(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[type_name]), dtype=np.float32).reshape(
            shape
        )
    )


def random_blocks(rows: int, cols: int, type_name: str, seed: int) -> np.ndarray:
    """Arbitrary block bytes (any fp16 scale, any nibble, int8 -128 included): what a file may hold."""
    rng = np.random.default_rng(seed)
    per_block = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[type_name]
    data = rng.integers(0, 256, size=(rows, cols // 32, per_block), dtype=np.uint8)
    scales = rng.uniform(-0.05, 0.05, size=(rows, cols // 32, 2 if type_name == "Q4_1" else 1)).astype(np.float16)
    data[..., 0:2] = scales[..., 0:1].view(np.uint8)
    if type_name == "Q4_1":
        data[..., 2:4] = scales[..., 1:2].view(np.uint8)
    return data.reshape(rows, -1)


@pytest.mark.parametrize("type_name", TYPES)
def test_blocks_split_exactly_as_gguf_reads_them(type_name):
    for seed, (rows, cols) in enumerate([(48, 96), (5, 32), (64, 576)]):
        for blocks in (
            gguf_blocks(np.random.default_rng(seed).normal(size=(rows, cols)) * 0.02, type_name),
            random_blocks(rows, cols, type_name, seed),
        ):
            t = from_gguf_blocks(blocks, type_name, (rows, cols))
            assert t.kind == ("q8" if type_name == "Q8_0" else "q4") and t.shape == (rows, cols)
            assert torch.equal(dequantize(t), gguf_values(blocks, type_name, (rows, cols)))


def test_refusals_name_what_was_wrong():
    with pytest.raises(ValueError, match="Q5_K is not kept quantized"):
        from_gguf_blocks(np.zeros((2, 176), np.uint8), "Q5_K", (2, 256))
    with pytest.raises(ValueError, match="not whole blocks of 32"):
        from_gguf_blocks(np.zeros((2, 20), np.uint8), "Q4_1", (2, 40))
    with pytest.raises(ValueError, match="whole blocks of 32"):
        quantize(torch.zeros(4, 40), "q4")
    with pytest.raises(ValueError, match="cannot stack matrices of widths"):
        pack_int4([quantize(torch.ones(16, 32), "q4"), quantize(torch.ones(16, 64), "q4")])


def test_float_weights_quantize_with_llama_cpps_reference_rounding():
    w = torch.randn(32, 64) * 0.1
    for kind, type_name in (("q4", "Q4_1"), ("q8", "Q8_0")):
        t = quantize(w, kind)
        assert torch.equal(dequantize(t), gguf_values(gguf_blocks(w.numpy(), type_name), type_name, (32, 64)))
    # Requantizing to another kind goes through the values; the same kind is untouched.
    t8 = quantize(w, "q8")
    assert to_kind(t8, "q8") is t8
    assert torch.equal(dequantize(to_kind(t8, "q4")), dequantize(quantize(dequantize(t8), "q4")))


def kernel_values(matrix: Int4Matrix, rows: int, cols: int) -> torch.Tensor:
    """The weight torch's kernel multiplies by: the product with the identity (bf16, exact sums)."""
    eye = torch.eye(cols, dtype=torch.bfloat16)
    return Linear(CPU, torch.bfloat16)(eye, matrix).t()[:rows].float()


def int4_weights(t) -> torch.Tensor:
    """What the kernel multiplies a q4 tensor's values as, in fp32: (nibble - 8) * bf16(d) + bf16(z), with
    z = m + 8 d + (mean nibble - 8)(d - bf16(d)): the zero that leaves each group's error mean-free."""
    rows, cols = t.shape
    d = t.scale.to(torch.bfloat16).float()
    mean = nibbles(t).float().reshape(rows, -1, 32).mean(-1)
    zero = (t.minimum + 8 * t.scale + (mean - 8) * (t.scale - d)).to(torch.bfloat16).float()
    return ((nibbles(t).float() - 8).reshape(rows, -1, 32) * d[..., None] + zero[..., None]).reshape(rows, cols)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1"])
def test_int4_packing_keeps_every_nibble_and_gives_scale_times_nibble_plus_minimum(type_name):
    rows, cols = 48, 96
    t = from_gguf_blocks(random_blocks(rows, cols, type_name, 7), type_name, (rows, cols))
    packed = pack_int4([t])
    # The nibbles, through torch's packing and kernel: scale 1 and zero 8 give back the nibble itself.
    ones = packed.scales_zeros.clone()
    ones[..., 0], ones[..., 1] = 1, 8
    assert torch.equal(kernel_values(Int4Matrix(packed.packed, ones, packed.shape), rows, cols), nibbles(t).float())
    # The values: d * q + m with d and the zero m + 8 d in bf16 (the kernel's own dtype), rounded once.
    assert torch.equal(kernel_values(packed, rows, cols), int4_weights(t).to(torch.bfloat16).float())
    # ... which is the GGUF value up to bf16 rounding of the scale and the zero, and mean-free per group
    # before the zero's rounding: the scale's rounding no longer shifts a whole group one way.
    exact = gguf_values(random_blocks(rows, cols, type_name, 7), type_name, (rows, cols))
    bound = (16 * t.scale.abs() + (t.minimum + 8 * t.scale).abs()).repeat_interleave(32, 1) * 2.0**-8
    assert ((kernel_values(packed, rows, cols) - exact).abs() <= bound + exact.abs() * 2.0**-8).all()
    unrounded_zero = (
        t.minimum
        + 8 * t.scale
        + (nibbles(t).float().reshape(rows, -1, 32).mean(-1) - 8) * (t.scale - t.scale.to(torch.bfloat16).float())
    )
    unrounded = (nibbles(t).float() - 8).reshape(rows, -1, 32) * t.scale.to(torch.bfloat16).float()[
        ..., None
    ] + unrounded_zero[..., None]
    group_error = (unrounded - exact.reshape(rows, -1, 32)).sum(-1)
    assert group_error.abs().max() <= 1e-6 * exact.abs().max() * 32


def test_eight_bit_blocks_run_exactly_as_two_planes():
    rows, cols = 40, 64  # 40 rows: padded to 48 for torch's packing, the extra rows cut off
    t8 = from_gguf_blocks(random_blocks(rows, cols, "Q8_0", 3), "Q8_0", (rows, cols))
    assert int(t8.q.min()) == -128 and int(t8.q.max()) == 127  # every int8 value is representable
    packed = pack_int4([t8], planes=2)
    d = t8.scale.to(torch.bfloat16).float()
    expected = (t8.q.float().reshape(rows, -1, 32) * d[..., None]).reshape(rows, cols)
    assert torch.equal(kernel_values(packed, rows, cols), expected.to(torch.bfloat16).float())
    # A 4-bit part beside it (a fused group of mixed kinds) is exact in two planes as well.
    t4 = from_gguf_blocks(random_blocks(16, cols, "Q4_1", 4), "Q4_1", (16, cols))
    mixed = pack_int4([t4, t8], planes=2)
    assert mixed.shape == (56, cols)
    assert torch.equal(kernel_values(mixed, 56, cols)[16:], expected.to(torch.bfloat16).float())
    assert torch.equal(kernel_values(mixed, 56, cols)[:16], kernel_values(pack_int4([t4]), 16, cols))
    with pytest.raises(ValueError, match="two 4-bit planes"):
        pack_int4([t8], planes=1)


def test_linear_on_a_quantized_matrix_casts_back_and_adds_the_bias():
    t = quantize(torch.randn(24, 64), "q4")
    linear = Linear(CPU, torch.float32, native_quant=False)  # torch's route (the native one: test_quant_kernel.py)
    matrix = linear.prepare_quantized([t], "int4")
    x, bias = torch.randn(2, 3, 64), torch.randn(24)
    y = linear(x, matrix, bias=bias)
    assert y.shape == (2, 3, 24) and y.dtype == torch.float32
    # bf16 inputs, fp32 sums, one rounding of the product to bf16 (the kernel's output), then the bias in fp32.
    product = x.to(torch.bfloat16).float() @ int4_weights(t).t()
    assert ((y - bias - product).abs() <= product.abs() * 2.0**-8 + 1e-5).all()
    with pytest.raises(ValueError, match="quantized route must be one of"):
        linear.prepare_quantized([t], "int2")


def test_routes_follow_the_checkpoint_and_the_request():
    assert group_route("auto", ["q4", "q4", "q4"]) == "int4"
    assert group_route("auto", ["q4", "q8"]) == "int8"
    assert group_route("auto", ["q4", None]) == "dequantized"  # a float part: as before
    assert group_route("auto", ["q4"], "cuda") == "dequantized"  # the kernels are CPU kernels
    assert group_route("int8", [None]) == "int8" and group_route("dequantized", ["q4"]) == "dequantized"
    with pytest.raises(ValueError, match="--weights int4 runs on the CPU only"):
        group_route("int4", ["q4"], "npu")
    with pytest.raises(ValueError, match="weights must be one of"):
        group_route("int3", ["q4"])


def tiny_quantized_gguf(path, types=("Q4_1", "Q4_0", "Q8_0")):
    """A tiny llama GGUF whose matrices are quantized, cycling through `types` (the embedding Q8_0)."""
    names = {"token_embd.weight": "Q8_0", "output.weight": types[0]}
    parts = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    for layer in range(4):
        for i, part in enumerate(parts):
            names[f"blk.{layer}.{part}.weight"] = types[(layer + i) % len(types)]
    return write_tiny_gguf(path, seed=11, quantized=names)


def test_gguf_matrices_read_quantized_equal_the_dequantized_reading(tmp_path):
    path = tiny_quantized_gguf(tmp_path / "q.gguf")
    config, matrices = read_gguf_quantized(path)
    dequantized = read_gguf(path).tensors  # gguf.quants.dequantize, Q/K unpermuted
    assert len(matrices) == 2 + 4 * 7
    for name, matrix in matrices.items():
        assert torch.equal(dequantize(matrix), dequantized[name]), name


def test_the_quantized_cache_entry_holds_the_blocks_and_is_made_once(tmp_path):
    path = tiny_quantized_gguf(tmp_path / "q.gguf")
    folder = quantized_gguf(path, root=tmp_path / "cache")
    stat = (folder / "model.safetensors").stat()
    assert quantized_gguf(path, root=tmp_path / "cache") == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stat.st_mtime_ns
    stored = read_quantized_dir(folder)
    _, matrices = read_gguf_quantized(path)
    assert stored.keys() == matrices.keys()
    for name, matrix in matrices.items():
        assert torch.equal(stored[name].q, matrix.q) and torch.equal(stored[name].scale, matrix.scale)
    assert read_quantized_dir(folder, ["lm_head.weight", "no.such.weight"]).keys() == {"lm_head.weight"}


@pytest.fixture(scope="module")
def quantized_models(tmp_path_factory, monkeypatch_module):
    folder = tmp_path_factory.mktemp("q-gguf")
    monkeypatch_module.setenv("PDSERVE_CACHE_DIR", str(folder / "cache"))
    path = tiny_quantized_gguf(folder / "q.gguf")
    return path, load_model(str(path), dtype="float32", weights="auto"), load_model(str(path), dtype="float32")


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_auto_keeps_what_the_gguf_holds_and_stays_close_to_dequantized(quantized_models):
    path, quant, plain = quantized_models
    # Groups of 4-bit parts only run int4; with a Q8_0 part, int8 (every part exact in two planes).
    assert quant.model.routes["model.layers.2.mlp_gate_up"] == "int4"  # Q4_1 + Q4_0 parts
    assert quant.model.routes["model.layers.0.attn_qkv"] == "int8"  # Q4_1, Q4_0, Q8_0 parts
    assert quant.model.routes["model.layers.0.mlp_down"] == "int4"  # Q4_1
    assert quant.model.routes["model.layers.2.mlp_down"] == "int8"  # Q8_0
    assert quant.model.routes["lm_head"] == "int4"  # untied output.weight, Q4_1
    assert plain.routes == {k: "dequantized" for k in ("lm_head", "attn_qkv", "attn_o", "mlp_gate_up", "mlp_down")}
    assert quant.routes["attn_qkv"] == "int8" and quant.routes["mlp_down"] == "int4 (3 layers), int8 (1 layers)"
    ids = quant.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    layout = quant.config.kv_layout(1, 64, "float32")
    a = quant.model.prefill(ids, KVCache.allocate(layout), 0)
    b = plain.model.prefill(ids, KVCache.allocate(layout), 0)
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.999
    # The head's largest logits are refined in fp32 from the exact rows: the argmax agrees.
    assert int(a.argmax()) == int(b.argmax())


def test_only_float_tensors_that_stay_float_are_read(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = tiny_quantized_gguf(tmp_path / "q.gguf")
    seen: list[str] = []
    real = loader.read_safetensors_dir
    monkeypatch.setattr(loader, "read_safetensors_dir", lambda folder, names: seen.extend(names) or real(folder, names))
    load_model(str(path), dtype="float32", weights="auto")
    assert "model.embed_tokens.weight" in seen  # the lookup's rows
    assert not [n for n in seen if n.endswith("_proj.weight") or n == "lm_head.weight"]


def test_float_checkpoints_quantize_on_request(tiny_model_dir):
    plain = load_model(str(tiny_model_dir), dtype="float32", weights="auto")
    assert set(plain.routes.values()) == {"dequantized"}  # auto: an HF folder holds floats
    ids = plain.tokenizer.encode("Paris is the capital of France")
    layout = plain.config.kv_layout(1, 64, "float32")
    want = plain.model.prefill(ids, KVCache.allocate(layout), 0)
    for weights in ("int4", "int8"):
        loaded = load_model(str(tiny_model_dir), dtype="float32", weights=weights)
        assert set(loaded.routes.values()) == {weights}
        got = loaded.model.prefill(ids, KVCache.allocate(layout), 0)
        assert torch.nn.functional.cosine_similarity(got, want, dim=0) > (
            0.97 if weights == "int4" else 0.999
        )  # 4 bits of random normals: about 20 dB


def test_memory_check_counts_packed_sizes(tiny_model_dir):
    config = load_model(str(tiny_model_dir), dtype="float32").config
    layers = range(config.num_layers)
    dense = loaded_bytes(config, "bfloat16", layers, CPU)
    int4 = loaded_bytes(config, "bfloat16", layers, CPU, plan(config, "int4", {}, layers))
    int8 = loaded_bytes(config, "bfloat16", layers, CPU, plan(config, "int8", {}, layers))
    assert int4 < int8 < dense
    # The bytes counted are the bytes held: every packed matrix of a loaded model.
    model = load_model(str(tiny_model_dir), dtype="bfloat16", weights="int4").model
    held = model.lm_head.nbytes + sum(m.nbytes for w in model.layers.values() for m in (w.qkv, w.o, w.gate_up, w.down))
    routes = plan(config, "int4", {}, layers)
    counted = loaded_weight_bytes(config, "bfloat16", routes, layers, tied_copy=True)
    floats = sum(t.numel() * 2 for t in [model.embed_tokens, model.norm]) + sum(
        w.attn_norm.numel() * 2 + w.mlp_norm.numel() * 2 for w in model.layers.values()
    )
    assert counted == held + floats
    assert summary(routes) == {k: "int4" for k in ("lm_head", "attn_qkv", "attn_o", "mlp_gate_up", "mlp_down")}


def test_packed_prefill_equals_one_prompt_at_a_time(quantized_models, tiny_model_dir):
    _, quant, _ = quantized_models
    plain = load_model(str(tiny_model_dir), dtype="float32")
    prompts = [[5, 6, 7, 8, 9], [10, 11], list(range(20, 60)), [3]]
    slots = [2, 0, 3, 1]
    for loaded in (quant, plain):
        layout = loaded.config.kv_layout(4, 64, "float32")
        alone, packed = KVCache.allocate(layout), KVCache.allocate(layout)
        want = torch.stack([loaded.model.prefill(p, alone, s) for p, s in zip(prompts, slots)])
        seen: list[range] = []
        got = loaded.model.prefill_batch(prompts, packed, slots, layers_per_chunk=3, on_chunk=seen.append)
        assert seen == [range(0, 3), range(3, 4)]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
        for p, s in zip(prompts, slots):  # each prompt's KV in its own slot, nothing else written
            torch.testing.assert_close(
                packed.tensor[s][:, :, : len(p)], alone.tensor[s][:, :, : len(p)], rtol=1e-5, atol=1e-5
            )
            assert not packed.tensor[s][:, :, len(p) :].any()
    with pytest.raises(ValueError, match="one slot per prompt"):
        plain.model.prefill_batch([[1]], KVCache.allocate(plain.config.kv_layout(2, 8, "float32")), [0, 1])
    with pytest.raises(ValueError, match="a slot appears twice"):
        plain.model.prefill_batch([[1], [2]], KVCache.allocate(plain.config.kv_layout(2, 8, "float32")), [1, 1])
    with pytest.raises(ValueError, match="prompt 1 of the batch has no tokens"):
        plain.model.prefill_batch([[1], []], KVCache.allocate(plain.config.kv_layout(2, 8, "float32")), [0, 1])
    with pytest.raises(ValueError, match="prompt 0 of 9 tokens exceeds"):
        plain.model.prefill_batch([list(range(9))], KVCache.allocate(plain.config.kv_layout(1, 8, "float32")), [0])


def test_info_shows_the_cpu_route_of_each_layer_type_without_loading(tmp_path):
    from pdserve_worker.model.loading.sizing import report

    path = tiny_quantized_gguf(tmp_path / "q.gguf", types=("Q4_1",))
    auto = report(path, "bfloat16", 64)
    assert auto["weights"] == "auto"
    assert auto["cpu_routes"] == {
        "lm_head": "int4",
        "attn_qkv": "int4",
        "attn_o": "int4",
        "mlp_gate_up": "int4",
        "mlp_down": "int4",
    }
    dense = report(path, "bfloat16", 64, weights="dequantized")
    assert set(dense["cpu_routes"].values()) == {"dequantized"}
    assert auto["cpu_weights_bytes"] < dense["cpu_weights_bytes"]
    with pytest.raises(ValueError, match="weights must be one of"):
        report(path, "bfloat16", 64, weights="int2")
