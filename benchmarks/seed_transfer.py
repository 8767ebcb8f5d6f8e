"""Seed 002's experiment: one-sided KV push against a two-sided send/recv baseline.

Run:  .venv/bin/python benchmarks/seed_transfer.py [--quick] [--full] [--out benchmarks/figures]

The same model, prompts and prefill role run three times, once per transport, each in one run
of this script on this machine:

- `shm`: one-sided, the host engine's shared-memory path (the prefill memmoves into the
  decode's registered pool; the decode's CPU takes no part) — what HIXL does over HCCS/RDMA.
- `tcp`: one-sided, the host engine's TCP path (`pdserve.Transport=tcp`: the decode's engine
  receives each frame straight into the target range).
- `two-sided`: gloo send/recv (transfer/backends/two_sided.py): the decode posts receives into a
  staging buffer, copies staging into the KV blocks and acknowledges every chunk.

The prefill is pdserve's own prefill role (`PrefillWorker`, batching and layer-chunk pushes as
in a prefill pod) over the bundled SmolLM2-135M, in this process; the decode is a stand-in
decode process (tests/support/transfer_peers.py: a registered pool, a slot table, readiness)
with the same KV layout. For each prompt length L and concurrency c, c requests of L random
tokens arrive at once (each with its decode reservation, as the router makes them), and for
every request this records:

- transfer latency: the first layer chunk's push → the ready notification at the decode
  (the seed's "KV transfer latency of one request"; with the pipelined push it overlaps the
  compute of the later layers), and its tail: compute done → ready at the decode (what the
  transfer adds to TTFT);
- TTFT: arrival → ready at the decode (the first token travels in the notification);
- prefill throughput: c × L prompt tokens ÷ (first arrival → last ready), the queue full;
- bytes copied per request on each side, from each engine's own counters (copy_counts.py).

What is cut to fit about 15 minutes here (the seed's grid is lengths 512–4096 × concurrency
1–32): a point runs only when its prompt tokens (L × c) fit `--max-point-tokens` (default
8192), plus the 512 × 32 point; on a 2-vCPU AVX2 machine the model prefills ~270–430 tokens/s,
so 4096 × 32 alone is ~8 minutes per transport. `--full` runs the whole grid (about 80 minutes
here); `--points 4096x32` runs chosen points.

Prints progress per point, a table of medians/p99, and writes PNG plots and a JSON of all
samples to `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for sub in ("worker", "common", "proto", "tests"):
    sys.path.insert(0, str(ROOT / sub))

from pdserve_worker.util.free_ports import free_port  # noqa: E402
from support.transfer_peers import PeerProcess, decode_main, grant_from_dict  # noqa: E402

TRANSPORTS = {
    "shm": ("cpu", {"pdserve.Transport": "auto"}),
    "tcp": ("cpu", {"pdserve.Transport": "tcp"}),
    "two-sided": ("two-sided", {}),
}
LENGTHS = (512, 1024, 2048, 4096)
CONCURRENCY = (1, 2, 4, 8, 16, 32)
ALWAYS = ((512, 32),)  # kept under the token cap: concurrency 32 at least once


@dataclasses.dataclass
class Sample:
    transport: str
    length: int
    concurrency: int
    ttft_s: float
    transfer_s: float
    tail_s: float


@dataclasses.dataclass
class Point:
    transport: str
    length: int
    concurrency: int
    samples: list[Sample]
    throughput_tok_s: float
    prefill_bytes_per_req: dict[str, float]
    decode_bytes_per_req: dict[str, float]
    kv_bytes_per_req: float


class ChunkClock:
    """Wraps the model: when each prompt's first layer chunk was handed to the pusher and when
    its pass finished (the prefill role's own callbacks, timed from outside)."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self.first_chunk_ns: dict[int, int] = {}
        self.done_ns: dict[int, int] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def _timed(self, prompts: list[list[int]], on_chunk: Callable[[range], None]) -> Callable[[range], None]:
        def chunk(layers: range) -> None:
            now = time.perf_counter_ns()
            for p in prompts:
                self.first_chunk_ns.setdefault(id(p), now)
            on_chunk(layers)

        return chunk

    def prefill(
        self, prompt: list[int], cache: Any, slot: int, layers_per_chunk: Any = None, on_chunk: Any = None, **kw: Any
    ) -> Any:
        out = self._model.prefill(prompt, cache, slot, layers_per_chunk, on_chunk=self._timed([prompt], on_chunk), **kw)
        self.done_ns[id(prompt)] = time.perf_counter_ns()
        return out

    def prefill_batch(
        self,
        prompts: list[list[int]],
        cache: Any,
        slots: Any,
        layers_per_chunk: Any = None,
        on_chunk: Any = None,
        **kw: Any,
    ) -> Any:
        out = self._model.prefill_batch(
            prompts, cache, slots, layers_per_chunk, on_chunk=self._timed(prompts, on_chunk), **kw
        )
        now = time.perf_counter_ns()
        for p in prompts:
            self.done_ns[id(p)] = now
        return out


def prefill_settings(**values: Any) -> Any:
    """A prefill worker's settings, as a pod's would be, with the benchmark's sizes (no broker
    is contacted: the prefill role is driven directly, not through gRPC)."""
    from pdserve_worker.serving.settings import WorkerSettings

    return WorkerSettings(role="prefill", broker_address="127.0.0.1:1", broker_token="bench", **values)


def grid(args: argparse.Namespace) -> dict[int, list[int]]:
    """Concurrencies to run per length."""
    if args.points:
        chosen: dict[int, list[int]] = {}
        for item in args.points.split(","):
            length, c = (int(x) for x in item.lower().split("x"))
            chosen.setdefault(length, []).append(c)
        return chosen
    out: dict[int, list[int]] = {}
    for length in args.lengths:
        cs = [c for c in args.concurrency if args.full or length * c <= args.max_point_tokens or (length, c) in ALWAYS]
        if cs:
            out[length] = cs
    return out


async def run_point(
    worker: Any, clock: ChunkClock, decode: PeerProcess, transport: str, length: int, c: int, vocab: int
) -> Point:
    from pdserve_worker.model.sampling.params import SamplingParams

    rng = random.Random(length * 1000 + c)
    prompts = [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(c)]
    grants = [decode.call("reserve", request_id=f"{transport}-{length}-{c}-{i}", ttl_s=3600) for i in range(c)]
    before_p, before_d = worker.backend.engine.copy_stats(), decode.call("copies")
    decode.send("wait_all", grants=[(g["slot"], g["generation"]) for g in grants], timeout_s=3600)
    params = SamplingParams(max_tokens=1, temperature=0)
    t0 = time.perf_counter_ns()
    results = await asyncio.gather(
        *(worker.prefill(g["request_id"], p, params, [grant_from_dict(g)], 0) for g, p in zip(grants, prompts))
    )
    woke = decode.result(wait_s=3600)
    after_p, after_d = worker.backend.engine.copy_stats(), decode.call("copies")
    for g in grants:  # the KV arrived: commit (as a decode does), then give the slot back free
        decode.call("commit", slot=g["slot"], generation=g["generation"])
        decode.call("release", slot=g["slot"], generation=g["generation"])
    samples = []
    for p, w in zip(prompts, woke):
        ready = w["woke_ns"]
        samples.append(
            Sample(
                transport,
                length,
                c,
                (ready - t0) / 1e9,
                (ready - clock.first_chunk_ns.pop(id(p))) / 1e9,
                (ready - clock.done_ns.pop(id(p))) / 1e9,
            )
        )
    span = (max(w["woke_ns"] for w in woke) - t0) / 1e9
    return Point(
        transport,
        length,
        c,
        samples,
        c * length / span,
        {k: (after_p[k] - before_p[k]) / c for k in after_p},
        {k: (after_d[k] - before_d[k]) / c for k in after_d},
        statistics.mean(r.kv_bytes for r in results),
    )


def push_only(worker: Any, decode: PeerProcess, transport: str, length: int, c: int) -> Point:
    """c requests' KV (the real KV the prefill role just computed, in its scratch slot 0) pushed
    at once, one pusher per request on its own thread, with no compute: the transfer alone."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from pdserve_worker.transfer.push import KVPusher, PushSource, layer_chunks

    s = worker.settings
    layout = worker.cache.layout
    grants = [decode.call("reserve", request_id=f"push-{transport}-{length}-{c}-{i}", ttl_s=3600) for i in range(c)]
    before_p, before_d = worker.backend.engine.copy_stats(), decode.call("copies")
    decode.send("wait_all", grants=[(g["slot"], g["generation"]) for g in grants], timeout_s=600)
    barrier = threading.Barrier(c)

    def one(grant: dict[str, Any]) -> tuple[int, int]:
        barrier.wait()
        started = time.perf_counter_ns()
        pusher = KVPusher(
            worker.backend,
            PushSource(worker.pool.base_addr, layout, slot=0),
            [grant_from_dict(grant)],
            length,
            queue_depth=s.queue_depth,
            timeout_s=s.transfer_timeout_ms / 1000,
        )
        try:
            for chunk in layer_chunks(layout.layer_range, s.layers_per_chunk):
                pusher.push_chunk(chunk)
            return started, pusher.finish().bytes
        except BaseException:
            pusher.abort()
            raise

    with ThreadPoolExecutor(c) as pushers:
        starts = list(pushers.map(one, grants))
    woke = decode.result(wait_s=600)
    after_p, after_d = worker.backend.engine.copy_stats(), decode.call("copies")
    for g in grants:
        decode.call("commit", slot=g["slot"], generation=g["generation"])
        decode.call("release", slot=g["slot"], generation=g["generation"])
    first = min(t for t, _ in starts)
    samples = [
        Sample(transport, length, c, (w["woke_ns"] - first) / 1e9, (w["woke_ns"] - t) / 1e9, 0.0)
        for (t, _), w in zip(starts, woke)
    ]
    span = (max(w["woke_ns"] for w in woke) - first) / 1e9
    kv_bytes = statistics.mean(n for _, n in starts)
    return Point(
        transport,
        length,
        c,
        samples,
        c * length / span,
        {k: (after_p[k] - before_p[k]) / c for k in after_p},
        {k: (after_d[k] - before_d[k]) / c for k in after_d},
        kv_bytes,
    )


def progress(kind: str, point: Point, seconds: float) -> None:
    ttft = statistics.median(s.ttft_s for s in point.samples)
    xfer = statistics.median(s.transfer_s for s in point.samples)
    print(
        f"  {kind:5s} {point.transport:9s} L={point.length:5d} c={point.concurrency:3d}  TTFT p50 {ttft * 1000:8.1f} ms"
        f"  transfer p50 {xfer * 1000:8.1f} ms  {point.throughput_tok_s:7.0f} tok/s  ({seconds:.0f} s)",
        flush=True,
    )


async def run_transport(
    lengths: list[int],
    name: str,
    loaded: Any,
    revision: str,
    plans: dict[str, dict[int, list[int]]],
    args: argparse.Namespace,
    done: dict[str, list[Point]],
) -> None:
    """Every point of both plans for one transport: per length one decode peer (slots for the
    largest concurrency) and one prefill role, warmed by one untimed prefill."""
    from pdserve_worker.model.sampling.params import SamplingParams
    from pdserve_worker.prefill.worker import PrefillWorker
    from pdserve_worker.transfer.registry import create_engine

    backend_name, options = TRANSPORTS[name]
    clock = ChunkClock(loaded.model)
    timed = dataclasses.replace(loaded, model=clock)
    for length in lengths:
        slots = max(c for plan in plans.values() for c in plan.get(length, [1]))
        layout = loaded.config.kv_layout(slots, length, args.dtype)
        decode = PeerProcess.start(
            decode_main, {"engine_id": f"127.0.0.1:{free_port()}", "layout": layout.to_dict(), "backend": backend_name}
        )
        backend = create_engine(backend_name)  # type: ignore[arg-type]
        backend.check(backend.engine.initialize("127.0.0.1", dict(options)), "initialize")
        settings = prefill_settings(model_dtype=args.dtype, max_length=length, layers_per_chunk=args.layers_per_chunk)
        worker = PrefillWorker(settings, timed, backend, revision)
        try:
            warm = [random.Random(length).randrange(100, loaded.config.vocab_size) for _ in range(length)]
            grant = decode.call("reserve", request_id=f"warm-{name}-{length}", ttl_s=600)
            decode.send("wait", slot=grant["slot"], generation=grant["generation"], timeout_s=600)
            await worker.prefill(grant["request_id"], warm, SamplingParams(max_tokens=1), [grant_from_dict(grant)], 0)
            decode.result(wait_s=600)
            decode.call("commit", slot=grant["slot"], generation=grant["generation"])
            decode.call("release", slot=grant["slot"], generation=grant["generation"])
            for c in plans["serve"].get(length, []):
                started = time.perf_counter()
                done["serve"].append(await run_point(worker, clock, decode, name, length, c, loaded.config.vocab_size))
                progress("serve", done["serve"][-1], time.perf_counter() - started)
            for c in plans["push"].get(length, []):
                started = time.perf_counter()
                done["push"].append(push_only(worker, decode, name, length, c))
                progress("push", done["push"][-1], time.perf_counter() - started)
        finally:
            worker.close()
            backend.engine.finalize()
            worker.free()
            decode.stop()


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summary(kind: str, points: list[Point]) -> list[dict[str, Any]]:
    rows = []
    for p in points:
        ttft = [s.ttft_s for s in p.samples]
        xfer = [s.transfer_s for s in p.samples]
        tail = [s.tail_s for s in p.samples]
        rows.append(
            {
                "kind": kind,
                "transport": p.transport,
                "length": p.length,
                "concurrency": p.concurrency,
                "transfer_p50_ms": statistics.median(xfer) * 1000,
                "transfer_p99_ms": pct(xfer, 0.99) * 1000,
                "tail_p50_ms": statistics.median(tail) * 1000,
                "tail_p99_ms": pct(tail, 0.99) * 1000,
                "ttft_p50_ms": statistics.median(ttft) * 1000,
                "ttft_p99_ms": pct(ttft, 0.99) * 1000,
                "throughput_tok_s": p.throughput_tok_s,
                "kv_mb_per_req": p.kv_bytes_per_req / 2**20,
                "prefill_copied_x": sum(p.prefill_bytes_per_req.values()) / p.kv_bytes_per_req,
                "decode_copied_x": sum(p.decode_bytes_per_req.values()) / p.kv_bytes_per_req,
            }
        )
    return rows


def print_tables(push: list[dict[str, Any]], serve: list[dict[str, Any]]) -> None:
    print("## Transfer alone: c requests' real KV pushed at once (first put → ready at the decode)\n")
    print("| transport | L | c | KV MB/req | latency p50 / p99 ms | copied ×KV: prefill + decode |")
    print("|---|---|---|---|---|---|")
    for r in push:
        print(
            f"| {r['transport']} | {r['length']} | {r['concurrency']} | {r['kv_mb_per_req']:.1f} | "
            f"{r['transfer_p50_ms']:.1f} / {r['transfer_p99_ms']:.1f} | "
            f"{r['prefill_copied_x']:.2f} + {r['decode_copied_x']:.2f} |"
        )
    print("\n## Serving: c requests at once through the prefill role (real prefill, pipelined push)\n")
    print("| transport | L | c | first chunk → ready p50 ms | tail p50 / p99 ms | TTFT p50 / p99 ms | prefill tok/s |")
    print("|---|---|---|---|---|---|---|")
    for r in serve:
        print(
            f"| {r['transport']} | {r['length']} | {r['concurrency']} | {r['transfer_p50_ms']:.0f} | "
            f"{r['tail_p50_ms']:.1f} / {r['tail_p99_ms']:.1f} | {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
            f"{r['throughput_tok_s']:.0f} |"
        )


def print_ratios(push: list[dict[str, Any]], serve: list[dict[str, Any]]) -> None:
    """One-sided ÷ two-sided at every point both ran: the seed's claim point by point."""
    two = {(r["kind"], r["length"], r["concurrency"]): r for r in push + serve if r["transport"] == "two-sided"}
    print("\n## Ratios one-sided ÷ two-sided (below 1: one-sided is faster; throughput above 1: one-sided is faster)\n")
    print(
        "| L | c | transfer p50 shm / tcp | transfer p99 shm / tcp | tail p50 shm / tcp | TTFT p50 shm / tcp | throughput shm / tcp |"
    )
    print("|---|---|---|---|---|---|---|")
    for length, c in sorted({(r["length"], r["concurrency"]) for r in push + serve}):
        cells = []
        for kind, key in (
            ("push", "transfer_p50_ms"),
            ("push", "transfer_p99_ms"),
            ("serve", "tail_p50_ms"),
            ("serve", "ttft_p50_ms"),
            ("serve", "throughput_tok_s"),
        ):
            base = two.get((kind, length, c))
            mine = {
                r["transport"]: r
                for r in (push if kind == "push" else serve)
                if (r["length"], r["concurrency"]) == (length, c)
            }
            if base is None or not base[key]:
                cells.append("–")
                continue
            cells.append(" / ".join(f"{mine[t][key] / base[key]:.2f}" if t in mine else "–" for t in ("shm", "tcp")))
        print(f"| {length} | {c} | " + " | ".join(cells) + " |")


def plot(rows: list[dict[str, Any]], key: str, label: str, path: Path, title: str, log_y: bool = True) -> Path:
    """One line per transport and concurrency against prompt length (transport by line style,
    concurrency by colour)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    concurrencies = sorted({r["concurrency"] for r in rows})
    colours = plt.cm.viridis([i / max(1, len(concurrencies) - 1) for i in range(len(concurrencies))])
    styles = {"shm": ("-", "o"), "tcp": (":", "s"), "two-sided": ("--", "^")}
    fig, ax = plt.subplots(figsize=(9, 6))
    for transport, (line, marker) in styles.items():
        for colour, c in zip(colours, concurrencies):
            pts = sorted((r["length"], r[key]) for r in rows if r["transport"] == transport and r["concurrency"] == c)
            if pts:
                ax.plot(*zip(*pts), line, marker=marker, color=colour, label=f"{transport}, c={c}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r["length"] for r in rows}))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel(label)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=3)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_ratio(push: list[dict[str, Any]], path: Path, where: str) -> Path:
    """The seed's claim at a glance: one-sided ÷ two-sided transfer latency against length, one
    line per concurrency, for each one-sided path; below the dashed line one-sided is 2x faster."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    two = {(r["length"], r["concurrency"]): r["transfer_p50_ms"] for r in push if r["transport"] == "two-sided"}
    concurrencies = sorted({c for _, c in two})
    colours = plt.cm.viridis([i / max(1, len(concurrencies) - 1) for i in range(len(concurrencies))])
    fig, axes = plt.subplots(1, 2, figsize=(12, 5), sharey=True)
    for ax, transport in zip(axes, ("shm", "tcp")):
        for colour, c in zip(colours, concurrencies):
            pts = sorted(
                (r["length"], r["transfer_p50_ms"] / two[(r["length"], c)])
                for r in push
                if r["transport"] == transport and r["concurrency"] == c and (r["length"], c) in two
            )
            if pts:
                ax.plot(*zip(*pts), "-o", color=colour, label=f"c={c}")
        ax.axhline(0.5, color="grey", linestyle="--", linewidth=1)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["length"] for r in push}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_ylim(0, 1.2)
        ax.set_xlabel("prompt tokens")
        ax.set_title(f"one-sided {transport} ÷ two-sided (gloo): KV transfer latency p50", fontsize=9)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("ratio (below 1: one-sided faster)")
    axes[1].legend(fontsize=8)
    fig.suptitle(where, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(push: list[dict[str, Any]], serve: list[dict[str, Any]], out: Path, where: str) -> list[Path]:
    made = []
    if push and any(r["transport"] == "two-sided" for r in push):
        made.append(plot_ratio(push, out / "seed_transfer_ratio.png", where))
    if push:
        made.append(
            plot(
                push,
                "transfer_p50_ms",
                "KV transfer latency p50 (ms)",
                out / "seed_transfer_latency.png",
                f"KV transfer of c concurrent requests (real KV, no compute): one-sided vs two-sided\n{where}",
            )
        )
    if serve:
        made.append(
            plot(
                serve,
                "ttft_p50_ms",
                "TTFT p50 (ms)",
                out / "seed_transfer_ttft.png",
                f"TTFT, c requests at once through the prefill role\n{where}",
            )
        )
        made.append(
            plot(
                serve,
                "tail_p50_ms",
                "compute done → ready p50 (ms)",
                out / "seed_transfer_tail.png",
                f"What the transfer adds after the last layer's compute\n{where}",
            )
        )
        made.append(
            plot(
                serve,
                "throughput_tok_s",
                "prefill throughput (prompt tokens/s)",
                out / "seed_transfer_throughput.png",
                f"Prefill throughput with c requests queued\n{where}",
                log_y=False,
            )
        )
    return made


def machine() -> str:
    cpu = platform.processor() or "unknown cpu"
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            text = f.read()
        cpu = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), cpu)
        have = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
        flags = " ".join(f for f in have if f.startswith(("avx512_bf16", "amx", "avx512f", "avx2")))
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} vCPU, flags [{flags}], Python {platform.python_version()}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=ints, default=list(LENGTHS))
    parser.add_argument("--concurrency", type=ints, default=list(CONCURRENCY))
    parser.add_argument(
        "--max-point-tokens", type=int, default=8192, help="serving: skip points whose L × c exceed this"
    )
    parser.add_argument("--full", action="store_true", help="serving: every point of the seed's grid (~80 min here)")
    parser.add_argument("--points", default="", help="serving: only these points, e.g. 4096x32,2048x16")
    parser.add_argument("--no-serve", action="store_true", help="only the transfer-alone grid")
    parser.add_argument("--no-push", action="store_true", help="only the serving grid")
    parser.add_argument("--transports", default=",".join(TRANSPORTS), help="comma-separated: shm,tcp,two-sided")
    parser.add_argument("--layers-per-chunk", type=int, default=4, help="as the prefill role's default")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument(
        "--weights",
        default="dequantized",
        choices=["auto", "dequantized", "int8", "int4"],
        help="prefill weights (default dequantized: dense prefills ~2x faster here than the int4 route)",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: L 512,1024 × c 1,4")
    parser.add_argument("--replot", type=Path, default=None, help="only redraw the plots from a run's JSON")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "figures")
    args = parser.parse_args(argv)
    if args.quick:
        args.lengths, args.concurrency = [512, 1024], [1, 4]
    return args


def replot(path: Path, out: Path) -> int:
    report = json.loads(path.read_text())
    rows = report["rows"]
    push, serve = [r for r in rows if r["kind"] == "push"], [r for r in rows if r["kind"] == "serve"]
    args = report["args"]
    where = f"{report['machine']}, {report['date']}, SmolLM2-135M {args['dtype']} ({args['weights']} weights)"
    for made in write_plots(push, serve, out, where):
        print(f"plot: {made}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot is not None:
        return replot(args.replot, args.out)
    import torch

    from pdserve_worker.cli.local_deployment import auto_dtype
    from pdserve_worker.model.loading.loader import load_model
    from pdserve_worker.process.worker_main import model_revision, resolve_model_folder

    if args.dtype == "auto":
        args.dtype = auto_dtype()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    plans = {
        "serve": {} if args.no_serve else grid(args),
        "push": {} if args.no_push else {length: list(args.concurrency) for length in args.lengths},
    }
    where = f"{machine()}, {datetime.date.today()}, SmolLM2-135M {args.dtype} ({args.weights} weights)"
    print(f"# seed_transfer {datetime.datetime.now().isoformat(timespec='seconds')} on {where}", flush=True)
    print(
        f"# torch threads {torch.get_num_threads()}; serving points {plans['serve']}; transfer points {plans['push']}"
    )
    settings = prefill_settings(model_dtype=args.dtype)
    loaded = load_model(settings.model_path, args.dtype, weights=args.weights)
    revision = model_revision(resolve_model_folder(settings), args.dtype)
    done: dict[str, list[Point]] = {"serve": [], "push": []}
    started = time.perf_counter()
    # Lengths outer, transports inner: the three transports of a length run minutes apart, not
    # a quarter of an hour (the machine's load drifts).
    for length in sorted({length for plan in plans.values() for length in plan}):
        for name in args.transports.split(","):
            print(f"# L={length} transport {name}", flush=True)
            asyncio.run(run_transport([length], name, loaded, revision, plans, args, done))
    order = list(TRANSPORTS)
    push, serve = (
        sorted(summary(k, done[k]), key=lambda r: (order.index(r["transport"]), r["length"], r["concurrency"]))
        for k in ("push", "serve")
    )
    print(f"\n# {len(push) + len(serve)} points in {time.perf_counter() - started:.0f} s\n")
    print_tables(push, serve)
    print_ratios(push, serve)
    args.out.mkdir(parents=True, exist_ok=True)
    samples = [dataclasses.asdict(s) | {"kind": k} for k, pts in done.items() for p in pts for s in p.samples]
    report = {"machine": machine(), "date": str(datetime.date.today()), "args": vars(args) | {"out": str(args.out)}}
    (args.out / "seed_transfer.json").write_text(
        json.dumps(report | {"rows": push + serve, "samples": samples}, indent=1)
    )
    try:
        for path in write_plots(push, serve, args.out, where):
            print(f"plot: {path}")
    except ImportError:
        print("plots skipped: matplotlib is not installed (pip install -e '.[plots]')")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
