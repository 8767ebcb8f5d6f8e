"""Measure a hardware profile on this machine (`pdserve plan --profile`): a few short probes.

Each figure is what torch achieves here with a worker's thread count, in the serving dtype, at
the planned model's shapes, so a measured profile carries no efficiency factor (1.0):
- matmul FLOP/s: one layer's projections for a 512-token chunk through `matmul.Linear`;
- attention: causal SDPA with the model's heads at 256 and 2,048 tokens (FLOP/s from the
  difference, the rest of the short one as a per-layer fixed cost);
- memory bandwidth: one decode step's GEMVs (every layer's matrices and the head), bytes ÷ time
  (`memcpy` beside it);
- overheads: `LlamaModel` at hidden 64, decode steps at 2 and 10 layers, batch 1 and 8;
- link: a 64 MiB loopback TCP stream and a small round trip (request overhead = 4 hops).
Compute probes are timed in process CPU time ÷ threads (on a shared host wall time swung 2x
while CPU time stayed within 7%): the machine's speed when its cores are the worker's. Link
probes are wall time. Well under a minute; progress goes to `progress`.
"""

from __future__ import annotations

import asyncio
import os
import platform
import socket
import statistics
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from pdserve_operator.planner.model_shape import ModelShape
from pdserve_operator.planner.profile import HardwareProfile

REQUEST_HOPS = 4


def _median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 2, min_total_s: float = 0.0) -> float:
    """Median CPU seconds of `fn` per thread (process CPU time ÷ torch threads)."""
    for _ in range(warmup):
        fn()
    threads = max(1, torch.get_num_threads())
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < repeats or time.perf_counter() - started < min_total_s:
        t0 = time.process_time()
        fn()
        times.append((time.process_time() - t0) / threads)
        if len(times) > 50 * repeats:
            break
    return statistics.median(times)


# Each probe repeats for at least this long and takes the median: on a shared host the load
# from other jobs comes and goes within seconds, and one short burst would catch one moment.
SPREAD_S = 1.5


def matmul_flops(shape: ModelShape, dtype: torch.dtype, tokens: int = 512, repeats: int = 5) -> float:
    h, hd = shape.hidden_size, shape.head_dim
    dims = [
        (h, (shape.num_heads + 2 * shape.num_kv_heads) * hd),
        (shape.num_heads * hd, h),
        (h, 2 * shape.intermediate_size),
        (shape.intermediate_size, h),
    ]
    gen = torch.Generator().manual_seed(0)
    linear = _engine_linear(dtype)
    pairs = [
        (torch.randn(tokens, k, generator=gen).to(dtype), linear.prepare(torch.randn(n, k, generator=gen).to(dtype)))
        for k, n in dims
    ]
    flops = sum(2 * tokens * k * n for k, n in dims)
    with torch.inference_mode():
        seconds = _median_seconds(lambda: [linear(x, w) for x, w in pairs], repeats, min_total_s=SPREAD_S)
    return flops / seconds


def _engine_linear(dtype: torch.dtype):
    from pdserve_worker.model.layers.matmul import Linear

    return Linear(torch.device("cpu"), dtype)


def attention(
    shape: ModelShape, dtype: torch.dtype, lengths: tuple[int, int] = (256, 2048), repeats: int = 5
) -> tuple[float, float]:
    """(FLOP/s, fixed seconds per layer) of causal prefill attention, from two prompt lengths,
    through what the model runs: the native bf16 kernel where it serves, else SDPA."""
    from pdserve_worker.model.layers import native

    gqa = shape.num_heads != shape.num_kv_heads
    gen = torch.Generator().manual_seed(1)
    times, flops = [], []
    for tokens in lengths:
        q = torch.randn(tokens, shape.num_heads, shape.head_dim, generator=gen).to(dtype)
        k = torch.randn(tokens, shape.num_kv_heads, shape.head_dim, generator=gen).to(dtype)
        v = torch.randn(tokens, shape.num_kv_heads, shape.head_dim, generator=gen).to(dtype)
        if native.prefill_serves(q, k, v):
            run = partial(native.causal_attention, q, k, v)
        else:
            qt, kt, vt = (t.transpose(0, 1)[None] for t in (q, k, v))
            run = partial(F.scaled_dot_product_attention, qt, kt, vt, is_causal=True, enable_gqa=gqa)
        with torch.inference_mode():
            times.append(_median_seconds(run, repeats, min_total_s=SPREAD_S / 2))
        # Count as the planner does: one layer's share of `shape.prefill_attention_flops`.
        flops.append(shape.prefill_attention_flops(tokens) / shape.num_layers)
    rate = (flops[1] - flops[0]) / max(1e-9, times[1] - times[0])
    if rate <= 0:  # noise swamped the difference: no fixed part
        return flops[1] / times[1], 0.0
    return rate, max(0.0, times[0] - flops[0] / rate)


def read_bandwidth(shape: ModelShape, dtype: torch.dtype, repeats: int = 5) -> tuple[float, float]:
    """(bytes/s of one decode step's weight GEMVs, memcpy bytes/s of as many bytes)."""
    h, hd = shape.hidden_size, shape.head_dim
    dims = [
        (h, (shape.num_heads + 2 * shape.num_kv_heads) * hd),
        (shape.num_heads * hd, h),
        (h, 2 * shape.intermediate_size),
        (shape.intermediate_size, h),
    ]
    linear = _engine_linear(dtype)
    pairs = [
        (torch.ones(1, k, dtype=dtype), linear.prepare(torch.ones(n, k, dtype=dtype)))
        for _ in range(shape.num_layers)
        for k, n in dims
    ]
    pairs.append((torch.ones(1, h, dtype=dtype), linear.prepare(torch.ones(shape.vocab_size, h, dtype=dtype))))
    element = torch.tensor([], dtype=dtype).element_size()
    nbytes = (shape.num_layers * sum(k * n for k, n in dims) + shape.vocab_size * h) * element
    with torch.inference_mode():
        gemv = nbytes / _median_seconds(lambda: [linear(x, w) for x, w in pairs], repeats, min_total_s=SPREAD_S)
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy = nbytes / _median_seconds(lambda: dst.copy_(src), repeats)
    return gemv, copy


def engine_overheads(dtype: str, rounds: int = 60) -> dict[str, float]:
    """Per step, per layer, per sequence-layer costs of the real engine on a tiny-width model.

    The three decode steps (2 layers, 10 layers, 10 layers at batch 8) are timed in turns,
    round after round, so that a change of load hits all three alike: the per-layer figure is
    a difference of two of them and swung 2x when they were timed one after the other.
    """
    from pdserve_worker.kv.cache import KVCache
    from pdserve_worker.model.layers.llama import LlamaModel
    from pdserve_worker.model.loading.random_model import tiny_config, tiny_weights

    def stepper(layers: int, batch: int) -> Callable[[], None]:
        config = tiny_config(256, num_layers=layers, max_position_embeddings=64)
        model = LlamaModel(config, tiny_weights(config), dtype=getattr(torch, dtype))
        cache = KVCache.allocate(config.kv_layout(batch, 64, dtype))
        slots = list(range(batch))
        for slot in slots:
            model.prefill(list(range(1, 17)), cache, slot)
        state = {"pos": 16}

        def one() -> None:
            model.decode_step(cache, slots, [state["pos"]] * batch, [5] * batch)
            state["pos"] = 16 + (state["pos"] - 15) % 40

        for _ in range(3):
            one()
        return one

    steps = {"2": stepper(2, 1), "10": stepper(10, 1), "10x8": stepper(10, 8)}
    times: dict[str, list[float]] = {k: [] for k in steps}
    threads = max(1, torch.get_num_threads())
    for _ in range(rounds):
        for key, one in steps.items():
            t0 = time.process_time()
            one()
            times[key].append((time.process_time() - t0) / threads)
    t2, t10, t10b8 = (statistics.median(times[k]) for k in ("2", "10", "10x8"))
    layer = max(0.0, (t10 - t2) / 8)
    return {
        "layer_overhead_s": layer,
        "step_overhead_s": max(0.0, t2 - 2 * layer),
        "sequence_overhead_s": max(0.0, (t10b8 - t10) / (7 * 10)),
    }


def loopback_tcp(nbytes: int = 64 << 20) -> tuple[float, float]:
    """(stream bytes/s, asyncio round trip seconds) over 127.0.0.1."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def sink() -> None:
        conn, _ = server.accept()
        with conn:
            buf = bytearray(1 << 20)
            view, left = memoryview(buf), nbytes
            while left:
                got = conn.recv_into(view, min(len(buf), left))
                if not got:
                    break
                left -= got
            conn.sendall(b"k")

    thread = threading.Thread(target=sink, daemon=True)
    thread.start()
    payload = bytes(nbytes)
    with socket.create_connection(("127.0.0.1", port)) as client:
        t0 = time.perf_counter()
        client.sendall(payload)
        client.recv(1)
        stream = nbytes / (time.perf_counter() - t0)
    thread.join(5)
    server.close()
    return stream, asyncio.run(_asyncio_rtt())


async def _asyncio_rtt(rounds: int = 200) -> float:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(64):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        writer.write(b"x" * 32)
        await writer.drain()
        await reader.readexactly(32)
        times.append(time.perf_counter() - t0)
    writer.close()
    await writer.wait_closed()
    await asyncio.sleep(0)  # let the echo task see EOF and end before the server closes
    server.close()
    await server.wait_closed()
    return statistics.median(times)


def measure(
    shape: ModelShape,
    dtype: str,
    threads: int,
    progress: Callable[[str], None] = lambda _: None,
    name: str | None = None,
) -> HardwareProfile:
    torch.set_num_threads(threads)
    tdtype = getattr(torch, dtype)
    figures: dict[str, Any] = {}
    progress(f"matmul FLOP/s ({dtype}, {threads} threads, {shape.name} layer shapes) ...")
    figures["matmul_flops"] = matmul_flops(shape, tdtype)
    progress(f"  {figures['matmul_flops'] / 1e9:.1f} GFLOP/s; attention FLOP/s ...")
    figures["attention_flops"], figures["attention_overhead_s"] = attention(shape, tdtype)
    progress(
        f"  {figures['attention_flops'] / 1e9:.1f} GFLOP/s + {figures['attention_overhead_s'] * 1e3:.2f} ms per layer; "
        "memory bandwidth ..."
    )
    gemv, copy = read_bandwidth(shape, tdtype)
    progress(f"  GEMV read {gemv / 1e9:.1f} GB/s, memcpy {copy / 1e9:.1f} GB/s; engine overheads ...")
    overheads = engine_overheads(dtype)
    progress("  " + ", ".join(f"{k} {v * 1e6:.0f}us" for k, v in overheads.items()) + "; loopback TCP ...")
    stream, rtt = loopback_tcp()
    progress(f"  {stream / 1e9:.2f} GB/s, round trip {rtt * 1e6:.0f}us")
    return HardwareProfile(
        name=name or f"{platform.node() or 'host'}-{dtype}-{threads}t",
        device="cpu",
        dtype=dtype,  # type: ignore[arg-type]
        matmul_flops=figures["matmul_flops"],
        attention_flops=figures["attention_flops"],
        attention_overhead_s=figures["attention_overhead_s"],
        memory_bandwidth=gemv,
        link_bandwidth=stream,
        link_latency_s=rtt,
        request_overhead_s=REQUEST_HOPS * rtt,
        # Measured here in CPU time (torch profiler): a decode step's GEMMs at batch 8 took
        # weights/bandwidth + FLOPs/FLOP/s (54 ms vs 25 + 28), not their max.
        overlap_compute_memory=False,
        overlap_transfer=False,  # the host engine copies on the compute thread (inline copies)
        **overheads,
        sources=[f"measured by `pdserve plan --profile` on {time.strftime('%Y-%m-%d %H:%M')}"],
        measured={
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "cpu": _cpu_name(),
            "cpu_flags": _cpu_flags(),
            "cpus": len(os.sched_getaffinity(0)),
            "threads": threads,
            "torch": torch.__version__,
            "model_shapes": shape.name,
            "memcpy_bytes_per_s": copy,
            "load_average": os.getloadavg()[0],
        },
    )


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_flags() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
                return " ".join(sorted(f for f in flags if f.startswith(("avx", "amx"))))
    except OSError:
        pass
    return ""
