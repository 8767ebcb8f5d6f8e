"""A bf16 model on a CPU without native bf16: the native kernels on the bf16 weights against the
upcast blocks they replace, with the fp32 model beside them, in one run.

Three copies of the bundled model (dequantized), loaded once each and measured in turn, the
order reversed every other round (the machine's speed drifts over minutes; a figure is the
median over the rounds):
- `upcast_blocks`: bf16 weights, the route before (matmul's "fp32-upcast": torch's bf16 GEMV at
  one row, the weight widened block by block into a cached fp32 scratch for MKL beyond);
- `native_upcast`: bf16 weights on csrc/dense_linear.cpp and dense_gemm.cpp, which widen each
  weight in registers (exact) and take fp32 inputs (matmul's "native-upcast");
- `fp32_native`: the fp32 model on the same kernels (matmul's "native-decode").
Decode ms per step at batch 1, 8 and 16 (320 tokens of context) and prefill tokens/s at 123 and
256 tokens. Needs the native ops on an AVX2 CPU without AVX512-BF16 (where bf16 has no native
GEMM); elsewhere it says so and exits 1.

    python benchmarks/bf16_kernels.py [--rounds 3] [--quick]

Writes benchmarks/figures/bf16_kernels.json and .png (matplotlib: `pip install 'pdserve[plots]'`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from engine import ours_decode, ours_prefill  # noqa: E402
from pdserve_worker.model.layers import matmul  # noqa: E402
from pdserve_worker.model.loading.loader import load_model  # noqa: E402

ROUTES = ("upcast_blocks", "native_upcast", "fp32_native")
BATCHES = (1, 8, 16)
PROMPTS = (123, 256)


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def load(route: str):
    """The bundled model on `route` (the route is fixed when the model's Linear is made)."""
    dtype = "float32" if route == "fp32_native" else "bfloat16"
    chooses = matmul.native_upcast
    if route == "upcast_blocks":
        matmul.native_upcast = lambda device, dtype: False
    try:
        loaded = load_model(None, dtype=dtype, weights="dequantized")
    finally:
        matmul.native_upcast = chooses
    linear = loaded.model.linear
    say(f"{route}: loaded ({dtype}, upcast={linear.upcast}, native={linear.native_decode})")
    return loaded.model, dtype


def measure(model, dtype: str, quick: bool) -> dict[str, float]:
    figures = {f"decode_b{b}_ms": 1e3 * ours_decode(model, dtype, b, 320, 6 if quick else 12) for b in BATCHES}
    for length in PROMPTS:
        figures[f"prefill_{length}_tok_s"] = ours_prefill(model, dtype, length, 2 if quick else 3)
    return figures


def run(rounds: int, quick: bool) -> dict[str, dict[str, float]]:
    models = {route: load(route) for route in ROUTES}
    seen: dict[str, list[dict[str, float]]] = {route: [] for route in ROUTES}
    for r in range(rounds):
        order = ROUTES if r % 2 == 0 else ROUTES[::-1]
        for route in order:
            figures = measure(*models[route], quick)
            seen[route].append(figures)
            say(f"round {r + 1}/{rounds} {route}: " + ", ".join(f"{k} {v:.1f}" for k, v in figures.items()))
    return {route: {k: statistics.median(f[k] for f in runs) for k in runs[0]} for route, runs in seen.items()}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    medians = result["medians"]
    keys = list(medians["upcast_blocks"])
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / 2
    for i, route in enumerate(("native_upcast", "fp32_native")):
        speedup = [
            medians[route][k] / medians["upcast_blocks"][k]
            if k.endswith("tok_s")
            else medians["upcast_blocks"][k] / medians[route][k]
            for k in keys
        ]
        ax.bar([j + i * width for j in range(len(keys))], speedup, width, label=route.replace("_", " "))
    ax.axhline(1, color="grey", lw=0.8)
    ax.set_xticks(range(len(keys)), [k.replace("_", " ") for k in keys], rotation=30, ha="right")
    ax.set_ylabel("speed-up against bf16 on the upcast blocks (x)")
    ax.set_title(
        f"bundled model, median of {result['rounds']} rounds\n{result['date']} {result['machine']}", fontsize=9
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats")
    parser.add_argument("--out", type=Path, default=HERE / "figures")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if matmul.route(torch.device("cpu"), torch.bfloat16) != "native-upcast":
        print(
            f"bf16_kernels: bf16 takes {matmul.route(torch.device('cpu'), torch.bfloat16)!r} here, not the native kernels"
        )
        return 1
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line), "?")
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} vCPU {cpu} ({torch.backends.cpu.get_cpu_capability()}), torch {torch.__version__}, "
        f"{platform.python_version()}",
        "rounds": args.rounds,
    }
    result["medians"] = run(args.rounds, args.quick)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bf16_kernels.json").write_text(json.dumps(result, indent=1))
    try:
        plot(result, args.out / "bf16_kernels.png")
    except ImportError:
        say("matplotlib not installed: no plot (pip install 'pdserve[plots]')")
    say(f"wrote {args.out / 'bf16_kernels.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
