"""Decode tokens/s at the largest batch one KV memory admits: max-length slots against blocks.

The memory is that of `--slots 8 --max-len 2048` (16,384 tokens of KV). Requests are 300
prompt + 64 output tokens (issue #16). Slots admit 8 of them whatever they need; blocks of 16
tokens admit 16,384 // 368 = 44. Both run the same model, dtype and threads in one run:

- slots:  batch 8 over the slot pool (today's decode);
- blocks: batch 8 over the block pool (what the gather of paged attention costs at equal batch);
- blocks: the largest batch the memory admits.

Figures are medians of decode-step times (after warmup) over the 64 output tokens; aggregate
tokens/s = batch / step time.

    PYTHONPATH=worker:common:proto python benchmarks/kv_blocks.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for folder in ("worker", "operator", "common", "proto"):
    sys.path.insert(0, str(ROOT / folder))

import torch  # noqa: E402

from pdserve_worker.cli.local_deployment import auto_dtype  # noqa: E402
from pdserve_worker.kv.blocks import blocks_for  # noqa: E402
from pdserve_worker.kv.cache import KVCache, dtype_name  # noqa: E402
from pdserve_worker.kv.paged import PagedKVCache  # noqa: E402
from pdserve_worker.model.loading.loader import load_model  # noqa: E402

SLOTS, MAX_LEN, PROMPT, OUTPUT, BLOCK = 8, 2048, 300, 64, 16


def prompt_ids(length: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (length,), generator=g).tolist()


def run(model, cache, handles: list[int], steps: int) -> float:
    """`steps` batched decode steps after prompts of PROMPT tokens: median seconds per step.

    The prompts' KV is random rather than prefilled: a decode step's time does not depend on
    the values it reads, and 44 prefills of 300 tokens would cost more than the measurement."""
    vocab = model.config.vocab_size
    torch.manual_seed(0)
    cache.tensor.copy_(torch.randn(cache.tensor.shape, dtype=torch.float32).to(cache.tensor.dtype) * 0.5)
    tokens = [prompt_ids(1, vocab, h)[0] for h in handles]
    positions = [PROMPT] * len(handles)
    times = []
    for step in range(steps):
        started = time.perf_counter()
        logits = model.decode_step(cache, handles, positions, tokens)
        tokens = logits.argmax(-1).tolist()
        positions = [p + 1 for p in positions]
        if step >= 3:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--quick", action="store_true", help="16 decode steps instead of 64")
    args = parser.parse_args()
    dtype = auto_dtype() if args.dtype == "auto" else args.dtype
    loaded = load_model(args.model, dtype=dtype)
    model, config = loaded.model, loaded.config
    steps = 16 if args.quick else OUTPUT
    per_request = blocks_for(PROMPT + OUTPUT, BLOCK)
    kv_tokens = SLOTS * MAX_LEN
    num_blocks = kv_tokens // BLOCK
    admitted = num_blocks // per_request
    print(
        f"model={loaded.name} dtype={dtype} threads={torch.get_num_threads()} cpu={platform.processor() or '?'} "
        f"kv_tokens={kv_tokens} slots_admit={SLOTS} blocks_admit={admitted}",
        flush=True,
    )

    slot_cache = KVCache.allocate(config.kv_layout(SLOTS, MAX_LEN, dtype_name(model.dtype)))
    layout = replace(
        config.kv_layout(admitted, MAX_LEN, dtype_name(model.dtype)), block_tokens=BLOCK, num_blocks=num_blocks
    )
    assert layout.total_bytes == slot_cache.layout.total_bytes, "the same KV memory"

    def paged(batch: int) -> PagedKVCache:
        cache = PagedKVCache.allocate(layout)
        for h in range(batch):
            cache.bind(h, range(h * per_request, (h + 1) * per_request))
        return cache

    results = {}
    results["slots, batch 8"] = (SLOTS, run(model, slot_cache, list(range(SLOTS)), steps))
    del slot_cache
    results["blocks, batch 8"] = (SLOTS, run(model, paged(SLOTS), list(range(SLOTS)), steps))
    results[f"blocks, batch {admitted}"] = (admitted, run(model, paged(admitted), list(range(admitted)), steps))
    base = SLOTS / results["slots, batch 8"][1]
    print("| decode | batch | ms/step | tokens/s | vs slots |")
    print("|---|---|---|---|---|")
    for name, (batch, seconds) in results.items():
        rate = batch / seconds
        print(f"| {name} | {batch} | {seconds * 1000:.1f} | {rate:.0f} | ×{rate / base:.2f} |", flush=True)
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":")[1].split())
                    flags = " ".join(x for x in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if x in have)
                    break
    except OSError:
        pass
    print(f"cpu flags: {flags}; cores: {len(os.sched_getaffinity(0))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
