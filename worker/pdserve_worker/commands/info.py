"""`pdserve info`: versions, the default model's location, the transfer backend available, and
how this CPU runs the model (the dtype `--dtype auto` picks and each dtype's matmul route: the
first thing to look at when decode is slower than expected)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help="print versions, default model path and available backends")
    p.set_defaults(func=run)


def _cpu() -> tuple[str | None, dict[str, object] | str]:
    """torch's version and how it runs the model on this CPU; info works without torch too
    (the operator image, a bare launcher check), saying so instead of failing."""
    try:
        import torch
    except ImportError:
        return None, "torch not installed"
    from pdserve_worker.local import auto_dtype
    from pdserve_worker.model.matmul import route

    return torch.__version__, {
        "threads": torch.get_num_threads(),
        "dtype_auto": auto_dtype(),
        "matmul": {name: route(torch.device("cpu"), getattr(torch, name)) for name in ("float32", "bfloat16", "float16")},
    }


def run(args: argparse.Namespace) -> int:
    from pdserve_worker import __version__
    from pdserve_worker.model.default_model import ModelNotFound, default_model_path

    try:
        model = str(default_model_path())
    except ModelNotFound as exc:
        model = f"missing: {exc}"
    torch_version, cpu = _cpu()
    print(
        json.dumps(
            {
                "pdserve": __version__,
                "python": platform.python_version(),
                "default_model": model,
                "hixl_available": importlib.util.find_spec("hixl") is not None,
                "torch_npu_available": importlib.util.find_spec("torch_npu") is not None,
                "torch": torch_version,
                "cpu": cpu,
            },
            indent=2,
        )
    )
    return 0
