"""What leasing every rank costs a tensor-parallel decode's grant (issue #32).

Rank 0's `RankLeases.granted` (ranks/decode.py) waits until every rank holds the write
lease: one gloo broadcast and one gather on the group's lease channel. This runs the real
`TPGroup` with 2 processes on loopback (rank 1 serving `serve_leases`), times --grants grants
after 50 of warm-up, and prints p50/p99 per grant. Engines are left out (a fake lease table):
what is timed is the acknowledgement, which is what a TP decode's Reserve gained.

Usage: .venv/bin/python benchmarks/tp_lease_cost.py [--grants 350]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / d) for d in ("worker", "operator", "common", "proto")]

WARMUP = 50


class NoEngine:
    """A lease table that grants everything (the engine's own cost is not what is timed)."""

    def granted(self, slot: int, generation: int, blocks: object) -> None:
        pass

    def ended(self, slot: int, generation: int) -> None:
        pass

    def __len__(self) -> int:
        return 0


def rank_main(rank: int, port: int, grants: int, out: mp.Queue) -> None:
    from pdserve_worker.ranks.decode import RankLeases, serve_leases
    from pdserve_worker.ranks.group import GroupSpec, TPGroup

    group = TPGroup(GroupSpec(size=2, rank=rank, address=f"127.0.0.1:{port}", device="cpu"))
    if rank == 1:
        serve_leases(group, NoEngine())  # type: ignore[arg-type]
        return
    leases = RankLeases(NoEngine(), group)  # type: ignore[arg-type]
    times = []
    for i in range(WARMUP + grants):
        started = time.perf_counter()
        leases.granted(i % 8, i, (1, 2, 3))
        times.append(time.perf_counter() - started)
        leases.ended(i % 8, i)
    leases.close()
    measured = sorted(times[WARMUP:])
    out.put((statistics.median(measured), measured[int(0.99 * (len(measured) - 1))]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grants", type=int, default=350)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out: mp.Queue = mp.Queue()
    ranks = [mp.Process(target=rank_main, args=(r, port, args.grants, out)) for r in (0, 1)]
    for p in ranks:
        p.start()
    p50, p99 = out.get(timeout=300)
    for p in ranks:
        p.join(30)
    print(f"grant with every rank's lease: p50 {p50 * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms ({args.grants} grants)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
