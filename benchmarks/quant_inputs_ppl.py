"""What the opt-in int8 inputs to 4-bit weights (`PDSERVE_QUANT_INPUTS=int8`) cost in quality:
the bundled model's perplexity on English text, three ways in one process.

Run:  .venv/bin/python benchmarks/quant_inputs_ppl.py [--text FILE ...] [--window 1024]

- `dequantized`: the GGUF's weights dequantized to fp32 (the file's model as HF transformers
  computes it; tests compare our models with transformers elsewhere);
- `auto, fp32 inputs`: the served default (`--weights auto`: 4-bit matrices on the native block
  kernel, exact fp32 inputs);
- `auto, int8 inputs`: the same with each input block of 32 quantized to 8 bits (llama.cpp's
  Q4 x Q8 dot products: faster, benchmarks/README.md "Opt-in int8 inputs").

The text (default: this repository's README.md and docs/*.md, technical English) is cut into
windows of --window tokens, each computed from an empty cache; the perplexity is exp of the
mean negative log-likelihood of every token after the first of its window. Prints a line per
configuration as it finishes; a figure to quote is the int8 row's ratio to the fp32 row's.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve  # noqa: E402,F401  (puts worker/ and the rest on sys.path)

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = (
    ("dequantized", "dequantized", "fp32"),
    ("auto, fp32 inputs", "auto", "fp32"),
    ("auto, int8 inputs", "auto", "int8"),
)


def mean_nll(model, ids: list[int], window: int, label: str) -> float:
    """Mean negative log-likelihood of each window's tokens after its first."""
    import torch

    from pdserve_worker.kv.cache import KVCache
    from pdserve_worker.model.layers.llama import PrefillOutputs

    cache = KVCache.allocate(model.config.kv_layout(1, window, "float32"))
    total, count = 0.0, 0
    starts = range(0, len(ids) - 1, window)
    with torch.inference_mode():
        for n, start in enumerate(starts):
            chunk = ids[start : start + window]
            if len(chunk) < 2:
                continue
            final: list[torch.Tensor] = []
            model.prefill(chunk, cache, 0, outputs=PrefillOutputs(logits=False, on_final=final.append))
            logprobs = torch.log_softmax(model.head(final[0]).float()[:-1], dim=-1)
            total -= logprobs.gather(1, torch.tensor(chunk[1:])[:, None]).sum().item()
            count += len(chunk) - 1
            if n % 10 == 9:
                print(f"  [{label}] {n + 1}/{len(starts)} windows", flush=True)
    return total / count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", type=Path, nargs="*", help="text files (default: README.md and docs/*.md)")
    parser.add_argument("--window", type=int, default=1024, help="tokens per window")
    args = parser.parse_args(argv)
    import torch

    from pdserve_worker.model.layers import native
    from pdserve_worker.model.loading.loader import load_model

    files = args.text or [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    text = "\n\n".join(f.read_text() for f in files)
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    rows = []
    for label, weights, inputs in CONFIGS:
        os.environ[native.QUANT_INPUTS_ENV] = inputs  # read when a matrix is built (matmul.Linear)
        started = time.perf_counter()
        loaded = load_model(None, dtype="float32", weights=weights)
        ids = loaded.tokenizer.encode(text)
        nll = mean_nll(loaded.model, ids, args.window, label)
        rows.append((label, nll))
        print(f"{label}: {len(ids)} tokens, perplexity {math.exp(nll):.4f} ({time.perf_counter() - started:.0f} s)")
    base = dict(rows)["auto, fp32 inputs"]
    print("\n| weights | perplexity | ÷ fp32 inputs |\n|---|---|---|")
    for label, nll in rows:
        print(f"| {label} | {math.exp(nll):.4f} | {math.exp(nll - base):.4f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
