"""KV transfer benchmark: push throughput, readiness wake-up, compute/transfer overlap.

Run:  PYTHONPATH=worker:common:proto:tests python benchmarks/transfer.py [--repeats 9] [--quick]

Everything is measured in this one run against baselines measured on the same machine:

1. Push throughput at 1, 8 and 64 MB: a `KVPusher` pushes one prompt's KV (8 layers × K|V,
   8 KV heads × 128 dims, bf16: 32 KB per token, so 32/256/2048 tokens) from this process into
   a decode peer process, timed from the first put to the last put's completion (`flush`; the
   ready notify is measured in 2). Shared-memory path vs one `ctypes.memmove` of the same bytes
   in one thread; TCP path (`pdserve.Transport=tcp`) vs a raw TCP loopback socket sending the
   same bytes to a receiver process that answers one byte. Target: ratio >= 0.8 each.
   NIXL is timed side by side only when `nixl_cu12` imports (it is not installed for this).
2. Readiness: wake-up latency from just before `send_notify` to the decode peer's `wait`
   returning (p50/p99), and CPU seconds the decode process burns while one request waits 2 s
   for nothing, for each mode. Targets: interrupt p50 <= 200 µs, CPU <= 2% of spin's.
3. Overlap for a 2048-token prompt in SmolLM2-135M's KV shape (30 layers, 3 KV heads × 64, bf16):
   time-to-done of compute+pipelined push, and of compute-then-push, each ÷ compute alone, for
   the shared-memory path as configured by default (copies up to 16 MiB on the compute
   thread), the same with every copy on the engine's copy thread, and the TCP path. The compute is a stand-in
   (`StandInCompute`, a matmul per layer that writes the layer's KV); section 4 runs the real model.
4. The acceptance figure itself: the bundled SmolLM2-135M prefilling a 2048-token prompt into
   a pool registered with the engine, as the prefill role does it (`model.prefill(...,
   on_chunk=pusher.push_chunk)`): time to the ready notify's ACK with the pipelined push, and
   with compute-then-push, each ÷ the same prefill without any push. Target <= 1.10.
   `--no-model` skips it (it loads the model and takes about a minute).
5. What the KV plane's security costs, auth on vs off side by side in one run: a decode peer
   with the service key, leased writes, READ off and the nonce check on the ready notify, and
   one with none of it (HIXL's own behaviour), each pushed into by a client with (or without)
   the key. Push throughput at 8 and 64 MB over both paths (interleaved medians) and interrupt
   wake-up p50 (samples alternating between the two). Targets: throughput on ÷ off >= 0.95,
   wake-up p50 on - off <= 50 µs. `--auth-only` runs just this section.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import importlib.util
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

# The peer processes are the tests' (tests/support): found without PYTHONPATH=...:tests.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from pdserve_common.kv_layout import KVLayout  # noqa: E402
from pdserve_worker.transfer.base import TransferBackend  # noqa: E402
from pdserve_worker.transfer.pool import KVPool  # noqa: E402
from pdserve_worker.transfer.push import KVPusher, PushSource, layer_chunks, prefill_and_push  # noqa: E402
from pdserve_worker.transfer.registry import create_engine  # noqa: E402
from support.transfer_peers import PeerProcess, decode_main, grant_from_dict  # noqa: E402

MB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def interleaved_medians(
    fns: dict[str, Callable[[], float]], repeats: int, warmup: int = 2, settle: bool = False
) -> dict[str, float]:
    """Run each timing function in turn, `repeats` rounds, and return each one's median.

    Interleaving puts a subject and its baseline under the same machine conditions: on a
    shared 2-core machine the load changes from one second to the next. `settle` runs each
    function once untimed right before its timed run, so every sample is a warm, steady-state
    one (a loopback TCP stream measured right after other big memory traffic is otherwise up
    to 2x slower, and which of the subjects ran just before would decide the ratio)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if settle:
                fn()
            samples[name].append(fn())
    return {name: statistics.median(values) for name, values in samples.items()}


AUTH_KEY = "5e" * 32  # the benchmark's service key (a worker derives its own: link_auth.py)
AUTH_ON = {"pdserve.AuthKey": AUTH_KEY, "pdserve.RemoteWrite": "leased", "pdserve.RemoteRead": "0"}


def client(transport: str, **options: str) -> TransferBackend:
    backend = create_engine("cpu")
    backend.check(backend.engine.initialize("127.0.0.1", {"pdserve.Transport": transport, **options}), "initialize")
    return backend


# ---- 1. throughput -------------------------------------------------------------------------------------
def throughput_layout(total_bytes: int, num_slots: int = 1) -> KVLayout:
    tokens = total_bytes // (16 * 8 * 128 * 2)  # 16 runs (8 layers × K|V) of 2 KB per token
    return KVLayout(num_slots=num_slots, num_layers=8, max_len=tokens, kv_heads=8, head_dim=128, dtype="bfloat16")


def memcpy_s(nbytes: int) -> Callable[[], float]:
    """One memmove of all the bytes in one thread: the target baseline."""
    src = (ctypes.c_char * nbytes)()
    dst = (ctypes.c_char * nbytes)()
    ctypes.memset(src, 1, nbytes)
    ctypes.memset(dst, 0, nbytes)

    def once() -> float:
        t0 = time.perf_counter()
        ctypes.memmove(dst, src, nbytes)
        return time.perf_counter() - t0

    return once


def push_s(backend: TransferBackend, source: KVPool, grant: dict[str, Any]) -> Callable[[], float]:
    target = grant_from_dict(grant)
    layout = source.layout

    def once() -> float:
        t0 = time.perf_counter()
        pusher = KVPusher(backend, PushSource(source.base_addr, layout), [target], layout.max_len, queue_depth=64)
        pusher.push_chunk(layout.layer_range)
        pusher.flush()
        elapsed = time.perf_counter() - t0
        pusher.abort()  # nothing outstanding: just closes this pusher without a notify
        return elapsed

    return once


def tcp_sink_main(conn: Connection, config: dict[str, Any]) -> None:
    """Receives length-prefixed payloads into one buffer and answers each with one byte."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    conn.send((True, {"port": listener.getsockname()[1]}))
    sock, _ = listener.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(bytearray(config["max_bytes"]))
    while True:
        head = sock.recv(8, socket.MSG_WAITALL)
        if len(head) < 8:
            return
        n, got = int.from_bytes(head, "big"), 0
        while got < n:
            got += sock.recv_into(buf[got:n])
        sock.sendall(b"k")


def raw_tcp_s(sock: socket.socket, nbytes: int) -> Callable[[], float]:
    payload = memoryview(bytearray(b"\x01" * nbytes))

    def once() -> float:
        t0 = time.perf_counter()
        sock.sendall(nbytes.to_bytes(8, "big"))
        sock.sendall(payload)
        sock.recv(1)
        return time.perf_counter() - t0

    return once


def bench_throughput(repeats: int, sizes_mb: list[int]) -> list[dict[str, Any]]:
    rows = []
    largest = max(sizes_mb) * MB
    decode_layout = throughput_layout(largest, 2)
    sink = PeerProcess.start(tcp_sink_main, {"max_bytes": largest})
    decode = PeerProcess.start(
        decode_main, {"engine_id": f"127.0.0.1:{free_port()}", "layout": decode_layout.to_dict()}
    )
    raw = socket.create_connection(("127.0.0.1", sink.info["port"]))
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    shm_backend, tcp_backend = client("auto"), client("tcp")
    try:
        for size_mb in sizes_mb:
            nbytes = size_mb * MB
            layout = throughput_layout(nbytes)
            sources = {name: KVPool(backend, layout) for name, backend in (("shm", shm_backend), ("tcp", tcp_backend))}
            grants = {}
            for name, source in sources.items():
                ctypes.memset(source.base_addr, 7, source.nbytes)
                grants[name] = decode.call("reserve", request_id=f"{name}-{size_mb}", ttl_s=3600)
            row: dict[str, Any] = {"size_mb": size_mb}
            row.update(
                interleaved_medians(
                    {
                        "memcpy_s": memcpy_s(nbytes),
                        "shm_push_s": push_s(shm_backend, sources["shm"], grants["shm"]),
                        "raw_tcp_s": raw_tcp_s(raw, nbytes),
                        "tcp_push_s": push_s(tcp_backend, sources["tcp"], grants["tcp"]),
                    },
                    repeats,
                    settle=True,
                )
            )
            for name, grant in grants.items():
                decode.call("commit", slot=grant["slot"], generation=grant["generation"])
                decode.call("release", slot=grant["slot"], generation=grant["generation"])
                sources[name].close()
            rows.append(row)
    finally:
        for backend in (shm_backend, tcp_backend):
            backend.engine.finalize()
        raw.close()
        decode.stop()
        sink.stop()
    return rows


def bench_nixl() -> str:
    if importlib.util.find_spec("nixl_cu12") is None:
        return "nixl_cu12 not installed: NIXL comparison skipped (it is not installed for this benchmark)"
    return "nixl_cu12 is importable, but no NIXL runner is wired in this script yet"


# ---- 2. readiness ---------------------------------------------------------------------------------------
def bench_readiness(samples: int, cpu_wait_s: float) -> list[dict[str, Any]]:
    layout = KVLayout(num_slots=2, num_layers=1, max_len=16, kv_heads=1, head_dim=8, dtype="bfloat16")
    rows = []
    for mode in ("interrupt", "poll", "spin"):
        engine_id = f"127.0.0.1:{free_port()}"
        decode = PeerProcess.start(
            decode_main, {"engine_id": engine_id, "layout": layout.to_dict(), "mode": mode, "poll_interval_us": 100}
        )
        backend = client("auto")
        try:
            backend.ensure_connected(engine_id, 2000)
            api = backend.api
            latencies = []
            for i in range(samples + 5):
                grant = decode.call("reserve", request_id=f"{mode}-{i}", ttl_s=60)
                decode.send("wait", slot=grant["slot"], generation=grant["generation"], timeout_s=10)
                time.sleep(0.003)  # let the decode side block before the notify goes out
                body = (
                    f'{{"request_id":"{mode}-{i}","slot":{grant["slot"]},"generation":{grant["generation"]},'
                    f'"nonce":"{grant["nonce"]}","num_tokens":1}}'
                )
                t0 = time.perf_counter_ns()
                backend.check(backend.engine.send_notify(engine_id, api.NotifyDesc("kv_ready", body), 2000), "notify")
                woke = decode.result()["woke_ns"]
                if i >= 5:  # the first few warm up the threads and the link
                    latencies.append((woke - t0) / 1000)
                decode.call("commit", slot=grant["slot"], generation=grant["generation"])
                decode.call("release", slot=grant["slot"], generation=grant["generation"])
            grant = decode.call("reserve", request_id=f"{mode}-idle", ttl_s=60)
            cpu = decode.call("wait_cpu", slot=grant["slot"], generation=grant["generation"], seconds=cpu_wait_s)
            latencies.sort()
            rows.append(
                {
                    "mode": mode,
                    "p50_us": statistics.median(latencies),
                    "p99_us": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
                    "cpu_s": cpu["cpu_s"],
                    "wall_s": cpu["wall_s"],
                }
            )
        finally:
            backend.engine.finalize()
            decode.stop()
    return rows


# ---- 5. what authentication costs ----------------------------------------------------------------------
def _auth_decode(layout: KVLayout, on: bool, mode: str = "interrupt") -> PeerProcess:
    return PeerProcess.start(
        decode_main,
        {
            "engine_id": f"127.0.0.1:{free_port()}",
            "layout": layout.to_dict(),
            "mode": mode,
            "options": AUTH_ON if on else {},
            "check_nonce": on,
        },
    )


def bench_auth_throughput(repeats: int, sizes_mb: list[int]) -> list[dict[str, Any]]:
    """Push seconds with and without authentication, shm and TCP.

    Paired per round: each round times `off`, `on` and a control `off2` (a second client of
    the same unauthenticated decode: what two identical set-ups differ by on this machine)
    back to back, in an order that rotates from round to round, and keeps each round's ratios;
    the medians of those ratios are the figures (a slow second on a shared box hits a whole
    round, not one side)."""
    largest = max(sizes_mb) * MB
    decodes = {
        False: _auth_decode(throughput_layout(largest, 4), False),
        True: _auth_decode(throughput_layout(largest, 2), True),
    }
    key = {"pdserve.AuthKey": AUTH_KEY} if AUTH_ON else {}
    variants = {"off": False, "off2": False, "on": True}
    clients = {
        (path, v): client("auto" if path == "shm" else "tcp", **(key if on else {}))
        for path in ("shm", "tcp")
        for v, on in variants.items()
    }
    rows = []
    try:
        for size_mb in sizes_mb:
            layout = throughput_layout(size_mb * MB)
            sources, grants, fns = {}, {}, {}
            for (path, v), backend in clients.items():
                name = f"{path}_{v}"
                decode = decodes[variants[v]]
                sources[name] = KVPool(backend, layout)
                ctypes.memset(sources[name].base_addr, 7, sources[name].nbytes)
                grants[name] = (decode, decode.call("reserve", request_id=name, ttl_s=3600))
                fns[name] = push_s(backend, sources[name], grants[name][1])
            samples: dict[str, list[float]] = {name: [] for name in fns}
            ratios: dict[str, list[float]] = {f"{p}_{r}": [] for p in ("shm", "tcp") for r in ("on", "off2")}
            for fn in fns.values():
                fn()
            for i in range(repeats):
                for path in ("shm", "tcp"):
                    order = ["off", "on", "off2"]
                    order = order[i % 3 :] + order[: i % 3]
                    got = {}
                    for v in order:
                        fns[f"{path}_{v}"]()  # settle: an untimed run right before the timed one
                        got[v] = fns[f"{path}_{v}"]()
                        samples[f"{path}_{v}"].append(got[v])
                    ratios[f"{path}_on"].append(got["off"] / got["on"])  # throughput on ÷ off
                    ratios[f"{path}_off2"].append(got["off"] / got["off2"])
            row: dict[str, Any] = {"size_mb": size_mb}
            row.update({name: statistics.median(v) for name, v in samples.items()})
            row.update({f"ratio_{name}": statistics.median(v) for name, v in ratios.items()})
            for name, (decode, grant) in grants.items():
                decode.call("commit", slot=grant["slot"], generation=grant["generation"])
                decode.call("release", slot=grant["slot"], generation=grant["generation"])
                sources[name].close()
            rows.append(row)
    finally:
        for backend in clients.values():
            backend.engine.finalize()
        for decode in decodes.values():
            decode.stop()
    return rows


def _wake_once(decode: PeerProcess, backend: TransferBackend, engine_id: str, tag: str) -> float:
    grant = decode.call("reserve", request_id=tag, ttl_s=60)
    decode.send("wait", slot=grant["slot"], generation=grant["generation"], timeout_s=10)
    time.sleep(0.003)  # let the decode side block before the notify goes out
    body = (
        f'{{"request_id":"{tag}","slot":{grant["slot"]},"generation":{grant["generation"]},'
        f'"nonce":"{grant["nonce"]}","num_tokens":1}}'
    )
    t0 = time.perf_counter_ns()
    backend.check(backend.engine.send_notify(engine_id, backend.api.NotifyDesc("kv_ready", body), 2000), "notify")
    woke = decode.result()["woke_ns"]
    decode.call("commit", slot=grant["slot"], generation=grant["generation"])
    decode.call("release", slot=grant["slot"], generation=grant["generation"])
    return (woke - t0) / 1000


def bench_auth_wakeup(samples: int) -> dict[str, dict[str, float]]:
    """Interrupt wake-up with and without authentication, samples alternating between them."""
    layout = KVLayout(num_slots=2, num_layers=1, max_len=16, kv_heads=1, head_dim=8, dtype="bfloat16")
    decodes = {on: _auth_decode(layout, on) for on in (False, True)}
    backends = {on: client("auto", **({"pdserve.AuthKey": AUTH_KEY} if on else {})) for on in (False, True)}
    latencies: dict[bool, list[float]] = {False: [], True: []}
    diffs: list[float] = []
    try:
        for on in (False, True):
            backends[on].ensure_connected(decodes[on].info["engine_id"], 2000)
        for i in range(samples + 5):
            pair = {}
            for on in (False, True) if i % 2 else (True, False):
                pair[on] = _wake_once(decodes[on], backends[on], decodes[on].info["engine_id"], f"w{i}")
            if i >= 5:
                for on, us in pair.items():
                    latencies[on].append(us)
                diffs.append(pair[True] - pair[False])
    finally:
        for on in (False, True):
            backends[on].engine.finalize()
            decodes[on].stop()
    out = {}
    for on, values in latencies.items():
        values.sort()
        out["on" if on else "off"] = {
            "p50_us": statistics.median(values),
            "p99_us": values[min(len(values) - 1, int(0.99 * len(values)))],
        }
    out["paired"] = {"p50_us": statistics.median(diffs)}
    return out


def bench_auth_parts(n: int = 20000) -> dict[str, float]:
    """The per-notify work authentication adds, timed alone (µs): the nonce check, and
    receiving a datagram with the sender's credentials instead of without."""
    import socket as _socket

    from pdserve_worker.kv.slots import SlotTable
    from pdserve_worker.transfer.backends.host import wire
    from pdserve_worker.transfer.backends.host.notify_inbox import NotifyInbox, abstract

    slots = SlotTable(throughput_layout(MB, 2))
    grant = slots.reserve("parts", 60)
    t0 = time.perf_counter()
    for _ in range(n):
        slots.verify(grant.slot, grant.generation, grant.nonce)
    out = {"nonce_check_us": (time.perf_counter() - t0) / n * 1e6}
    from pdserve_worker.transfer.leases import LeaseTable

    leases = LeaseTable()
    for i in range(8):  # a decode with 8 reserved slots
        leases.grant((i + 1) << 30, 64 * MB)
    t0 = time.perf_counter()
    for i in range(n):
        leases.covers((1 << 30) + (i % 16) * MB, MB)
    out["lease_check_us"] = (time.perf_counter() - t0) / n * 1e6  # per descriptor of a TCP WRITE frame
    frame = wire.notify_frame(b"kv_ready" + b"{" + b"x" * 120 + b"}", 8)
    for check in (False, True):
        inbox = NotifyInbox(64, check_sender=check)
        with _socket.socket(_socket.AF_UNIX, _socket.SOCK_DGRAM) as sock:
            sock.connect(abstract(inbox.name))
            times = []
            for _ in range(n // 10):
                t0 = time.perf_counter_ns()
                sock.send(frame)
                inbox.drain()
                times.append(time.perf_counter_ns() - t0)
        inbox.close()
        out[f"datagram_{'checked' if check else 'plain'}_us"] = statistics.median(times) / 1000
    return out


def report_auth(repeats: int, samples: int) -> None:
    print(f"\n## authentication cost (auth on vs off side by side; {repeats} paired rounds, medians)")
    print(
        "| size | shm off | shm on | on ÷ off | control off ÷ off | TCP off | TCP on | on ÷ off | control off ÷ off |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in bench_auth_throughput(repeats, [8, 64]):
        n = r["size_mb"] * MB
        g = {k: n / v / 1e9 for k, v in r.items() if not k.startswith(("size", "ratio"))}
        print(
            f"| {r['size_mb']} MB | {g['shm_off']:.2f} GB/s | {g['shm_on']:.2f} GB/s | {r['ratio_shm_on']:.3f} | "
            f"{r['ratio_shm_off2']:.3f} | {g['tcp_off']:.2f} GB/s | {g['tcp_on']:.2f} GB/s | {r['ratio_tcp_on']:.3f} | "
            f"{r['ratio_tcp_off2']:.3f} |"
        )
    w = bench_auth_wakeup(samples)
    print(
        f"\ninterrupt wake-up ({samples} alternating samples each): off p50 {w['off']['p50_us']:.0f} µs "
        f"(p99 {w['off']['p99_us']:.0f}), on p50 {w['on']['p50_us']:.0f} µs (p99 {w['on']['p99_us']:.0f}): "
        f"on - off = {w['on']['p50_us'] - w['off']['p50_us']:+.0f} µs; median of paired differences "
        f"{w['paired']['p50_us']:+.0f} µs"
    )
    parts = bench_auth_parts()
    print(
        f"per-notify work auth adds, alone: nonce check {parts['nonce_check_us']:.1f} µs; datagram send+drain "
        f"{parts['datagram_plain_us']:.1f} µs plain vs {parts['datagram_checked_us']:.1f} µs with the sender's credentials; "
        f"per TCP write descriptor: lease check {parts['lease_check_us']:.2f} µs (a push of 8 layers sends 16 per chunk)"
    )


# ---- 3. overlap -----------------------------------------------------------------------------------------
class StandInCompute:
    """A per-layer stand-in for the model: one matmul, then the layer's K and V written into
    the source pool (as the real forward writes its KV cache). Deliberately far lighter than
    the real model on this CPU (a few ms a layer instead of 80) so that the transfer is a
    visible share of the total, as it is on an accelerator where compute is fast; swap in the
    model with `run_overlap`."""

    def __init__(self, source: KVPool, num_tokens: int, hidden: int = 128, ffn: int = 192) -> None:
        import torch

        self.torch = torch
        self.source = source
        self.num_tokens = num_tokens
        # float32: bf16 matmuls are pathologically slow on CPUs without bf16 units.
        self.x = torch.randn(num_tokens, hidden)
        self.w = torch.randn(hidden, ffn)
        self.kv = source.tensor  # (slot, layer, K|V, token, kv_head, head_dim)

    def __call__(self, layers: range) -> None:
        lay = self.source.layout
        for layer in layers:
            h = self.x @ self.w  # the "work"
            flat = (
                h[:, : lay.kv_heads * lay.head_dim]
                .reshape(self.num_tokens, lay.kv_heads, lay.head_dim)
                .to(self.kv.dtype)
            )
            local = layer - lay.first_layer
            self.kv[0, local, 0, : self.num_tokens].copy_(flat)
            self.kv[0, local, 1, : self.num_tokens].copy_(flat)


def granted_round(decode: PeerProcess, timeout_s: float, push: Callable[[dict[str, Any]], float]) -> float:
    """One timed push into a fresh slot of the decode peer: reserve, let the peer wait for the
    ready notify, `push(grant)` (returns its seconds), collect the wake-up, commit and release."""
    grant = decode.call("reserve", request_id="overlap", ttl_s=600)
    decode.send("wait", slot=grant["slot"], generation=grant["generation"], timeout_s=timeout_s)
    elapsed = push(grant)
    decode.result()
    decode.call("commit", slot=grant["slot"], generation=grant["generation"])
    decode.call("release", slot=grant["slot"], generation=grant["generation"])
    return elapsed


def run_overlap(
    backend: TransferBackend,
    compute: Callable[[range], None],
    source: KVPool,
    grant: dict[str, Any],
    num_tokens: int,
    layers_per_chunk: int,
    pipelined: bool,
) -> float:
    """Seconds from the first chunk's compute to the ready notify's ACK."""
    t0 = time.perf_counter()
    pusher = KVPusher(backend, PushSource(source.base_addr, source.layout), [grant_from_dict(grant)], num_tokens)
    prefill_and_push(compute, pusher, layer_chunks(source.layout.layer_range, layers_per_chunk), pipelined=pipelined)
    return time.perf_counter() - t0


def bench_overlap(repeats: int, layers_per_chunk: int, compute_threads: int = 1) -> list[dict[str, Any]]:
    import torch

    torch.set_num_threads(compute_threads)
    tokens = 2048
    decode_layout = KVLayout(num_slots=2, num_layers=30, max_len=tokens, kv_heads=3, head_dim=64, dtype="bfloat16")
    source_layout = KVLayout(num_slots=1, num_layers=30, max_len=tokens, kv_heads=3, head_dim=64, dtype="bfloat16")
    engine_id = f"127.0.0.1:{free_port()}"
    decode = PeerProcess.start(decode_main, {"engine_id": engine_id, "layout": decode_layout.to_dict()})
    rows = []
    try:
        variants = [
            ("shm (copies on the compute thread: default)", "auto", {}),
            ("shm, copy thread", "auto", {"pdserve.InlineCopyMaxBytes": "0"}),
            ("tcp", "tcp", {}),
        ]
        for path, transport, options in variants:
            backend = client(transport, **options)
            source = KVPool(backend, source_layout)
            compute = StandInCompute(source, tokens)
            chunks = layer_chunks(source_layout.layer_range, layers_per_chunk)

            def compute_only() -> float:
                t0 = time.perf_counter()
                for chunk in chunks:
                    compute(chunk)
                return time.perf_counter() - t0

            def with_push(pipelined: bool, compute: Callable[[range], None] = compute) -> Callable[[], float]:
                return lambda: granted_round(
                    decode,
                    60,
                    lambda grant: run_overlap(backend, compute, source, grant, tokens, layers_per_chunk, pipelined),
                )

            def push_only() -> float:
                return with_push(True, compute=lambda chunk: None)()

            m = interleaved_medians(
                {
                    "compute_s": compute_only,
                    "pipelined_s": with_push(True),
                    "serial_s": with_push(False),
                    "push_s": push_only,
                },
                repeats,
                warmup=1,
            )
            base, piped, serial = m["compute_s"], m["pipelined_s"], m["serial_s"]
            rows.append(
                {"path": path, "compute_s": base, "pipelined_s": piped, "serial_s": serial, "push_s": m["push_s"]}
            )
            source.close()
            backend.engine.finalize()
    finally:
        decode.stop()
    return rows


def bench_model_overlap(repeats: int, layers_per_chunk: int, tokens: int, dtype: str) -> list[dict[str, Any]]:
    """Section 4: the real prefill, pushed over each path; see the module docstring."""
    import torch

    from pdserve_worker.kv.cache import KVCache
    from pdserve_worker.model.loading.loader import load_model

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    model = load_model(None, dtype=dtype).model
    layout = model.config.kv_layout(1, tokens, dtype)
    decode_layout = model.config.kv_layout(2, tokens, dtype)
    ids = torch.randint(100, model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    engine_id = f"127.0.0.1:{free_port()}"
    decode = PeerProcess.start(decode_main, {"engine_id": engine_id, "layout": decode_layout.to_dict()})
    rows = []
    try:
        for path, transport in (("shm (default)", "auto"), ("tcp", "tcp")):
            backend = client(transport)
            source = KVPool(backend, layout)
            cache = KVCache(layout, source.tensor)

            def prefill_only() -> float:
                t0 = time.perf_counter()
                model.prefill(ids, cache, 0, layers_per_chunk)
                return time.perf_counter() - t0

            def prefill_pushed(grant: dict[str, Any], pipelined: bool) -> float:
                t0 = time.perf_counter()
                pusher = KVPusher(backend, PushSource(source.base_addr, layout), [grant_from_dict(grant)], tokens)
                try:
                    if pipelined:
                        model.prefill(ids, cache, 0, layers_per_chunk, on_chunk=pusher.push_chunk)
                    else:
                        model.prefill(ids, cache, 0, layers_per_chunk)
                        for chunk in layer_chunks(layout.layer_range, layers_per_chunk):
                            pusher.push_chunk(chunk)
                    pusher.finish()
                except BaseException:
                    pusher.abort()
                    raise
                return time.perf_counter() - t0

            def with_push(pipelined: bool) -> Callable[[], float]:
                return lambda: granted_round(decode, 120, lambda grant: prefill_pushed(grant, pipelined))

            m = interleaved_medians(
                {"compute_s": prefill_only, "pipelined_s": with_push(True), "serial_s": with_push(False)},
                repeats,
                warmup=1,
            )
            rows.append({"path": path, "kv_mb": layout.bytes_per_token * 2 * layout.num_layers * tokens / MB, **m})
            source.close()
            backend.engine.finalize()
    finally:
        decode.stop()
    return rows


# ---- report ---------------------------------------------------------------------------------------------
def machine() -> str:
    cpu = platform.processor() or "unknown cpu"
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{platform.node()}: {cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--samples", type=int, default=200, help="readiness wake-ups per mode")
    parser.add_argument("--cpu-wait", type=float, default=2.0, help="seconds of idle wait for the CPU figure")
    parser.add_argument("--layers-per-chunk", type=int, default=2)
    parser.add_argument(
        "--compute-threads",
        type=int,
        default=1,
        help="torch threads of the stand-in compute; 1 leaves a core for the copy (and keeps "
        "OpenMP's barrier stalls under other load out of the figure on a shared 2-core box)",
    )
    parser.add_argument("--quick", action="store_true", help="fewer repeats and samples (a smoke run)")
    parser.add_argument("--no-model", action="store_true", help="skip section 4 (the real model's prefill)")
    parser.add_argument("--auth-only", action="store_true", help="run only section 5 (what authentication costs)")
    parser.add_argument("--model-repeats", type=int, default=5, help="rounds of section 4 (each ~3 prefills)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="section 4's model dtype; auto = what `pdserve local` picks on this CPU",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.samples, args.cpu_wait, args.model_repeats = 3, 40, 0.5, 2

    print(f"# transfer benchmark {datetime.date.today().isoformat()} on {machine()}")
    print("load average at start: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    if args.auth_only:
        report_auth(args.repeats, args.samples)
        print("\nload average at end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
        return 0
    print(
        f"\n## push throughput (median of {args.repeats} interleaved rounds, each sample right after an untimed run; "
        "GB/s = 1e9 bytes/s)"
    )
    print("| size | memcpy, 1 thread | shm push | ratio | raw TCP | TCP push | ratio |")
    print("|---|---|---|---|---|---|---|")
    for r in bench_throughput(args.repeats, [1, 8, 64]):
        n = r["size_mb"] * MB
        gbps = {k: n / v / 1e9 for k, v in r.items() if k.endswith("_s")}
        print(
            f"| {r['size_mb']} MB | {gbps['memcpy_s']:.2f} GB/s | {gbps['shm_push_s']:.2f} GB/s | "
            f"{r['memcpy_s'] / r['shm_push_s']:.2f} | {gbps['raw_tcp_s']:.2f} GB/s | "
            f"{gbps['tcp_push_s']:.2f} GB/s | {r['raw_tcp_s'] / r['tcp_push_s']:.2f} |"
        )
    print(f"\nNIXL: {bench_nixl()}")

    print(f"\n## readiness ({args.samples} wake-ups per mode; CPU during a {args.cpu_wait:g} s idle wait)")
    print("| mode | p50 | p99 | CPU s | CPU vs spin |")
    print("|---|---|---|---|---|")
    rows = bench_readiness(args.samples, args.cpu_wait)
    spin_cpu = next(r["cpu_s"] for r in rows if r["mode"] == "spin") or 1e-9
    for r in rows:
        print(
            f"| {r['mode']} | {r['p50_us']:.0f} µs | {r['p99_us']:.0f} µs | {r['cpu_s']:.3f} | "
            f"{100 * r['cpu_s'] / spin_cpu:.1f}% |"
        )

    print(
        f"\n## overlap (2048-token prompt, 30 layers, {args.layers_per_chunk} layers per chunk, "
        f"stand-in compute on {args.compute_threads} thread(s); median of {args.repeats} interleaved rounds)"
    )
    print("| path | push alone | compute only | compute + pipelined push | ratio | compute then push | ratio |")
    print("|---|---|---|---|---|---|---|")
    for r in bench_overlap(args.repeats, args.layers_per_chunk, args.compute_threads):
        print(
            f"| {r['path']} | {r['push_s'] * 1e3:.1f} ms | {r['compute_s'] * 1e3:.1f} ms | {r['pipelined_s'] * 1e3:.1f} ms | "
            f"{r['pipelined_s'] / r['compute_s']:.3f} | {r['serial_s'] * 1e3:.1f} ms | {r['serial_s'] / r['compute_s']:.3f} |"
        )
    report_auth(args.repeats, args.samples)
    if not args.no_model:
        from pdserve_worker.cli.local_deployment import auto_dtype

        dtype = auto_dtype() if args.dtype == "auto" else args.dtype
        tokens = 2048
        print(
            f"\n## overlap with the real model (SmolLM2-135M {dtype}, {tokens}-token prefill, {args.layers_per_chunk} "
            f"layers per chunk, all cores; median of {args.model_repeats} interleaved rounds; target pipelined <= 1.10)"
        )
        print("| path | KV pushed | prefill alone | prefill + pipelined push | ratio | prefill then push | ratio |")
        print("|---|---|---|---|---|---|---|")
        for r in bench_model_overlap(args.model_repeats, args.layers_per_chunk, tokens, dtype):
            print(
                f"| {r['path']} | {r['kv_mb']:.1f} MiB | {r['compute_s'] * 1e3:.0f} ms | {r['pipelined_s'] * 1e3:.0f} ms | "
                f"{r['pipelined_s'] / r['compute_s']:.3f} | {r['serial_s'] * 1e3:.0f} ms | {r['serial_s'] / r['compute_s']:.3f} |"
            )
    print("\nload average at end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
