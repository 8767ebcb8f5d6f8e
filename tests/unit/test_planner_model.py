"""The planner's cost model against the engine it models: shapes, bytes, FLOPs, profiles."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from pdserve_operator.planner import HardwareProfile, ModelShape, ServingModel, bundled_profile, load_profile
from pdserve_operator.planner.model_shape import LLAMA_7B, SMOLLM2_135M

ROOT = Path(__file__).resolve().parents[2]

CPU = HardwareProfile(
    name="t",
    device="cpu",
    dtype="float32",
    matmul_flops=1e11,
    memory_bandwidth=1e10,
    link_bandwidth=1e9,
    overlap_compute_memory=False,
    overlap_transfer=False,
)


def test_planner_imports_neither_torch_nor_the_worker():
    code = (
        "import sys, pdserve_operator.planner; "
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('pdserve_worker')]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    env_path = f"{ROOT / 'operator'}"
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_hf_config_parses_like_the_worker(tiny_model_dir):
    """Both parsers read the same config.json into the same geometry."""
    from pdserve_worker.model.config import ModelConfig

    data = json.loads((tiny_model_dir / "config.json").read_text())
    ours, theirs = ModelShape.from_hf_config(data), ModelConfig.from_hf(data)
    for a, b in [
        ("num_layers", "num_layers"),
        ("hidden_size", "hidden_size"),
        ("num_heads", "num_heads"),
        ("num_kv_heads", "num_kv_heads"),
        ("head_dim", "head_dim"),
        ("intermediate_size", "intermediate_size"),
        ("vocab_size", "vocab_size"),
        ("tie_word_embeddings", "tie_word_embeddings"),
    ]:
        assert getattr(ours, a) == getattr(theirs, b), a
    assert ModelShape.load(tiny_model_dir) == ModelShape.from_hf_config(data, name=tiny_model_dir.name)


def test_weight_and_kv_bytes_match_the_engines_tensors(tiny_model_dir):
    """Bytes a decode step reads, counted as benchmarks/engine.py counts the real model's tensors."""
    from pdserve_worker.model.loading.loader import load_model

    loaded = load_model(str(tiny_model_dir), dtype="float32")
    model = loaded.model
    total = model.norm.numel() * 4 + model.lm_head.numel() * 4
    for layer in model.layers.values():
        for t in (layer.attn_norm, layer.qkv, layer.o, layer.mlp_norm, layer.gate_up, layer.down):
            total += t.numel() * t.element_size()
    shape = ModelShape.load(tiny_model_dir)
    assert shape.weight_bytes(4) == total
    layout = loaded.config.kv_layout(1, 16, "float32")
    assert shape.kv_bytes_per_token(4) * 16 == layout.bytes_per_slot


def test_builtin_shapes_have_the_published_parameter_counts():
    # SmolLM2-135M: 134.5M parameters (tied); LLaMA-2-7B: 6.74B.
    assert SMOLLM2_135M.total_params == pytest.approx(134.5e6, rel=0.01)
    assert LLAMA_7B.total_params == pytest.approx(6.74e9, rel=0.01)
    # FACTS.md: 23 KB of bf16 KV per token for SmolLM2.
    assert SMOLLM2_135M.kv_bytes_per_token(2) == 30 * 2 * 3 * 64 * 2 == 23040


def test_bad_configs_are_refused_by_name():
    with pytest.raises(ValueError, match="lacks 'num_hidden_layers'"):
        ModelShape.from_hf_config({"hidden_size": 8, "num_attention_heads": 2})
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelShape("m", 1, 8, 3, 2, 4, 8, 10)
    with pytest.raises(ValueError, match="neither a built-in"):
        ModelShape.load("/nonexistent/model")


def test_prefill_time_grows_faster_than_linearly_and_decode_with_the_batch():
    model = ServingModel(SMOLLM2_135M, CPU)
    assert model.prefill_seconds(2048) > 2 * model.prefill_seconds(1024)  # causal attention is quadratic
    steps = [model.decode_step_seconds(b, b * 512) for b in (1, 2, 8, 32)]
    assert steps == sorted(steps) and steps[0] > 0
    assert model.decode_step_seconds(0, 0) == 0.0
    # Memory bound at batch 1 on this profile: the weight read dominates.
    assert model.decode_step_seconds(1, 1) == pytest.approx(
        model.weight_bytes / 1e10 + (SMOLLM2_135M.matmul_flops_per_token + SMOLLM2_135M.head_flops) / 1e11, rel=0.01
    )


def test_roofline_max_versus_sum_and_exposed_transfer():
    summed = ServingModel(SMOLLM2_135M, CPU)
    maxed = ServingModel(SMOLLM2_135M, CPU.with_overrides(overlap_compute_memory=True, overlap_transfer=True))
    assert maxed.decode_step_seconds(4, 400) < summed.decode_step_seconds(4, 400)
    # Overlapped push: only the last 4-layer chunk of 30 is exposed.
    assert maxed.exposed_transfer_seconds(1000) == pytest.approx(summed.transfer_seconds(1000) * 4 / 30, rel=1e-9)


def test_decode_capacity_from_slots_and_memory():
    npu = bundled_profile("ascend-910b")
    model = ServingModel(LLAMA_7B, npu, max_len=4096)
    free = 64e9 * 0.9 - LLAMA_7B.weight_bytes(2)
    assert model.decode_capacity == int(free // (4096 * LLAMA_7B.kv_bytes_per_token(2)))
    assert ServingModel(LLAMA_7B, npu, max_len=4096, slots=4).decode_capacity == 4
    assert ServingModel(SMOLLM2_135M, CPU).decode_capacity is None
    with pytest.raises(ValueError, match="do not fit"):
        ServingModel(LLAMA_7B, npu.with_overrides(memory_capacity_bytes=8e9))


def test_profiles_round_trip_and_refuse_bad_values(tmp_path):
    npu = bundled_profile("ascend-910b")
    assert npu.sources and npu.effective_matmul_flops == pytest.approx(1.4e14)
    for suffix in (".yaml", ".json"):
        path = tmp_path / f"p{suffix}"
        npu.dump(path)
        assert load_profile(path) == npu
    with pytest.raises(ValidationError):
        npu.with_overrides(memory_bandwidth=0)
    with pytest.raises(ValidationError):
        npu.with_overrides(compute_efficiency=1.5)
    with pytest.raises(ValidationError):
        HardwareProfile.model_validate({**npu.model_dump(), "unknown_field": 1})
    with pytest.raises(ValueError, match="neither a bundled profile"):
        load_profile(tmp_path / "missing.yaml")


def test_decode_can_run_on_other_hardware_than_prefill():
    """A bandwidth-rich decode device: decode steps and KV capacity follow its profile."""
    npu = bundled_profile("ascend-910b")
    fast_decode = npu.with_overrides(
        name="decode", memory_bandwidth=2 * npu.memory_bandwidth, memory_capacity_bytes=1.28e11
    )
    same = ServingModel(LLAMA_7B, npu, max_len=4096)
    split = ServingModel(LLAMA_7B, npu, max_len=4096, decode_profile=fast_decode)
    assert split.prefill_seconds(1000) == same.prefill_seconds(1000)
    assert split.decode_step_seconds(4, 4000) < same.decode_step_seconds(4, 4000)
    assert split.decode_capacity > same.decode_capacity
    with pytest.raises(ValueError, match="KV pushed must be read as written"):
        ServingModel(LLAMA_7B, npu, decode_profile=npu.with_overrides(dtype="bfloat16"))


def test_tensor_parallel_prefill_splits_the_layers_and_adds_two_ring_all_reduces_per_layer():
    """#32: at tp t the layers' FLOPs and weight reads are split t ways (embedding and LM head
    stay whole, as model/layers/tensor_parallel.py keeps them), each layer adds 2 ring
    all_reduces of n × hidden values, and min(t, KV heads) links carry the KV push."""
    s = SMOLLM2_135M
    assert s.tensor_parallel_sizes() == [1, 3, 9]
    prof = CPU.with_overrides(collective_bandwidth=2e9, collective_latency_s=1e-4)
    one, three = ServingModel(s, prof), ServingModel(s, prof, prefill_tp=3)
    n = 2048
    ring = 2 * (3 - 1) / 3 * n * s.hidden_size * 4 / 2e9
    assert three.all_reduce_seconds(n) == pytest.approx(2 * s.num_layers * (ring + 1e-4))
    head = s.head_params * 4
    gemm1 = (n * s.matmul_flops_per_token + s.head_flops) / 1e11 + one.weight_bytes / 1e10
    gemm3 = (n * s.matmul_flops_per_token / 3 + s.head_flops) / 1e11 + ((one.weight_bytes - head) / 3 + head) / 1e10
    attention1 = s.prefill_attention_flops(n) / 1e11
    assert one.prefill_seconds(n) == pytest.approx(gemm1 + attention1)
    assert three.prefill_seconds(n) == pytest.approx(gemm3 + attention1 / 3 + three.all_reduce_seconds(n))
    assert three.transfer_seconds(n) == pytest.approx(one.transfer_seconds(n) / 3)
    nine = ServingModel(s, prof, prefill_tp=9)  # 3 KV heads: 3 ranks push, 6 hold replicas
    assert nine.transfer_seconds(n) == pytest.approx(three.transfer_seconds(n))
    with pytest.raises(ValueError, match=r"prefill_tp 2 .* 9 heads over 3 KV heads; sizes that do: \[1, 3, 9\]"):
        ServingModel(s, prof, prefill_tp=2)
    with pytest.raises(ValueError, match=r"decode_tp 4 does not split"):
        ServingModel(s, prof, decode_tp=4)


def test_tensor_parallel_decode_splits_the_step_and_holds_more_requests_per_device():
    """#32: at decode_tp t a step reads 1/t of the layers' weights and of the KV per device and
    adds 2 all_reduces per layer of the batch's rows; each device holds its heads' KV, so more
    requests fit its memory."""
    s = LLAMA_7B
    prof = bundled_profile("ascend-910b")
    one, four = ServingModel(s, prof, max_len=4096), ServingModel(s, prof, max_len=4096, decode_tp=4)
    assert four.decode_step_seconds(8, 8 * 2048) < one.decode_step_seconds(8, 8 * 2048)
    ring = four._decode_all_reduce(8) - four._decode_all_reduce(0)
    assert ring == pytest.approx(2 * s.num_layers * 2 * 3 / 4 * 8 * s.hidden_size * 2 / prof.link_bandwidth)
    assert four.decode_capacity > 3 * one.decode_capacity  # (its weights shrink too)
