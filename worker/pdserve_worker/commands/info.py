"""`pdserve info`: versions, the default model's location and the transfer backend available."""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help="print versions, default model path and available backends")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pdserve_worker import __version__
    from pdserve_worker.model.default_model import ModelNotFound, default_model_path

    try:
        model = str(default_model_path())
    except ModelNotFound as exc:
        model = f"missing: {exc}"
    print(
        json.dumps(
            {
                "pdserve": __version__,
                "python": platform.python_version(),
                "default_model": model,
                "hixl_available": importlib.util.find_spec("hixl") is not None,
                "torch_npu_available": importlib.util.find_spec("torch_npu") is not None,
            },
            indent=2,
        )
    )
    return 0
