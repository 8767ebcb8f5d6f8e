"""The native block kernel against torch's int4 kernel, the weights' own route, in one run.

Two parts, each printing progress:
1. The matrices of a decode step alone: the default model's shapes (SmolLM2-135M: per layer
   the fused QKV 960 x 576, the output 576 x 576, gate/up 3,072 x 576, down 576 x 1,536), 30
   distinct layers so the weights come from memory as in a real step, quantized to 4 bits
   (Q4_1, llama.cpp's reference rounding); ms for all 30 layers at 1 to 512 input rows, on
   torch's `_weight_int4pack_mm_for_cpu` (matmul.pack_int4) and on ours (matmul.pack_native).
2. The bundled model as served (`--weights auto`: its GGUF blocks kept, Q4 layers 4-bit, its
   Q8_0 layers 8-bit), loaded once on each kernel: decode step at batch 1, 8 and 16, and prefill
   tokens/s at 256 and 1,024 tokens (benchmarks/engine.py's measurements).

    python benchmarks/quant_kernel.py [--quick]

Writes benchmarks/figures/quant_kernel.json and .png (needs matplotlib: `pip install
'pdserve[plots]'`, a benchmark extra).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from engine import median_seconds, ours_decode, ours_prefill  # noqa: E402
from pdserve_worker.cli.local_deployment import auto_dtype  # noqa: E402
from pdserve_worker.model.layers import native  # noqa: E402
from pdserve_worker.model.layers.matmul import Linear  # noqa: E402
from pdserve_worker.model.layers.quant import quantize  # noqa: E402
from pdserve_worker.model.loading.loader import load_model  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def matrices(rows: tuple[int, ...], repeats: int) -> dict[str, dict[int, float]]:
    """ms for one pass over LAYERS layers' matrices at each row count, per kernel."""
    cpu = torch.device("cpu")
    kernels = {"torch": Linear(cpu, torch.bfloat16, native_quant=False), "native": Linear(cpu, torch.bfloat16)}
    gen = torch.Generator().manual_seed(0)
    say(f"quantizing {LAYERS} layers of {SHAPES} to Q4_1")
    blocks = [[quantize(torch.randn(s, generator=gen) * 0.02, "q4") for s in SHAPES] for _ in range(LAYERS)]
    held = {
        name: [[k.prepare_quantized([b], "int4") for b in layer] for layer in blocks] for name, k in kernels.items()
    }
    out: dict[str, dict[int, float]] = {name: {} for name in kernels}
    for m in rows:
        xs = [torch.randn(m, s[1], generator=gen).to(torch.bfloat16) for s in SHAPES]
        for name, linear in kernels.items():

            def step(linear=linear, name=name) -> None:
                for layer in held[name]:
                    for x, w in zip(xs, layer):
                        linear(x, w)

            out[name][m] = 1e3 * median_seconds(step, repeats)
        say(
            f"rows {m:4d}: torch {out['torch'][m]:8.2f} ms  native {out['native'][m]:8.2f} ms  "
            f"ratio {out['native'][m] / out['torch'][m]:.2f}"
        )
    return out


def model(quick: bool) -> dict[str, dict[str, float]]:
    """The bundled model on each kernel: decode ms per step and prefill tokens/s."""
    dtype = auto_dtype()
    out: dict[str, dict[str, float]] = {}
    serves = native.quant_serves
    for name in ("torch", "native"):
        native.quant_serves = serves if name == "native" else (lambda: False)  # what Linear asks at load
        loaded = load_model(None, dtype=dtype, weights="auto")
        native.quant_serves = serves
        kind = type(loaded.model.layers[0].qkv).__name__
        say(f"{name}: the bundled model loaded ({dtype}, matrices as {kind})")
        figures: dict[str, float] = {}
        for batch in (1, 8, 16):
            figures[f"decode_b{batch}_ms"] = 1e3 * ours_decode(loaded.model, dtype, batch, 128, 8 if quick else 16)
            say(f"{name}: decode batch {batch}: {figures[f'decode_b{batch}_ms']:.1f} ms/step")
        for length in (256, 1024):
            figures[f"prefill_{length}_tok_s"] = ours_prefill(loaded.model, dtype, length, 2 if quick else 3)
            say(f"{name}: prefill {length}: {figures[f'prefill_{length}_tok_s']:.0f} tokens/s")
        out[name] = figures
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, series in result["matrices_ms"].items():
        rows = sorted(int(r) for r in series)
        left.plot(rows, [series[r] for r in rows], marker="o", label=f"{name} int4 kernel")
    left.set(xscale="log", yscale="log", xlabel="input rows", ylabel=f"ms for {LAYERS} layers' matrices")
    left.set_title("4-bit matrices of SmolLM2-135M's shapes")
    left.legend()
    keys = list(result["model"]["native"])
    ratios = [result["model"]["torch"][k] / result["model"]["native"][k] for k in keys]
    ratios = [1 / r if k.endswith("tok_s") else r for k, r in zip(keys, ratios)]
    right.bar(range(len(keys)), ratios)
    right.axhline(1, color="grey", lw=0.8)
    right.set_xticks(range(len(keys)), [k.replace("_", " ") for k in keys], rotation=30, ha="right")
    right.set_ylabel("speed-up of the native kernel (x)")
    right.set_title("bundled model, --weights auto")
    fig.suptitle(f"{result['date']} {result['machine']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats and row counts")
    parser.add_argument("--out", type=Path, default=HERE / "figures")
    args = parser.parse_args()
    if not native.quant_serves():
        print("quant_kernel: the native block kernel does not serve on this machine (no AVX2, or not built)")
        return 1
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line), "?")
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} vCPU {cpu}, torch {torch.__version__}, {platform.python_version()}",
        "matrices_ms": matrices(ROWS[::2] if args.quick else ROWS, 3 if args.quick else 7),
        "model": model(args.quick),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quant_kernel.json").write_text(json.dumps(result, indent=1))
    try:
        plot(result, args.out / "quant_kernel.png")
    except ImportError:
        say("matplotlib not installed: no plot (pip install 'pdserve[plots]')")
    say(f"wrote {args.out / 'quant_kernel.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
