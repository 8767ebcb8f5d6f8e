import json
import subprocess
import sys

import pytest

from pdserve_worker.cli.main import COMMANDS, build_parser


def test_every_command_registers():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert set(COMMANDS) <= set(sub.choices)


def test_info_finds_the_default_model():
    out = subprocess.run(
        [sys.executable, "-m", "pdserve_worker.cli.main", "info"], capture_output=True, text=True, check=True
    )
    info = json.loads(out.stdout)
    assert info["default_model"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf"), info


def test_info_reports_the_cpu_matmul_route_the_engine_takes():
    import torch

    from pdserve_worker.model.layers.matmul import Linear

    out = subprocess.run(
        [sys.executable, "-m", "pdserve_worker.cli.main", "info"], capture_output=True, text=True, check=True
    )
    cpu = json.loads(out.stdout)["cpu"]
    assert cpu["dtype_auto"] in ("float32", "bfloat16")
    routes = {"fp32-upcast", "native-upcast", "native-decode", "onednn-prepacked", "plain"}
    assert set(cpu["matmul"]) == {"float32", "bfloat16", "float16"} and set(cpu["matmul"].values()) <= routes
    for name, shown in cpu["matmul"].items():
        linear = Linear(torch.device("cpu"), getattr(torch, name))
        taken = (
            "native-upcast"
            if linear.upcast and linear.native_decode
            else "fp32-upcast"
            if linear.upcast
            else "native-decode"
            if linear.native_decode
            else "onednn-prepacked"
            if linear.prepack
            else "plain"
        )
        assert shown == taken, f"{name}: info says {shown}, the engine takes {taken}"


def test_no_module_named_operator_is_importable_from_the_project():
    import operator

    assert operator.__file__ is None or "pdserve" not in operator.__file__
    assert hasattr(operator, "itemgetter")


def test_local_refuses_a_max_len_beyond_the_model_before_starting_anything(tiny_model_dir, tmp_path):
    """`pdserve local --model DIR --max-len N` with N above the model's context: one line naming
    the limit and the flag, no process started (before, every worker died with a traceback)."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve_worker.cli.main",
            "local",
            "--model",
            str(tiny_model_dir),
            "--max-len",
            "4096",
            "--port",
            "0",
            "--log-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert "max_len 4096 exceeds the model's max_position_embeddings 512" in out.stderr and "--max-len" in out.stderr
    assert "Traceback" not in out.stderr and "started" not in out.stderr
    assert not list(tmp_path.glob("*.log"))


def test_local_max_len_defaults_to_2048_or_the_models_context():
    from pdserve_worker.model.config import ModelConfig

    short = ModelConfig(
        vocab_size=8,
        hidden_size=8,
        intermediate_size=8,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        max_position_embeddings=512,
    )
    assert short.serving_max_len(None) == 512 and short.serving_max_len(100) == 100
    assert ModelConfig(**{**short.to_dict(), "max_position_embeddings": 8192}).serving_max_len(None) == 2048
    windowed = ModelConfig(**{**short.to_dict(), "architecture": "mistral", "sliding_window": 256})
    assert windowed.serving_max_len(None) == 256
    with pytest.raises(ValueError, match="sliding_window 256"):
        windowed.serving_max_len(300)


def test_info_describes_the_builtin_model_by_its_spec_name():
    """`spec.model.source: builtin:smollm2` is what a PDInferenceService names; `pdserve info --model`
    takes the same. SmolLM2-135M: 30 layers x 2 (K, V) x 3 KV heads x 64 x 2 bytes = 23040."""
    out = subprocess.run(
        [sys.executable, "-m", "pdserve_worker.cli.main", "info", "--model", "builtin:smollm2"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert (info["architecture"], info["layers"], info["kv_heads"], info["head_dim"]) == ("llama", 30, 3, 64)
    assert info["kv_bytes_per_token"] == 30 * 2 * 3 * 64 * 2 == 23040
