"""What one shared-memory push costs a tree, at 64 KB, 1 MB and 8 MB: for A B pairs of two trees.

Run:  python benchmarks/push_cost.py [--tree DIR] [--rounds 7]      (one JSON line of medians, µs)

`--tree` imports pdserve (and benchmarks/transfer.py's helpers) from another checkout, so two
commits alternate in one shell loop on one machine. Each size: 20 untimed pushes, then `--rounds`
rounds of 30 timed pushes; the figure is the median of the rounds' medians, and its spread the
rounds' min and max. A push is what transfer.py times: a new `KVPusher`, one chunk of every
layer, `flush` (the fixed cost per push shows at 64 KB, the per-byte cost at 8 MB), into a
decode peer process. transfer.py's `--quick` rounds at 8 MB are too few to see a few percent.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
from pathlib import Path

SIZES_KB = (64, 1024, 8192)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    tree = args.tree.resolve()
    sys.path[:0] = [str(tree / p) for p in ("benchmarks", "tests", "worker", "common", "proto")]
    import transfer as bench  # that tree's benchmarks/transfer.py
    from pdserve_worker.transfer.pool import KVPool

    layout = bench.throughput_layout(max(SIZES_KB) * 1024, 2)
    peer = {"engine_id": f"127.0.0.1:{bench.free_port()}", "layout": layout.to_dict()}
    decode = bench.PeerProcess.start(bench.decode_main, peer)
    backend = bench.client("auto")
    out: dict[str, float | list[float]] = {}
    try:
        for kb in SIZES_KB:
            source = KVPool(backend, bench.throughput_layout(kb * 1024))
            ctypes.memset(source.base_addr, 7, source.nbytes)
            grant = decode.call("reserve", request_id=f"cost-{kb}", ttl_s=3600)
            once = bench.push_s(backend, source, grant)
            for _ in range(20):
                once()
            rounds = [statistics.median(once() for _ in range(30)) * 1e6 for _ in range(args.rounds)]
            out[f"{kb}KB_us"] = round(statistics.median(rounds), 1)
            out[f"{kb}KB_spread"] = [round(min(rounds), 1), round(max(rounds), 1)]
            decode.call("commit", slot=grant["slot"], generation=grant["generation"])
            decode.call("release", slot=grant["slot"], generation=grant["generation"])
            source.close()
    finally:
        backend.engine.finalize()
        decode.stop()
    print(json.dumps({"tree": str(tree), **out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
