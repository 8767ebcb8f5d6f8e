"""config.json → ModelConfig, against transformers' config classes; refusals by name; the Ascend
sample's Qwen2.5-7B-Instruct on the meta device (no weights) and the arithmetic in its comment."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml

from pdserve_worker.kv.cache import KVCache
from pdserve_worker.model.config import ModelConfig
from pdserve_worker.model.families import NAMES
from pdserve_worker.model.layers.llama import LlamaModel
from pdserve_worker.model.loading.sizing import Sizing, parse_bytes, report
from pdserve_worker.model.shapes import parameter_count, weight_shapes

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "manifests" / "samples" / "qwen7b-ascend.yaml"
GIB, MIB, KIB = 1024**3, 1024**2, 1024

# Qwen/Qwen2.5-7B-Instruct config.json as published (the model card: 7.61B parameters, 28 layers,
# 28 query heads and 4 KV heads, QKV bias, 32,768-token context, YaRN for longer).
QWEN25_7B_INSTRUCT = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "initializer_range": 0.02,
    "intermediate_size": 18944,
    "max_position_embeddings": 32768,
    "max_window_layers": 28,
    "model_type": "qwen2",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 152064,
}
MINIMAL = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


@pytest.mark.parametrize("model_type", NAMES)
@pytest.mark.parametrize(
    "extra",
    [{}, {"use_sliding_window": True, "max_window_layers": 1}, {"sliding_window": None}],
    ids=["defaults", "sliding-on", "no-window"],
)
def test_keys_left_out_get_transformers_defaults(model_type, extra):
    """A config.json with only the sizes: our reading equals transformers' config class's."""
    import transformers

    data = {"model_type": model_type, **MINIMAL, **extra}
    ours = ModelConfig.from_hf(data)
    hf = transformers.AutoConfig.for_model(**data)
    assert ours.max_position_embeddings == hf.max_position_embeddings
    assert ours.rms_norm_eps == hf.rms_norm_eps
    assert ours.rope_theta == hf.rope_parameters["rope_theta"]
    assert ours.tie_word_embeddings == hf.tie_word_embeddings
    assert ours.num_kv_heads == hf.num_key_value_heads
    assert ours.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    layer_types = getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers
    window = getattr(hf, "sliding_window", None)
    slides = window is not None and (model_type == "mistral" or "sliding_attention" in layer_types)
    assert ours.sliding_window == (window if slides else None)


@pytest.mark.parametrize("model_type", NAMES)
def test_kv_heads_left_out_default_as_in_transformers(model_type):
    import transformers

    data = {"model_type": model_type, **MINIMAL, "num_attention_heads": 32, "hidden_size": 256}
    del data["num_key_value_heads"]
    hf = transformers.AutoConfig.for_model(**data)
    assert ModelConfig.from_hf(data).num_kv_heads == hf.num_key_value_heads


def test_biases_and_norms_per_family_are_transformers_modules():
    import transformers

    for model_type, extra in [
        ("llama", {}),
        ("llama", {"attention_bias": True}),
        ("mistral", {"attention_bias": True}),
        ("qwen2", {}),
        ("qwen3", {}),
        ("qwen3", {"attention_bias": True}),
    ]:
        data = {"model_type": model_type, **MINIMAL, **extra}
        with torch.device("meta"):
            hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**data))
        expected = {name: tuple(p.shape) for name, p in hf.named_parameters()}
        assert weight_shapes(ModelConfig.from_hf(data)) == expected, (model_type, extra)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "qwen2_moe"}, "model_type 'qwen2_moe' is not supported"),
        ({"quantization_config": {"quant_method": "awq"}}, "quantization_config .quant_method 'awq'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"mlp_bias": True}, "mlp_bias=true"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope_type 'longrope'"),
        ({"rope_scaling": {"type": "su", "factor": 4.0}}, "rope_type 'su'"),
        ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling.factor"),
        ({"rope_scaling": "yarn"}, "rope_scaling must be an object"),
        ({"hidden_size": 0}, "hidden_size must be a positive integer"),
        ({"num_hidden_layers": "28"}, "num_hidden_layers must be a positive integer"),
        ({"layer_types": ["full_attention", "chunked_attention"]}, "layer_types .'chunked_attention'."),
        ({"num_key_value_heads": 3}, "multiple of num_kv_heads"),
    ],
)
def test_what_the_engine_cannot_compute_exactly_is_refused_by_name(change, message):
    data = {**QWEN25_7B_INSTRUCT, "model_type": "llama", **change}
    if "layer_types" in change:
        data.update(model_type="qwen2", num_hidden_layers=2)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(data)


def test_rope_scaling_is_read_as_transformers_standardizes_it():
    yarn = ModelConfig.from_hf(
        {
            **QWEN25_7B_INSTRUCT,
            "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"},
        }
    )
    assert yarn.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert yarn.max_position_embeddings == 131072  # Qwen2.5's documented 128K with YaRN
    # transformers 5 writes rope_parameters with rope_theta inside; `rope_scaling` wins over it.
    v5 = ModelConfig.from_hf(
        {**MINIMAL, "model_type": "llama", "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}}
    )
    assert (v5.rope_theta, v5.rope_scaling) == (5e5, None)
    llama3 = ModelConfig.from_hf(
        {
            **MINIMAL,
            "model_type": "llama",
            "max_position_embeddings": 4096,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0},
        }
    )
    assert llama3.rope_scaling["original_max_position_embeddings"] == 4096  # standardize_rope_params' default


# ---- the Ascend sample: Qwen2.5-7B-Instruct ---------------------------------------------------------


def test_qwen25_7b_is_accepted_and_runs_on_the_meta_device():
    """The published config through our engine with meta tensors: every weight the loader would ask
    for, the shapes transformers builds, and a forward (shapes only) through all 28 layers."""
    import transformers

    config = ModelConfig.from_hf(QWEN25_7B_INSTRUCT)
    assert (config.architecture, config.qkv_bias, config.o_bias, config.qk_norm) == ("qwen2", True, False, False)
    assert (config.num_kv_heads, config.head_dim, config.sliding_window) == (4, 128, None)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(transformers.Qwen2Config(**QWEN25_7B_INSTRUCT))
    assert weight_shapes(config) == {n: tuple(p.shape) for n, p in hf.named_parameters()}
    assert parameter_count(config) == hf.num_parameters() == 7_615_616_512  # "7.61B"

    weights = {
        name: torch.empty(shape, dtype=torch.bfloat16, device="meta") for name, shape in weight_shapes(config).items()
    }
    model = LlamaModel(config, weights, dtype=torch.bfloat16, device="meta")
    cache = KVCache.allocate(config.kv_layout(2, 8192, "bfloat16"), device="meta")
    hidden = torch.empty(1, 16, config.hidden_size, dtype=torch.bfloat16, device="meta")
    out = model.run_layers(hidden, range(config.num_layers), cache, [1], [0])
    assert out.shape == (1, 16, 3584)
    assert model.head(out[:, -1]).shape == (1, 152064)
    step = model.run_layers(
        torch.empty(2, 1, 3584, dtype=torch.bfloat16, device="meta"), range(28), cache, [0, 1], [16, 16]
    )
    assert step.shape == (2, 1, 3584)


def test_the_samples_comment_states_the_right_arithmetic():
    """Each number in the decode slots comment of manifests/samples/qwen7b-ascend.yaml, recomputed."""
    text = SAMPLE.read_text()
    spec = yaml.safe_load(text)["spec"]
    comment = " ".join(line.strip().lstrip("#").strip() for line in text.splitlines() if line.strip().startswith("#"))
    config = ModelConfig.from_hf(QWEN25_7B_INSTRUCT)
    slots, max_len = spec["decode"]["slots"], spec["model"]["maxLength"]
    assert spec["model"]["dtype"] == "bfloat16"

    m = re.search(r"(\d+) layers x 2 \(K, V\) x (\d+) KV heads x (\d+) x (\d+) bytes = (\d+) KiB per token", comment)
    assert m, comment
    layers, kv_heads, head_dim, size, kib = map(int, m.groups())
    assert (layers, kv_heads, head_dim, size) == (config.num_layers, config.num_kv_heads, config.head_dim, 2)
    assert kib * KIB == config.kv_bytes_per_token("bfloat16") == 57344
    m = re.search(r"a slot of (\d+) tokens is (\d+) MiB and (\d+) slots take (\d+) GiB", comment)
    assert m, comment
    tokens, slot_mib, count, total_gib = map(int, m.groups())
    assert (tokens, count) == (max_len, slots)
    assert slot_mib * MIB == config.kv_layout(1, max_len, "bfloat16").bytes_per_slot
    assert total_gib * GIB == config.kv_layout(slots, max_len, "bfloat16").total_bytes
    m = re.search(r"([\d.]+) GiB of bf16 weights \(([\d.]+)B parameters\)", comment)
    assert m, comment
    assert float(m.group(1)) == round(parameter_count(config) * 2 / GIB, 1)
    assert float(m.group(2)) == round(parameter_count(config) / 1e9, 2)
    m = re.search(r"--memory (\d+)GiB` prints this arithmetic: (\d+) slots would fit", comment)
    assert m, comment
    assert Sizing(config, "bfloat16", max_len).slots_fitting(int(m.group(1)) * GIB) == int(m.group(2))
    assert int(m.group(2)) >= slots


# ---- pdserve info --model -------------------------------------------------------------------------


def _qwen_folder(tmp_path: Path, **change) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({**QWEN25_7B_INSTRUCT, **change}))
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {
                "bos_token_id": 151643,
                "do_sample": True,
                "eos_token_id": [151645, 151643],
                "pad_token_id": 151643,
                "repetition_penalty": 1.05,
                "temperature": 0.7,
                "top_k": 20,
                "top_p": 0.8,
            }
        )
    )
    return tmp_path


def test_info_prints_the_model_and_the_slots_that_fit(tmp_path):
    folder = _qwen_folder(tmp_path)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve_worker.cli.main",
            "info",
            "--model",
            str(folder),
            "--max-len",
            "8192",
            "--memory",
            "32GiB",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    info = json.loads(out.stdout)
    assert (info["architecture"], info["parameters"], info["parameters_human"]) == ("qwen2", 7_615_616_512, "7.62B")
    assert (info["checkpoint_dtype"], info["dtype"], info["kv_bytes_per_token"]) == ("bfloat16", "bfloat16", 57344)
    assert info["memory"]["slots"] == 40 and info["memory"]["weights_fit"]
    assert info["generation"]["eos_token_ids"] == [151645, 151643]


def test_info_with_layer_shards_counts_each_members_share(tmp_path):
    config = ModelConfig.from_hf(QWEN25_7B_INSTRUCT)
    info = report(_qwen_folder(tmp_path), "bfloat16", 8192, parse_bytes("16Gi"), layer_shards=2)
    members = info["members"]
    assert [m["layers"] for m in members] == [[0, 13], [14, 27]]
    # Each member: its 14 layers' KV, and its layers' weights plus the embedding and the head.
    assert members[0]["slot_bytes"] == 14 * 2 * 4 * 128 * 2 * 8192
    globals_ = 2 * 152064 * 3584 + 3584  # embedding, head, final norm
    assert members[0]["weights_bytes"] == parameter_count(config, range(14)) * 2
    assert members[0]["weights_bytes"] == (globals_ + (parameter_count(config) - globals_) // 2) * 2
    expected = (16 * GIB - members[0]["weights_bytes"]) // members[0]["slot_bytes"]
    assert info["memory"]["slots"] == expected == 36  # 8.1 GiB of weights, 224 MiB slots
    # One worker of 16 GiB: 1.8 GiB left after the weights, 4 slots of 448 MiB; of 12 GiB: none.
    assert report(_qwen_folder(tmp_path), "bfloat16", 8192, parse_bytes("16Gi"))["memory"]["slots"] == 4
    small = report(_qwen_folder(tmp_path), "bfloat16", 8192, parse_bytes("12Gi"))["memory"]
    assert (small["slots"], small["weights_fit"]) == (0, False)


def test_info_with_tp_shows_each_ranks_share_and_refuses_a_size_the_heads_cannot_take(tmp_path):
    config = ModelConfig.from_hf(QWEN25_7B_INSTRUCT)  # 28 query heads over 4 KV heads
    ranks = report(_qwen_folder(tmp_path), "bfloat16", 8192, tp=4)["tensor_parallel"]
    assert [(r["heads"], r["kv_heads"]) for r in ranks] == [([7 * i, 7 * i + 6], [i, i]) for i in range(4)]
    assert all(r["kv_bytes_per_token"] == config.kv_bytes_per_token() // 4 for r in ranks)
    globals_ = 2 * 152064 * 3584 + 3584  # embedding, head, final norm: replicated on every rank
    norms = 28 * 2 * 3584  # each layer's two RMSNorm weights: replicated too
    layers = parameter_count(config) - globals_ - norms
    assert ranks[0]["weights_bytes"] == (globals_ + norms + layers // 4) * 2
    out = subprocess.run(
        [sys.executable, "-m", "pdserve_worker.cli.main", "info", "--model", str(_qwen_folder(tmp_path)), "--tp", "3"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "sizes that work: [1, 2, 4, 28]" in out.stderr, out.stderr


def test_info_works_without_torch(tmp_path):
    folder = _qwen_folder(tmp_path)
    code = (
        "import sys; sys.modules['torch'] = None; from pdserve_worker.cli.main import main; "
        f"sys.exit(main(['info', '--model', {str(folder)!r}, '--memory', '80GB', '--tp', '2']))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["memory"]["budget_bytes"] == 80 * 10**9


def test_info_refuses_bad_input_with_the_reason(tmp_path):
    folder = _qwen_folder(tmp_path)
    for args, message in [
        (["--memory", "lots"], "not a size"),
        (["--max-len", "40000"], "max_position_embeddings"),
        (["--layer-shards", "29"], "shards must be in 1..28"),
    ]:
        out = subprocess.run(
            [sys.executable, "-m", "pdserve_worker.cli.main", "info", "--model", str(folder), *args],
            capture_output=True,
            text=True,
        )
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr)


def test_parse_bytes():
    assert parse_bytes("64GiB") == parse_bytes("64Gi") == 64 * GIB
    assert parse_bytes("80GB") == parse_bytes("80G") == 80 * 10**9
    assert parse_bytes("1.5TiB") == int(1.5 * 1024**4)
    assert parse_bytes("4096") == 4096
    for bad in ("", "-1GiB", "64 gigs", "GiB"):
        with pytest.raises(ValueError):
            parse_bytes(bad)


def test_info_without_max_len_takes_the_models_context_when_it_is_shorter(tmp_path):
    """`pdserve info --model DIR` describes any model it accepts: without --max-len a slot is
    2048 tokens or the model's whole context (or sliding window) if that is shorter; an explicit
    --max-len beyond it is still refused by name."""

    def folder(name: str, **change) -> Path:
        (tmp_path / name).mkdir()
        return _qwen_folder(tmp_path / name, **change)

    def info(model: Path, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "pdserve_worker.cli.main", "info", "--model", str(model), *args],
            capture_output=True,
            text=True,
        )

    short = folder("short", max_position_embeddings=1024)
    out = info(short)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["max_len"] == 1024
    windowed = folder("windowed", use_sliding_window=True, sliding_window=512, max_window_layers=0)
    assert json.loads(info(windowed).stdout)["max_len"] == 512
    assert json.loads(info(folder("long")).stdout)["max_len"] == 2048
    assert json.loads(info(short, "--max-len", "1000").stdout)["max_len"] == 1000
    refused = info(short, "--max-len", "4096")
    assert refused.returncode == 2 and "max_len 4096 exceeds the model's max_position_embeddings 1024" in refused.stderr


@pytest.mark.parametrize("model_type", NAMES)
@pytest.mark.parametrize("extra", [{}, {"attention_bias": True}, {"use_sliding_window": True, "sliding_window": 64}])
def test_every_family_writes_back_a_config_json_transformers_loads_as_the_same_model(model_type, extra):
    """`to_hf` of a family's config is read by transformers as that family's class
    (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, the table AutoModelForCausalLM dispatches on) with the same
    parameters, and reads back here as the same ModelConfig."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    ours = ModelConfig.from_hf({"model_type": model_type, **MINIMAL, **extra})
    written = ours.to_hf()
    assert written["architectures"] == [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]
    assert ModelConfig.from_hf(written) == ours
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**written))
    assert type(hf).__name__ == written["architectures"][0]
    assert weight_shapes(ours) == {name: tuple(p.shape) for name, p in hf.named_parameters()}


def test_switches_no_config_json_of_the_family_can_state_are_refused_on_the_way_out():
    mistral = ModelConfig.from_hf({"model_type": "mistral", **MINIMAL})
    with pytest.raises(ValueError, match="mistral has no config.json for qkv_bias=True"):
        replace(mistral, qkv_bias=True).to_hf()
    with pytest.raises(ValueError, match="architecture 'gemma' is not one of"):
        replace(mistral, architecture="gemma")
