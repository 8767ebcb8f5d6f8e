"""Broker: how fast a membership change reaches watchers, and how soon a restarted broker is whole.

Baseline, measured in the same run: a unary ListMembers round trip on one channel, the floor
of any broker call. Reported: median and p90 of
- change -> every watcher's view shows it (SetDraining toggled by a worker), for 1 and N watchers;
- broker restart -> every view is reconnected and shows the worker re-registered at the new broker.

    python benchmarks/broker_watch.py [--watchers 16] [--changes 100] [--restarts 3]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "worker"), str(ROOT / "operator"), str(ROOT / "common"), str(ROOT / "proto")]

from pdserve_common.kv_layout import KVLayout  # noqa: E402
from pdserve_common.membership import MemberInfo, MemoryRegion, Role  # noqa: E402
from pdserve_operator.broker.server import BrokerServer  # noqa: E402
from pdserve_worker.rpc.backoff import Backoff  # noqa: E402
from pdserve_worker.rpc.broker_client import BrokerClient  # noqa: E402
from pdserve_worker.rpc.broker_watch import MembershipView  # noqa: E402

SVC, TOKEN = "bench/svc", "bench-token"


def decode_info() -> MemberInfo:
    layout = KVLayout(num_slots=8, num_layers=30, max_len=2048, kv_heads=3, head_dim=64)
    return MemberInfo(
        worker_id="decode-0",
        role=Role.DECODE,
        grpc_endpoint="127.0.0.1:7000",
        engine_id="127.0.0.1:7100",
        regions=(MemoryRegion(0x10000, layout.total_bytes),),
        kv_layout=layout,
        revision="r",
        slots_total=8,
        slots_free=8,
    )


def summary(name: str, seconds: list[float], baseline: float | None = None) -> None:
    ms = sorted(s * 1000 for s in seconds)
    median, p90 = statistics.median(ms), ms[int(0.9 * (len(ms) - 1))]
    ratio = f"  x{median / (baseline * 1000):.1f} baseline" if baseline else ""
    print(f"{name:<44} median {median:8.2f} ms  p90 {p90:8.2f} ms  n={len(ms)}{ratio}")


async def change_latency(worker: BrokerClient, views: list[MembershipView], changes: int) -> list[float]:
    out = []
    for i in range(changes):
        draining = i % 2 == 0
        start = time.perf_counter()
        await worker.set_draining(draining)
        await asyncio.gather(*(v.wait_for(lambda v, d=draining: v.get("decode-0").draining == d, 10) for v in views))
        out.append(time.perf_counter() - start)
    return out


async def main(args: argparse.Namespace) -> None:
    broker = BrokerServer({SVC: TOKEN}, ttl_s=args.ttl, resync_grace_s=0)
    port = broker.start("127.0.0.1", 0)
    address = f"127.0.0.1:{port}"
    fast = Backoff(base_s=0.05, cap_s=0.5)
    worker = BrokerClient(address, SVC, TOKEN, backoff=fast)
    watchers = [BrokerClient(address, SVC, TOKEN, backoff=fast) for _ in range(args.watchers)]
    try:
        await worker.register(decode_info())
        rtt = []
        for _ in range(args.changes * 2):
            start = time.perf_counter()
            await worker.list_members()
            rtt.append(time.perf_counter() - start)
        baseline = statistics.median(rtt)
        summary("baseline: ListMembers round trip", rtt)

        views = [await w.watch([Role.DECODE]) for w in watchers]
        for v in views:
            await v.wait_for(lambda v: "decode-0" in v.members, 10)
        summary("change -> 1 watcher", await change_latency(worker, views[:1], args.changes), baseline)
        summary(f"change -> all {len(views)} watchers", await change_latency(worker, views, args.changes), baseline)

        recover = []
        for _ in range(args.restarts):
            broker.stop(0)
            await asyncio.sleep(0.5)
            broker = BrokerServer({SVC: TOKEN}, ttl_s=args.ttl, resync_grace_s=0)
            start = time.perf_counter()
            broker.start("127.0.0.1", port)
            new_id = broker.broker_id
            await asyncio.gather(
                *(
                    v.wait_for(
                        lambda v, new_id=new_id: (
                            v.connected
                            and v.broker_id == new_id
                            and "decode-0" in v.members
                            and v.get("decode-0").registered_unix_ms >= int((time.time() - 60) * 1000)
                        ),
                        30,
                    )
                    for v in views
                )
            )
            while not broker.members(SVC):
                await asyncio.sleep(0.01)
            recover.append(time.perf_counter() - start)
        summary(f"restart -> {len(views)} views whole again (ttl {args.ttl}s)", recover)
    finally:
        for client in [worker, *watchers]:
            await client.close()
        broker.stop(0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--watchers", type=int, default=16)
    parser.add_argument("--changes", type=int, default=100)
    parser.add_argument("--restarts", type=int, default=3)
    parser.add_argument("--ttl", type=float, default=3.0)
    logging.basicConfig(level=logging.ERROR)  # restarts make the clients warn by design
    asyncio.run(main(parser.parse_args()))
