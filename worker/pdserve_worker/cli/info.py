"""`pdserve info`: versions, the default model's location, the transfer backend available, and
how this CPU runs the model (the dtype `--dtype auto` picks, each dtype's matmul route and the
quantized routes: the first thing to look at when decode is slower than expected).

`pdserve info --model PATH [--dtype D] [--weights W] [--max-len N] [--memory 64GiB] [--layer-shards K] [--tp N]`
instead describes a model (HF folder or GGUF file) without loading it: architecture,
parameters, dtype, the route of each layer type on a CPU worker with `--weights` and the bytes
it holds there, KV bytes per token, and how many KV slots of `--max-len` tokens fit in
`--memory` per device next to the weights (`model/loading/sizing.py`). The defaults are the
PDInferenceService spec's (bfloat16, 2048 or the model's context if shorter), and `--model`
also takes the spec's `builtin:smollm2`."""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "info",
        help="print versions, default model path and available backends; "
        "with --model, the model's size, KV bytes per token and slots that fit",
    )
    p.add_argument(
        "--model", default=None, help="HF folder, GGUF file or builtin:smollm2 to describe (nothing is loaded)"
    )
    p.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        default="bfloat16",
        help="weights and KV dtype (default bfloat16)",
    )
    p.add_argument(
        "--weights",
        choices=["auto", "dequantized", "int8", "int4"],
        default="auto",
        help="how a CPU worker holds the matrices (default auto): shown as cpu_routes per layer type",
    )
    p.add_argument(
        "--max-len",
        type=int,
        default=None,
        help="tokens per KV slot, as spec.model.maxLength (default 2048, or the model's context if shorter)",
    )
    p.add_argument(
        "--memory", default=None, help="device memory per worker, e.g. 64GiB, 32Gi, 80GB: how many slots fit"
    )
    p.add_argument("--layer-shards", type=int, default=1, help="decode workers one model is split over (default 1)")
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks of an instance: each rank's heads, weights and KV bytes (refused, naming "
        "the sizes that work, when they do not split the model's heads)",
    )
    p.set_defaults(func=run)


def _cpu() -> tuple[str | None, dict[str, object] | str]:
    """torch's version and how it runs the model on this CPU; info works without torch too
    (the operator image, a bare launcher check), saying so instead of failing."""
    try:
        import torch
    except ImportError:
        return None, "torch not installed"
    from pdserve_worker.cli.local_deployment import auto_dtype
    from pdserve_worker.model.layers import native
    from pdserve_worker.model.layers.matmul import QUANT_ROUTES, route

    return torch.__version__, {
        "threads": torch.get_num_threads(),
        "dtype_auto": auto_dtype(),
        "matmul": {
            name: route(torch.device("cpu"), getattr(torch, name)) for name in ("float32", "bfloat16", "float16")
        },
        "quantized_matmul": QUANT_ROUTES,
        "native_kernels": native.describe(),  # the ISA and the path each op takes (#56)
    }


def _model(args: argparse.Namespace) -> int:
    from pdserve_worker.model.loading.default_model import default_model_path, model_argument
    from pdserve_worker.model.loading.sizing import parse_bytes, report

    try:
        memory = parse_bytes(args.memory) if args.memory is not None else None
        if (args.max_len is not None and args.max_len <= 0) or args.layer_shards <= 0 or args.tp <= 0:
            raise ValueError(
                f"--max-len, --layer-shards and --tp must be positive, got {args.max_len}, {args.layer_shards}, "
                f"{args.tp}"
            )
        model = model_argument(args.model) or default_model_path()  # builtin:smollm2: the bundled GGUF
        described = report(model, args.dtype, args.max_len, memory, args.layer_shards, args.weights, args.tp)
        print(json.dumps(described, indent=2))
    except (OSError, ValueError) as exc:
        print(f"pdserve info: {exc}", file=sys.stderr)
        return 2
    return 0


def run(args: argparse.Namespace) -> int:
    if getattr(args, "model", None):
        return _model(args)
    from pdserve_worker import __version__
    from pdserve_worker.model.loading.default_model import ModelNotFound, default_model_path

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
