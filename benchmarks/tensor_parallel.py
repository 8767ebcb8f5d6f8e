"""Tensor-parallel prefill (issue #32): what splitting one prefill over 2 ranks costs on a CPU.

Run:  PYTHONPATH=worker:common:proto:tests python benchmarks/tensor_parallel.py [--tokens 2048] [--repeats 5]

One run, side by side: a 2048-token prompt prefilled by
- P1→D1: one process with 2 torch threads (what a prefill pod runs today), into one decode pool;
- P2→D1: two rank processes with 1 thread each, gloo all_reduce between them (`pdserve local
  --prefill-tp 2`, `spec.prefill.tensorParallelSize: 2`), each pushing a slice of every token's
  row of the one decode pool (its heads);
- P2→D2: the same into a tensor-parallel decode's two pools (`--decode-tp 2`), each rank's heads
  whole rows of its own decode rank's pool,
on a model tp 2 can split (the bundled SmolLM2-135M has 9 query heads over 3 KV heads: sizes
1, 3, 9): SmolLM2's depth and width class with 8 heads over 4 KV heads (30 layers, hidden 512,
MLP 1536, head_dim 64, bf16, random weights — the arithmetic, not the text, is measured).

Each rank runs the prefill role's own calls: `model.prefill(..., on_chunk=pusher.push_chunk)`
into its registered scratch pool, pushing its KV heads straight into a decode peer's block
pool (a separate process, host engine, shared memory), `settle()` on the others, and rank 0's
`finish()` (the ready notify) once every rank's puts landed. Figures (medians, interleaved):
- prefill alone (no push) and prefill + pipelined push to the notify, per tp: the overlap
  ratio is the second ÷ the first (target ≤ 1.10, as at tp 1);
- "TTFT" tp 2 ÷ tp 1: prefill + push to the notify (target ≤ 1.25: on 2 cores tensor
  parallelism cannot make a prefill faster, the bar is that it costs little);
- the all_reduce share of the tp-2 prefill: time inside the 60 all_reduces ÷ the prefill;
- the KV bytes each rank pushed (each its half).
Prints progress; writes benchmarks/figures/tensor_parallel.{json,png}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

FIGURES = Path(__file__).resolve().parent / "figures"
SHAPE = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_layers=30,
    num_heads=8,
    num_kv_heads=4,
    head_dim=64,
    max_position_embeddings=4096,
)
BLOCK = 16


def say(message: str) -> None:
    print(f"[tensor_parallel {time.strftime('%H:%M:%S')}] {message}", flush=True)


# ---- the decode peer: a registered block pool that takes pushes and ready notifies ----------------------
def decode_peer(conn: Connection, layout: dict[str, Any]) -> None:
    from pdserve_common.kv_layout import KVLayout
    from pdserve_worker.transfer.pool import KVPool
    from pdserve_worker.transfer.registry import create_engine

    backend = create_engine("cpu")
    engine_id = f"127.0.0.1:{conn.recv()}"
    backend.check(backend.engine.initialize(engine_id, {}), "initialize")
    pool = KVPool(backend, KVLayout.from_dict(layout))
    conn.send({"engine_id": engine_id, "base_addr": pool.base_addr})
    while not conn.poll(0.05):
        backend.engine.get_notifies()  # (drained, so the inbox never fills)
    pool.close()
    backend.engine.finalize()


# ---- one rank ---------------------------------------------------------------------------------------------
def rank_main(rank: int, size: int, store: str, cfg: dict[str, Any], out: Any) -> None:
    import torch

    from pdserve_common.kv_layout import KVLayout
    from pdserve_worker.kv.cache import KVCache
    from pdserve_worker.kv.slots import Grant
    from pdserve_worker.model.layers.llama import PrefillOutputs
    from pdserve_worker.model.loading.loader import load_model
    from pdserve_worker.ranks.group import GroupSpec, TPGroup
    from pdserve_worker.serving.gc_heap import freeze_startup_heap
    from pdserve_worker.transfer.pool import KVPool
    from pdserve_worker.transfer.push import KVPusher, PushSource
    from pdserve_worker.transfer.registry import create_engine

    torch.set_num_threads(cfg["threads"])
    group = TPGroup(GroupSpec(size, rank, store, timeout_s=600)) if size > 1 else None
    reduced = [0.0]

    def timed_reduce(t: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        group.all_reduce(t)  # type: ignore[union-attr]
        reduced[0] += time.perf_counter() - t0
        return t

    tp = {"tp": (size, rank), "reduce": timed_reduce} if group is not None else {}
    loaded = load_model(cfg["model"], "bfloat16", **tp)
    first_head = loaded.tp.kv_heads.start if loaded.tp is not None else 0
    layout = loaded.config.kv_layout(1, cfg["tokens"], "bfloat16", first_head=first_head)
    backend = create_engine("cpu")
    backend.check(backend.engine.initialize("127.0.0.1", {}), "initialize")
    pool = KVPool(backend, layout)
    cache = KVCache(layout, pool.tensor)
    heads = loaded.tp.pushed_kv_heads if loaded.tp is not None else None
    targets = [  # one per decode rank: each holds its share of the KV heads
        Grant(
            "bench",
            0,
            1,
            peer["engine_id"],
            peer["base_addr"],
            KVLayout.from_dict(peer["layout"]),
            blocks=tuple(range(cfg["tokens"] // BLOCK)),
        )
        for peer in cfg["peers"]
    ]
    ids, lpc = cfg["ids"], cfg["layers_per_chunk"]

    def barrier() -> None:
        if group is not None:
            group.gather(None)

    def alone() -> tuple[float, float]:
        barrier()
        reduced[0] = 0.0
        t0 = time.perf_counter()
        loaded.model.prefill(ids, cache, 0, lpc, outputs=PrefillOutputs(logits=rank == 0))
        return time.perf_counter() - t0, reduced[0]

    def pushed() -> tuple[float, int]:
        barrier()
        t0 = time.perf_counter()
        pusher = KVPusher(backend, PushSource(pool.base_addr, layout, 0, heads), targets, len(ids))
        loaded.model.prefill(ids, cache, 0, lpc, pusher.push_chunk, outputs=PrefillOutputs(logits=rank == 0))
        if rank:
            stats = pusher.settle()
        if group is not None:
            group.gather(None)  # every rank's puts landed (as ranks/prefill.py's reports)
        if not rank:
            stats = pusher.finish({"first_token": 0})
        return time.perf_counter() - t0, stats.bytes

    alone()  # warm-up (the first pass pays page faults and kernel builds)
    freeze_startup_heap()  # as a ready worker does (serving/gc_heap.py)
    rows = []
    for round_ in range(cfg["repeats"]):
        (a, red), (p, nbytes) = alone(), pushed()
        rows.append({"alone_s": a, "allreduce_s": red, "pushed_s": p, "bytes": nbytes})
        if rank == 0:
            say(f"tp {size} round {round_ + 1}/{cfg['repeats']}: alone {a * 1e3:.0f} ms, +push {p * 1e3:.0f} ms")
    out.put((rank, rows))
    pool.close()
    backend.engine.finalize()
    if group is not None:
        group.close()


CONFIGS = ((1, 1), (2, 1), (2, 2))  # (prefill ranks, decode ranks)


def label(size: int, decode_tp: int) -> str:
    return f"P{size}→D{decode_tp}"


def start_decode_peers(decode_tp: int, tokens: int) -> list[tuple[Connection, Any, dict[str, Any]]]:
    """`decode_tp` decode pools of 4 ÷ decode_tp KV heads each, in processes of their own."""
    from pdserve_common.kv_layout import KVLayout
    from pdserve_worker.util.free_ports import free_port

    ctx = multiprocessing.get_context("spawn")
    heads = SHAPE["num_kv_heads"] // decode_tp
    peers = []
    for r in range(decode_tp):
        layout = KVLayout(
            num_slots=1,
            num_layers=SHAPE["num_layers"],
            max_len=tokens,
            kv_heads=heads,
            head_dim=SHAPE["head_dim"],
            dtype="bfloat16",
            block_tokens=BLOCK,
            num_blocks=tokens // BLOCK,
            first_head=r * heads,
        )
        parent, child = ctx.Pipe()
        peer = ctx.Process(target=decode_peer, args=(child, layout.to_dict()), daemon=True)
        peer.start()
        parent.send(free_port())
        peers.append((parent, peer, {**parent.recv(), "layout": layout.to_dict()}))
    return peers


def run_tp(size: int, cfg: dict[str, Any]) -> list[list[dict[str, float]]]:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    store = f"file://{tempfile.mkdtemp(prefix='pdserve-tp-bench-')}/store"
    threads = max(1, len(os.sched_getaffinity(0)) // size)
    procs = [
        ctx.Process(target=rank_main, args=(r, size, store, {**cfg, "threads": threads}, out)) for r in range(size)
    ]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join(60)
    return [results[r] for r in range(size)]


def summarize(runs: dict[str, list[list[dict[str, float]]]]) -> dict[str, Any]:
    med = {}
    for size, ranks in runs.items():
        r0 = ranks[0]
        med[size] = {
            "alone_ms": statistics.median(r["alone_s"] for r in r0) * 1e3,
            "pushed_ms": statistics.median(r["pushed_s"] for r in r0) * 1e3,
            "allreduce_ms": statistics.median(r["allreduce_s"] for r in r0) * 1e3,
            "rank_kv_bytes": [rank[0]["bytes"] for rank in ranks],
        }
        med[size]["overlap"] = med[size]["pushed_ms"] / med[size]["alone_ms"]
    one, two, matched = label(1, 1), label(2, 1), label(2, 2)
    return {
        "tp": med,
        "ttft_tp2_over_tp1": med[two]["pushed_ms"] / med[one]["pushed_ms"],
        "ttft_tp2_decode_tp2_over_tp1": med[matched]["pushed_ms"] / med[one]["pushed_ms"],
        "allreduce_share_tp2": med[two]["allreduce_ms"] / med[two]["alone_ms"],
    }


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    sizes = list(summary["tp"])
    x = range(len(sizes))
    alone = [summary["tp"][s]["alone_ms"] for s in sizes]
    reduce_ = [summary["tp"][s]["allreduce_ms"] for s in sizes]
    tail = [summary["tp"][s]["pushed_ms"] - summary["tp"][s]["alone_ms"] for s in sizes]
    ax.bar(x, [a - r for a, r in zip(alone, reduce_)], label="prefill compute", color="#4c72b0")
    ax.bar(x, reduce_, bottom=[a - r for a, r in zip(alone, reduce_)], label="all_reduce (gloo)", color="#dd8452")
    ax.bar(x, tail, bottom=alone, label="push tail to the notify", color="#55a868")
    ax.set_xticks(list(x), sizes)
    ax.set_ylabel("ms (median)")
    ax.set_title(
        f"2048-token prefill + KV push, 2 vCPU: P2→D1 ÷ P1→D1 = {summary['ttft_tp2_over_tp1']:.2f}, "
        f"P2→D2 {summary['ttft_tp2_decode_tp2_over_tp1']:.2f}",
        fontsize=10,
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers-per-chunk", type=int, default=4)
    args = parser.parse_args(argv)
    from support.tiny_model import write_tiny_model

    folder = write_tiny_model(Path(tempfile.mkdtemp(prefix="pdserve-tp-model-")), **SHAPE)
    say(f"model: random weights, {SHAPE} in {folder}")
    import random

    ids = [random.Random(0).randrange(10, 200) for _ in range(args.tokens)]
    cfg = {
        "model": str(folder),
        "tokens": args.tokens,
        "repeats": args.repeats,
        "ids": ids,
        "layers_per_chunk": args.layers_per_chunk,
    }
    runs = {}
    for size, decode_tp in CONFIGS:
        peers = start_decode_peers(decode_tp, args.tokens)
        threads = max(1, len(os.sched_getaffinity(0)) // size)
        say(f"P{size}→D{decode_tp}: {size} rank process(es), {threads} thread(s) each, {decode_tp} decode pool(s)")
        runs[label(size, decode_tp)] = run_tp(size, {**cfg, "peers": [info for _, _, info in peers]})
        for parent, peer, _ in peers:
            parent.send("stop")
            peer.join(10)
    summary = summarize(runs)
    summary.update(
        date=datetime.date.today().isoformat(),
        machine=f"{platform.processor() or 'cpu'}, {os.cpu_count()} cores, Python {platform.python_version()}",
        tokens=args.tokens,
        repeats=args.repeats,
        load=os.getloadavg()[0],
    )
    FIGURES.mkdir(exist_ok=True)
    (FIGURES / "tensor_parallel.json").write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))
    plot(summary, FIGURES / "tensor_parallel.png")
    for size, m in summary["tp"].items():
        print(
            f"{size}: prefill alone {m['alone_ms']:.0f} ms (all_reduce {m['allreduce_ms']:.0f} ms), "
            f"+ pipelined push to the notify {m['pushed_ms']:.0f} ms, overlap {m['overlap']:.3f}, "
            f"KV bytes per rank {m['rank_kv_bytes']}"
        )
    print(
        f"TTFT P2→D1 ÷ P1→D1: {summary['ttft_tp2_over_tp1']:.2f}; P2→D2 ÷ P1→D1: "
        f"{summary['ttft_tp2_decode_tp2_over_tp1']:.2f}; all_reduce share at tp2: {summary['allreduce_share_tp2']:.1%}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
