"""The native fp32 kernels against oneDNN and torch's GEMM, the fp32 weights' routes, in one run.

Two parts, each printing progress:
1. The matrices of a step alone: the default model's shapes (SmolLM2-135M: per layer the fused
   QKV 960 x 576, the output 576 x 576, gate/up 3,072 x 576, down 576 x 1,536, and the 49,152 x
   576 head once), 30 distinct layers so the weights come from memory as in a real step (538
   MB of fp32); ms for one pass at 1 to 512 input rows on oneDNN's prepacked weights (the route
   before, matmul.REORDER_ROWS), on `F.linear` (torch's GEMM on the plain weight), on the
   small-M kernel (csrc/dense_linear.cpp) and, from 16 rows, on the register-tile GEMM
   (csrc/dense_gemm.cpp), with the weight bytes each pass reads per second.
2. The bundled model in fp32 (dequantized from its GGUF), loaded once with each route: decode
   step at batch 1, 8 and 16 (320 tokens of context) and prefill tokens/s at 123 (the vLLM
   comparison's batch-1 prompt), 256 and 1,024 (benchmarks/engine.py's measurements). Routes:
   oneDNN prepacked; `native` (the small-M kernel up to matmul.DENSE_KERNEL_MAX_ROWS rows, the
   GEMM up to DENSE_GEMM_MAX_ROWS, torch's beyond); `native_no_gemm` (the route before the GEMM:
   the small-M kernel up to 128 rows, torch's beyond).

    python benchmarks/dense_kernel.py [--quick]

Writes benchmarks/figures/dense_kernel.json and .png (matplotlib: `pip install 'pdserve[plots]'`).
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
import torch.nn.functional as F  # noqa: E402

from engine import median_seconds, ours_decode, ours_prefill  # noqa: E402
from pdserve_worker.model.layers import matmul, native  # noqa: E402
from pdserve_worker.model.loading.loader import load_model  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD = (49152, 576)
LAYERS = 30
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
GEMM_FROM = 16  # rows from which the GEMM is measured (it is not the route below)


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def matrices(rows: tuple[int, ...], repeats: int) -> dict[str, dict[int, float]]:
    """ms for one pass over LAYERS layers' matrices and the head at each row count, per route."""
    gen = torch.Generator().manual_seed(0)
    say(f"{LAYERS} layers of {SHAPES} and a {HEAD} head in fp32")
    plain = [torch.randn(s, generator=gen) * 0.02 for _ in range(LAYERS) for s in SHAPES] + [torch.randn(HEAD) * 0.02]
    packed = [matmul._reorder(w) for w in plain]
    routes = {
        "onednn_prepacked": lambda x, i: matmul._prepacked_linear(x, packed[i]),
        "torch_gemm": lambda x, i: F.linear(x, plain[i]),
        "native": lambda x, i: native.dense_linear(x, plain[i], None),
        "native_gemm": lambda x, i: native.dense_gemm(x, plain[i], None),
    }
    out: dict[str, dict[int, float]] = {name: {} for name in routes}
    for m in rows:
        xs = {k: torch.randn(m, k, generator=gen) for k in (576, 1536)}
        for name, run in routes.items():
            if name == "native_gemm" and m < GEMM_FROM:
                continue

            def step(run=run) -> None:
                for i, w in enumerate(plain):
                    run(xs[w.shape[1]], i)

            out[name][m] = 1e3 * median_seconds(step, repeats)
        gb = sum(w.numel() for w in plain) * 4 / 1e9
        say(
            f"rows {m:4d}: "
            + "  ".join(f"{n} {v[m]:7.1f} ms ({gb / v[m] * 1e3:4.1f} GB/s)" for n, v in out.items() if m in v)
            + f"  native / prepacked {out['native'][m] / out['onednn_prepacked'][m]:.2f}"
        )
    return out


def model(quick: bool) -> dict[str, dict[str, float]]:
    """The bundled model in fp32 on each route: decode ms per step and prefill tokens/s."""
    out: dict[str, dict[str, float]] = {}
    chooses, limits = matmul.native_dense, (matmul.DENSE_KERNEL_MAX_ROWS, matmul.DENSE_GEMM_MAX_ROWS)
    for name in ("onednn_prepacked", "native_no_gemm", "native"):
        matmul.native_dense = chooses if name != "onednn_prepacked" else (lambda device, dtype: False)  # at load
        loaded = load_model(None, dtype="float32", weights="dequantized")
        matmul.native_dense = chooses
        if name == "native_no_gemm":  # read at every call
            matmul.DENSE_KERNEL_MAX_ROWS = matmul.DENSE_GEMM_MAX_ROWS = 128
        say(f"{name}: the bundled model loaded (fp32, native_decode={loaded.model.linear.native_decode})")
        figures: dict[str, float] = {}
        try:
            for batch in (1, 8, 16):
                figures[f"decode_b{batch}_ms"] = 1e3 * ours_decode(
                    loaded.model, "float32", batch, 320, 8 if quick else 16
                )
                say(f"{name}: decode batch {batch}: {figures[f'decode_b{batch}_ms']:.1f} ms/step")
            for length in (123, 256, 1024):
                figures[f"prefill_{length}_tok_s"] = ours_prefill(loaded.model, "float32", length, 3 if quick else 5)
                say(f"{name}: prefill {length}: {figures[f'prefill_{length}_tok_s']:.0f} tokens/s")
        finally:
            matmul.DENSE_KERNEL_MAX_ROWS, matmul.DENSE_GEMM_MAX_ROWS = limits
        out[name] = figures
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, series in result["matrices_ms"].items():
        rows = sorted(int(r) for r in series)
        left.plot(rows, [series[r] for r in rows], marker="o", label=name.replace("_", " "))
    left.set(xscale="log", yscale="log", xlabel="input rows", ylabel=f"ms for {LAYERS} layers' matrices + head")
    left.set_title("fp32 matrices of SmolLM2-135M's shapes")
    left.legend()
    keys = list(result["model"]["native"])
    names = [n for n in result["model"] if n != "onednn_prepacked"]
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ratios = [result["model"]["onednn_prepacked"][k] / result["model"][name][k] for k in keys]
        ratios = [1 / r if k.endswith("tok_s") else r for k, r in zip(keys, ratios)]
        right.bar([j + i * width for j in range(len(keys))], ratios, width, label=name.replace("_", " "))
    right.legend()
    right.axhline(1, color="grey", lw=0.8)
    right.set_xticks(range(len(keys)), [k.replace("_", " ") for k in keys], rotation=30, ha="right")
    right.set_ylabel("speed-up against oneDNN prepacked (x)")
    right.set_title("bundled model, fp32")
    fig.suptitle(f"{result['date']} {result['machine']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats and row counts")
    parser.add_argument("--out", type=Path, default=HERE / "figures")
    args = parser.parse_args()
    if not (native.available() and torch.ops.pdserve.dense_linear_supported()):
        print("dense_kernel: the native fp32 kernel does not run on this machine (no AVX2/FMA, or not built)")
        return 1
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line), "?")
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} vCPU {cpu} ({torch.backends.cpu.get_cpu_capability()}), torch {torch.__version__}, "
        f"{platform.python_version()}",
        "matrices_ms": matrices(ROWS[::2] if args.quick else ROWS, 3 if args.quick else 7),
        "model": model(args.quick),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dense_kernel.json").write_text(json.dumps(result, indent=1))
    try:
        plot(result, args.out / "dense_kernel.png")
    except ImportError:
        say("matplotlib not installed: no plot (pip install 'pdserve[plots]')")
    say(f"wrote {args.out / 'dense_kernel.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
