"""What the KV digest (transfer/digest.py) costs: the libraries on KV chunk sizes, then TTFT at
2,000 tokens with digests off and on, a memcpy of the same bytes beside it, one run.

Run:  PYTHONPATH=worker:common:proto python benchmarks/kv_digest.py [--tokens 2000] [--repeats 3]

1. Hash speed on the sizes a push hashes (SmolLM2's KV, bf16: a 16-token block of one
   (layer, K|V), one (layer, K|V) of the prompt, a 4-layer chunk, the whole push): XXH3-64
   (`xxhash`, the one used), CRC32C (`crc32c`; `google-crc32c`, which wants `bytes`, so a copy)
   where installed, FLETCHER64 (device_digest.py: HIXL's device-side sum, here run by torch on
   this CPU, which is not where it is meant to run) and a memcpy (`ctypes.memmove`). Best of 7.
   `--hashes-only` stops here (writes benchmarks/figures/kv_digest_hashes.json).
2. The prefill-to-decode part of TTFT, in this process: the default model prefills the prompt
   in chunks of 4 layers, each chunk pushed as it is done (`KVPusher`, host engine) into a paged
   decode pool (16-token blocks, scattered), then the ready notify is taken and checked
   (`ReadyDigests`). Digests off and on alternate, `--repeats` each (medians); the digest's own
   time (the pusher's hashing plus the decode's check, timed around the calls) is the cost that
   does not drown in the machine's noise. Writes benchmarks/figures/kv_digest.json.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import platform
import random
import socket
import statistics
import time
from pathlib import Path
from typing import Any

FIGURES = Path(__file__).resolve().parent / "figures"


def best_seconds(fn: Any, arg: Any, reps: int) -> float:
    best = float("inf")
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(reps):
            fn(arg)
        best = min(best, (time.perf_counter() - start) / reps)
    return best


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def hashers() -> dict[str, Any]:
    import xxhash

    found: dict[str, Any] = {"xxh3_64 (xxhash)": xxhash.xxh3_64_intdigest}
    try:
        import crc32c

        found["crc32c (crc32c)"] = crc32c.crc32c
    except ImportError:
        pass
    try:
        import google_crc32c

        found["crc32c (google-crc32c, bytes copy)"] = lambda b: google_crc32c.value(bytes(b))
    except ImportError:
        pass
    return found


def library_speeds(sizes: dict[str, int]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for label, size in sizes.items():
        src = (ctypes.c_char * size).from_buffer_copy(random.Random(size).randbytes(size))
        dst = (ctypes.c_char * size)()
        reps = max(2, int(3e7 // size))
        row = {"memcpy": size / best_seconds(lambda _: ctypes.memmove(dst, src, size), None, reps) / 1e9}
        view = memoryview(src).cast("B")
        for name, fn in hashers().items():
            row[name] = size / best_seconds(fn, view, reps) / 1e9
        row["fletcher64 (torch, this CPU)"] = size / best_seconds(fletcher_of(src), None, reps) / 1e9
        out[f"{label} ({size} B)"] = row
        print(f"  {label:>22} {size:>10} B: " + "  ".join(f"{k} {v:.1f}" for k, v in row.items()) + " GB/s")
    return out


def fletcher_of(buffer: Any) -> Any:
    """A function hashing all of `buffer` with device_digest's FLETCHER64 (registered once)."""
    import torch

    from pdserve_worker.transfer import device_digest

    tensor = torch.frombuffer(buffer, dtype=torch.uint8)
    device_digest.register(tensor)
    addr, size = tensor.data_ptr(), tensor.numel()

    def run(_: Any) -> int:
        digest = device_digest.TensorDigest()
        digest.update(addr, 1, 0, size)
        return digest.intdigest()

    return run


class Road:
    """A prefill pool and a paged decode pool in this process, each on its own host engine."""

    def __init__(self, model: Any, tokens: int) -> None:
        from pdserve_common.kv_layout import KVLayout
        from pdserve_worker.kv.cache import KVCache
        from pdserve_worker.kv.slots import Grant
        from pdserve_worker.transfer.pool import KVPool
        from pdserve_worker.transfer.registry import create_engine

        self.model, self.tokens = model, tokens
        src_layout = model.config.kv_layout(1, tokens, "bfloat16")
        bt = 16
        blocks = -(-tokens // bt)
        dst_layout = KVLayout(
            1, src_layout.num_layers, tokens, src_layout.kv_heads, src_layout.head_dim, "bfloat16",
            block_tokens=bt, num_blocks=blocks * 2,
        )  # fmt: skip
        self.prefill, self.decode = create_engine("cpu"), create_engine("cpu")
        self.engine_id = f"127.0.0.1:{free_port()}"
        assert self.prefill.engine.initialize("127.0.0.1") == 0
        assert self.decode.engine.initialize(self.engine_id) == 0
        self.src = KVPool(self.prefill, src_layout)
        self.dst = KVPool(self.decode, dst_layout)
        self.cache = KVCache(src_layout, self.src.tensor)
        scattered = tuple(range(0, 2 * blocks, 2))  # every other block: nothing coalesces
        self.grant = Grant("r", 0, 1, self.engine_id, self.dst.base_addr, dst_layout, "n", scattered)
        gen = random.Random(tokens)
        self.ids = [gen.randrange(100, model.config.vocab_size) for _ in range(tokens)]

    def one(self, digest: bool, spent: list[float]) -> float:
        """Prefill + push + ready + check, seconds; `spent` gets the digest's own seconds."""
        from pdserve_worker.transfer import push as push_module
        from pdserve_worker.transfer.digest import ChunkDigests, ReadyDigests
        from pdserve_worker.transfer.push import KVPusher, PushSource
        from pdserve_worker.transfer.readiness import Readiness

        self.prefill.digest = "xxh3_64" if digest else None
        checker = ReadyDigests(
            "xxh3_64" if digest else None, self.dst.base_addr, self.dst.layout, lambda s, g: self.grant
        )
        hashing = [0.0]
        add = ChunkDigests.add

        def timed_add(digests: Any, layers: Any, pieces: Any) -> None:
            start = time.perf_counter()
            add(digests, layers, pieces)
            hashing[0] += time.perf_counter() - start

        push_module.ChunkDigests.add = timed_add  # type: ignore[method-assign]
        try:
            start = time.perf_counter()
            pusher = KVPusher(self.prefill, PushSource(self.src.base_addr, self.src.layout), [self.grant], self.tokens)
            self.model.prefill(self.ids, self.cache, 0, layers_per_chunk=4, on_chunk=pusher.push_chunk)
            pusher.finish({"first_token": 1})
            message = Readiness(self.decode).wait(0, 1, 30.0)
            check_start = time.perf_counter()
            checked = checker.check(0, 1, message)
            end = time.perf_counter()
        finally:
            push_module.ChunkDigests.add = add  # type: ignore[method-assign]
        assert checked == (pusher.stats.bytes if digest else 0)
        spent.append(hashing[0] + end - check_start)
        self.bytes = pusher.stats.bytes
        return end - start

    def memcpy_seconds(self) -> float:
        n = self.bytes
        dst = (ctypes.c_char * n)()
        return best_seconds(lambda _: ctypes.memmove(dst, self.src.base_addr, n), None, 3)

    def close(self) -> None:
        self.src.close()
        self.dst.close()
        self.prefill.engine.finalize()
        self.decode.engine.finalize()


def main(argv: list[str] | None = None) -> int:
    from pdserve_worker.model.loading.default_model import default_model_path
    from pdserve_worker.model.loading.loader import load_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hashes-only", action="store_true", help="the hash speeds alone (part 1)")
    args = parser.parse_args(argv)
    out: dict[str, Any] = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    out["machine"] = platform.processor() or platform.machine()
    print("[kv_digest] hash speed on KV chunk sizes (GB/s, best of 7)", flush=True)
    per = 2 * 3 * 64  # SmolLM2: bytes of one token's K (or V) of one layer, bf16
    sizes = {"block (16 tok)": 16 * per, "layer K (2000 tok)": 2000 * per}
    sizes |= {"4-layer chunk": 8 * 2000 * per, "whole push": 60 * 2000 * per}
    out["hash_gb_per_s"] = library_speeds(sizes)
    if args.hashes_only:
        FIGURES.mkdir(exist_ok=True)
        (FIGURES / "kv_digest_hashes.json").write_text(json.dumps(out, indent=1))
        return 0
    model = load_model(default_model_path(), dtype="bfloat16").model
    road = Road(model, args.tokens)
    try:
        road.one(True, [])  # warm-up: kernels, the link, the pages
        runs: dict[str, list[float]] = {"off": [], "on": []}
        spent: list[float] = []
        for _ in range(args.repeats):
            for mode in ("off", "on"):
                runs[mode].append(road.one(mode == "on", spent if mode == "on" else []))
        memcpy = road.memcpy_seconds()
    finally:
        road.close()
    off, on, own = statistics.median(runs["off"]), statistics.median(runs["on"]), statistics.median(spent)
    out |= {"tokens": args.tokens, "bytes": road.bytes, "runs_s": runs, "digest_s": spent, "memcpy_s": memcpy}
    out |= {"ttft_off_s": off, "ttft_on_s": on, "digest_share": own / off}
    print(
        f"[kv_digest] {args.tokens} tokens, {road.bytes / 1e6:.1f} MB pushed: prefill+push+check off {off * 1e3:.0f} ms, "
        f"on {on * 1e3:.0f} ms (medians of {args.repeats}); the digest's own time {own * 1e3:.2f} ms "
        f"= {100 * own / off:.2f}% of it; memcpy of the same bytes {memcpy * 1e3:.2f} ms",
        flush=True,
    )
    FIGURES.mkdir(exist_ok=True)
    (FIGURES / "kv_digest.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
