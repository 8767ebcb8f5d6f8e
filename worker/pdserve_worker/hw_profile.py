"""Measure a hardware profile on this machine (`pdserve plan --profile`): a few short probes.

Each figure is what torch achieves here with the thread count a worker would get, in the
serving dtype, at the shapes of the model being planned for — so a measured profile carries
no efficiency factor (1.0):

- matmul FLOP/s: one layer's projections (q/k/v, o, gate/up, down) for a 512-token chunk;
- attention FLOP/s: causal SDPA over a 1,024-token prompt with the model's heads (GQA);
- memory bandwidth: a GEMV streaming a 256 MiB weight, the read a decode step does (a copy
  is reported beside it, as `memcpy`, but a copy moves every byte twice);
- overheads: the real engine (`LlamaModel`) on a tiny-width model (hidden 64), where compute
  is nothing and all that is left is dispatch: decode steps at 2 and 10 layers (per layer and
  per step), batch 1 and 8 (per sequence per layer);
- link: a loopback TCP stream of 64 MiB (the host engine's cross-host path) and a small
  message's round trip; request overhead = 4 such hops (reserve, prefill call, ready notify,
  first token back), each priced as one asyncio TCP round trip.

The whole run takes well under a minute; progress goes to `progress`.
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
from typing import Any

import torch
import torch.nn.functional as F

from pdserve_operator.planner.model_shape import ModelShape
from pdserve_operator.planner.profile import HardwareProfile

REQUEST_HOPS = 4


def _median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 2, min_total_s: float = 0.0) -> float:
    for _ in range(warmup):
        fn()
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < repeats or time.perf_counter() - started < min_total_s:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) > 50 * repeats:
            break
    return statistics.median(times)


def matmul_flops(shape: ModelShape, dtype: torch.dtype, tokens: int = 512, repeats: int = 5) -> float:
    h, hd = shape.hidden_size, shape.head_dim
    dims = [(h, (shape.num_heads + 2 * shape.num_kv_heads) * hd), (shape.num_heads * hd, h),
            (h, 2 * shape.intermediate_size), (shape.intermediate_size, h)]
    gen = torch.Generator().manual_seed(0)
    pairs = [(torch.randn(tokens, k, generator=gen).to(dtype), torch.randn(n, k, generator=gen).to(dtype)) for k, n in dims]
    flops = sum(2 * tokens * k * n for k, n in dims)
    with torch.inference_mode():
        seconds = _median_seconds(lambda: [F.linear(x, w) for x, w in pairs], repeats)
    return flops / seconds


def attention_flops(shape: ModelShape, dtype: torch.dtype, tokens: int = 1024, repeats: int = 5) -> float:
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, shape.num_heads, tokens, shape.head_dim, generator=gen).to(dtype)
    k = torch.randn(1, shape.num_kv_heads, tokens, shape.head_dim, generator=gen).to(dtype)
    v = torch.randn(1, shape.num_kv_heads, tokens, shape.head_dim, generator=gen).to(dtype)
    gqa = shape.num_heads != shape.num_kv_heads
    with torch.inference_mode():
        seconds = _median_seconds(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa), repeats)
    # Count as the planner does: one layer of `shape.attention_flops` over the causal triangle.
    return shape.prefill_attention_flops(tokens) / shape.num_layers / seconds


def read_bandwidth(dtype: torch.dtype, nbytes: int = 256 << 20, repeats: int = 5) -> tuple[float, float]:
    """(GEMV read bytes/s, memcpy bytes/s) over buffers far beyond the caches."""
    element = torch.tensor([], dtype=dtype).element_size()
    cols = 4096
    rows = nbytes // (cols * element)
    weight = torch.ones(rows, cols, dtype=dtype)
    x = torch.ones(1, cols, dtype=dtype)
    with torch.inference_mode():
        gemv = weight.numel() * element / _median_seconds(lambda: F.linear(x, weight), repeats)
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy = nbytes / _median_seconds(lambda: dst.copy_(src), repeats)
    return gemv, copy


def engine_overheads(dtype: str, repeats: int = 20) -> dict[str, float]:
    """Per step, per layer, per sequence-layer costs of the real engine on a tiny-width model."""
    from pdserve_worker.kv.cache import KVCache
    from pdserve_worker.model.llama import LlamaModel
    from pdserve_worker.model.tiny import tiny_config, tiny_weights

    def step_time(layers: int, batch: int) -> float:
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

        return _median_seconds(one, repeats, warmup=3)

    t2, t10, t10b8 = step_time(2, 1), step_time(10, 1), step_time(10, 8)
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


def measure(shape: ModelShape, dtype: str, threads: int, progress: Callable[[str], None] = lambda _: None,
            name: str | None = None) -> HardwareProfile:
    torch.set_num_threads(threads)
    tdtype = getattr(torch, dtype)
    figures: dict[str, Any] = {}
    progress(f"matmul FLOP/s ({dtype}, {threads} threads, {shape.name} layer shapes) ...")
    figures["matmul_flops"] = matmul_flops(shape, tdtype)
    progress(f"  {figures['matmul_flops'] / 1e9:.1f} GFLOP/s; attention FLOP/s ...")
    figures["attention_flops"] = attention_flops(shape, tdtype)
    progress(f"  {figures['attention_flops'] / 1e9:.1f} GFLOP/s; memory bandwidth ...")
    gemv, copy = read_bandwidth(tdtype)
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
        memory_bandwidth=gemv,
        link_bandwidth=stream,
        link_latency_s=rtt,
        request_overhead_s=REQUEST_HOPS * rtt,
        overlap_compute_memory=False,  # a CPU core does the arithmetic and waits for memory
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
