import json
import subprocess
import sys

from pdserve_worker.cli import COMMANDS, build_parser


def test_every_command_registers():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert set(COMMANDS) <= set(sub.choices)


def test_info_finds_the_default_model():
    out = subprocess.run(
        [sys.executable, "-m", "pdserve_worker.cli", "info"], capture_output=True, text=True, check=True
    )
    info = json.loads(out.stdout)
    assert info["default_model"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf"), info


def test_info_reports_the_cpu_matmul_route_the_engine_takes():
    import torch

    from pdserve_worker.model.matmul import Linear

    out = subprocess.run(
        [sys.executable, "-m", "pdserve_worker.cli", "info"], capture_output=True, text=True, check=True
    )
    cpu = json.loads(out.stdout)["cpu"]
    assert cpu["dtype_auto"] in ("float32", "bfloat16")
    routes = {"fp32-upcast", "onednn-prepacked", "plain"}
    assert set(cpu["matmul"]) == {"float32", "bfloat16", "float16"} and set(cpu["matmul"].values()) <= routes
    for name, shown in cpu["matmul"].items():
        linear = Linear(torch.device("cpu"), getattr(torch, name))
        taken = "fp32-upcast" if linear.upcast else "onednn-prepacked" if linear.prepack else "plain"
        assert shown == taken, f"{name}: info says {shown}, the engine takes {taken}"


def test_no_module_named_operator_is_importable_from_the_project():
    import operator

    assert operator.__file__ is None or "pdserve" not in operator.__file__
    assert hasattr(operator, "itemgetter")
