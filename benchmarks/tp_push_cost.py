"""What one tensor-parallel rank's head-sliced KV push costs, beside a memcpy of the same bytes.

Run:  PYTHONPATH=worker:common:proto:tests python benchmarks/tp_push_cost.py [--tokens 2048] [--repeats 7]

A prefill rank holding KV heads 0..1 of 4 pushes a prompt's KV (tensor_parallel.py's model
shape: 30 layers, head_dim 64, bf16) into a decode pool holding all 4 heads, in another process
over the host engine's shared memory: every token's heads are a slice of its row there, one
256-byte descriptor per token per (layer, K|V). Beside it, in the same run:
- the same rank into a pool of its own 2 heads (whole rows: one descriptor per block run);
- a memcpy of the same bytes in this process (torch `copy_`), the floor.
Medians of `--repeats` pushes after one warm-up: building the pusher (its descriptors' plan),
and pushing every layer to the last put's completion. The startup heap is frozen first, as a
ready worker's is (serving/gc_heap.py). Writes benchmarks/figures/tp_push_cost.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tensor_parallel import BLOCK, FIGURES, SHAPE, start_decode_peers  # noqa: E402


def one_push(backend: Any, pool: Any, layout: Any, target: Any, tokens: int) -> tuple[float, float, int]:
    from pdserve_worker.transfer.push import KVPusher, PushSource, layer_chunks

    t0 = time.perf_counter()
    pusher = KVPusher(backend, PushSource(pool.base_addr, layout, 0, layout.head_range), [target], tokens)
    t1 = time.perf_counter()
    for chunk in layer_chunks(layout.layer_range, 2):
        pusher.push_chunk(chunk)
    stats = pusher.settle()
    return t1 - t0, time.perf_counter() - t1, stats.bytes


def measure(peer: dict[str, Any], heads: int, tokens: int, repeats: int) -> dict[str, float]:
    from pdserve_common.kv_layout import KVLayout
    from pdserve_worker.kv.slots import Grant
    from pdserve_worker.serving.gc_heap import freeze_startup_heap
    from pdserve_worker.transfer.pool import KVPool
    from pdserve_worker.transfer.registry import create_engine

    layout = KVLayout(1, SHAPE["num_layers"], tokens, kv_heads=heads, head_dim=SHAPE["head_dim"], dtype="bfloat16")
    backend = create_engine("cpu")
    backend.check(backend.engine.initialize("127.0.0.1", {}), "initialize")
    pool = KVPool(backend, layout)
    pool.tensor.normal_()
    dest = KVLayout.from_dict(peer["layout"])
    target = Grant("bench", 0, 1, peer["engine_id"], peer["base_addr"], dest, blocks=tuple(range(tokens // BLOCK)))
    try:
        one_push(backend, pool, layout, target, tokens)  # warm-up (connect, first touch)
        freeze_startup_heap()
        runs = [one_push(backend, pool, layout, target, tokens) for _ in range(repeats)]
    finally:
        pool.close()
        backend.engine.finalize()
    build, push = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
    return {"build_ms": build * 1e3, "push_ms": push * 1e3, "bytes": runs[0][2]}


def memcpy_ms(nbytes: int, repeats: int) -> float:
    import torch

    src, dst = torch.empty(nbytes, dtype=torch.uint8).random_(), torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    out: dict[str, Any] = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    for name, decode_tp, heads in (("slice into a 4-head pool", 1, 2), ("whole rows into a 2-head pool", 2, 2)):
        print(f"[tp_push_cost] {name} ...", flush=True)
        peers = start_decode_peers(decode_tp, args.tokens)
        try:
            out[name] = measure(peers[0][2], heads, args.tokens, args.repeats)
        finally:
            for conn, proc, _ in peers:
                conn.send("stop")
                proc.join(10)
        print(f"  build {out[name]['build_ms']:.1f} ms, push {out[name]['push_ms']:.1f} ms", flush=True)
    nbytes = out["slice into a 4-head pool"]["bytes"]
    out["memcpy_ms"] = memcpy_ms(nbytes, args.repeats)
    print(f"[tp_push_cost] memcpy of the same {nbytes / 1e6:.1f} MB: {out['memcpy_ms']:.2f} ms")
    (FIGURES / "tp_push_cost.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
