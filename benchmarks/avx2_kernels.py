"""What the AVX2 kernels of 2026-12-06 give against what they replace, in one run, two parts:

1. Causal prefill attention (csrc/prefill_attention_fp32.cpp) against torch's SDPA, fp32 and bf16,
   SmolLM2-135M's 9 heads over 3 KV heads of 64, prompts of 128 to 2,000 tokens, interleaved
   (each a median of 7, the pair repeated `--rounds` times; the median pair is kept).
2. A bf16 model on a CPU without native bf16: the native kernels on the bf16 weights against the
   upcast blocks they replace, with the fp32 model beside them. Three copies of the bundled model (dequantized), loaded once each and measured in turn, the
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

    python benchmarks/avx2_kernels.py [--rounds 3] [--quick]

Writes benchmarks/figures/avx2_kernels.json and .png (matplotlib: `pip install 'pdserve[plots]'`).
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
import torch.nn.functional as F  # noqa: E402

from engine import median_seconds, ours_decode, ours_prefill  # noqa: E402
from pdserve_worker.model.layers import matmul, native  # noqa: E402
from pdserve_worker.model.loading.loader import load_model  # noqa: E402

ROUTES = ("upcast_blocks", "native_upcast", "fp32_native")
ATTENTION_TOKENS = (128, 256, 512, 2000)
BATCHES = (1, 8, 16)
PROMPTS = (123, 256)


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def attention(rounds: int) -> dict[str, dict[int, dict[str, float]]]:
    """ms of one layer's causal attention over a whole prompt: the kernel and torch's SDPA."""
    out: dict[str, dict[int, dict[str, float]]] = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        out[name] = {}
        for tokens in ATTENTION_TOKENS:
            gen = torch.Generator().manual_seed(tokens)
            q, k, v = (torch.randn(tokens, h, 64, generator=gen).to(dtype) for h in (9, 3, 3))

            def sdpa() -> None:
                F.scaled_dot_product_attention(
                    *(t[None].transpose(1, 2) for t in (q, k, v)), is_causal=True, enable_gqa=True
                )

            def kernel() -> None:
                native.causal_attention(q, k, v)

            pairs = [(median_seconds(sdpa, 7), median_seconds(kernel, 7)) for _ in range(rounds)]
            torch_s, ours_s = sorted(pairs, key=lambda p: p[1] / p[0])[len(pairs) // 2]
            out[name][tokens] = {"sdpa_ms": 1e3 * torch_s, "kernel_ms": 1e3 * ours_s}
            say(f"attention {name} {tokens} tokens: SDPA {1e3 * torch_s:.2f} ms, kernel {1e3 * ours_s:.2f} ms")
    return out


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
    fig, (left, ax) = plt.subplots(1, 2, figsize=(13, 4), gridspec_kw={"width_ratios": [1, 1.4]})
    for name, series in result["attention"].items():
        by_tokens = {int(t): f for t, f in series.items()}  # (int keys in memory, str from the JSON)
        tokens = sorted(by_tokens)
        speedup = [by_tokens[t]["sdpa_ms"] / by_tokens[t]["kernel_ms"] for t in tokens]
        left.plot(tokens, speedup, marker="o", label=name)
    left.axhline(1, color="grey", lw=0.8)
    left.set(xscale="log", xlabel="prompt tokens", ylabel="speed-up against torch's SDPA (x)")
    left.set_xticks(ATTENTION_TOKENS, [str(t) for t in ATTENTION_TOKENS])
    left.minorticks_off()
    left.set_title("causal prefill attention, 9 heads over 3 KV heads of 64", fontsize=9)
    left.legend()
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
            f"avx2_kernels: bf16 takes {matmul.route(torch.device('cpu'), torch.bfloat16)!r} here, not the native kernels"
        )
        return 1
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line), "?")
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} vCPU {cpu} ({torch.backends.cpu.get_cpu_capability()}), torch {torch.__version__}, "
        f"{platform.python_version()}",
        "rounds": args.rounds,
    }
    if not native.prefill_serves(*(torch.zeros(1, h, 64) for h in (9, 3, 3))):
        print("avx2_kernels: the fp32 prefill attention kernel does not serve here")
        return 1
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    result["attention"] = attention(args.rounds)
    result["medians"] = run(args.rounds, args.quick)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "avx2_kernels.json").write_text(json.dumps(result, indent=1))
    try:
        plot(result, args.out / "avx2_kernels.png")
    except ImportError:
        say("matplotlib not installed: no plot (pip install 'pdserve[plots]')")
    say(f"wrote {args.out / 'avx2_kernels.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
