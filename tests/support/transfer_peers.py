"""Stand-in decode and prefill processes built from the transfer pieces alone (no model).

A decode peer owns a registered KV pool, a slot table and a readiness waiter; a prefill peer
owns a source pool filled with seeded random bytes and pushes it with `KVPusher`. Each runs in
its own process (multiprocessing, spawn) and is driven over a pipe by `PeerProcess.call`.
The acceptance tests and `benchmarks/transfer.py` use them to exercise the real
process-to-process paths (shared memory and TCP); they never import torch, so they start fast.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import random
import time
import traceback
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from pdserve_common.kv_layout import K, KVLayout, V
from pdserve_common.logs import kv, setup
from pdserve_worker.kv.slots import Grant

log = logging.getLogger("pdserve.transfer.peers")

SENTINEL = 0xEE  # a decode pool starts filled with this, so untouched bytes are recognisable


class PeerError(RuntimeError):
    """A command failed inside the peer; `kind` is the exception class name there."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


def crc(addr: int, length: int) -> int:
    return zlib.crc32(memoryview((ctypes.c_char * length).from_address(addr)))


def untouched_beyond(base_addr: int, layout: KVLayout, slot: int, num_tokens: int) -> bool:
    """Whether every byte of a slot past its first num_tokens tokens still holds SENTINEL."""
    for layer in layout.layer_range:
        for kv_index in (K, V):
            offset, length = layout.token_run(slot, layer, kv_index, layout.max_len - num_tokens, num_tokens)
            if length and (ctypes.c_char * length).from_address(base_addr + offset).raw.strip(bytes([SENTINEL])):
                return False
    return True


def run_checksums(base_addr: int, layout: KVLayout, slot: int, num_tokens: int) -> dict[str, int]:
    """CRC of every (layer, K|V) run of a slot's first num_tokens tokens, keyed "layer/kv"."""
    out = {}
    for layer in layout.layer_range:
        for kv_index in (K, V):
            offset, length = layout.token_run(slot, layer, kv_index, num_tokens)
            out[f"{layer}/{kv_index}"] = crc(base_addr + offset, length)
    return out


# ---- the driver side ---------------------------------------------------------------------------------
@dataclass
class PeerProcess:
    """A peer running in a child process. `info` is what it reported once set up."""

    process: Any
    conn: Connection
    info: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def start(
        cls, main: Callable[[Connection, dict[str, Any]], None], config: dict[str, Any], wait_s: float = 60
    ) -> PeerProcess:
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        process = ctx.Process(target=main, args=(child, config), daemon=True)
        process.start()
        child.close()
        peer = cls(process, parent)
        peer.info = peer.result(wait_s)
        return peer

    def send(self, command: str, **kwargs: Any) -> None:
        self.conn.send((command, kwargs))

    def result(self, wait_s: float = 60) -> Any:
        """The answer to the last command sent (raises PeerError if it failed there)."""
        if not self.conn.poll(wait_s):
            raise TimeoutError(f"peer pid={self.process.pid} gave no answer in {wait_s}s")
        ok, value = self.conn.recv()
        if not ok:
            raise PeerError(*value)
        return value

    def call(self, command: str, *, wait_s: float = 60, **kwargs: Any) -> Any:
        """Run a command in the peer and return its answer; kwargs are the command's own."""
        self.send(command, **kwargs)
        return self.result(wait_s)

    def stop(self, wait_s: float = 10) -> None:
        """Ask it to finalize and exit; kill it (this process's own child) if it does not."""
        if self.process.is_alive():
            try:
                self.send("stop")
                self.process.join(wait_s)
            except (BrokenPipeError, OSError):
                pass
        if self.process.is_alive():
            self.process.kill()
            self.process.join(wait_s)
        self.conn.close()


# ---- the peer side -----------------------------------------------------------------------------------
def _serve(conn: Connection, handlers: dict[str, Callable[..., Any]], info: dict[str, Any]) -> None:
    conn.send((True, info))
    while True:
        try:
            command, kwargs = conn.recv()
        except EOFError:
            return
        if command == "stop":
            return
        try:
            conn.send((True, handlers[command](**kwargs)))
        except Exception as exc:
            log.debug(traceback.format_exc())
            conn.send((False, (type(exc).__name__, str(exc))))


def grant_to_dict(grant: Grant) -> dict[str, Any]:
    """A grant as the peers' pipe carries it (plain values: tests read and forge its fields)."""
    return {
        "request_id": grant.request_id,
        "slot": grant.slot,
        "generation": grant.generation,
        "engine_id": grant.engine_id,
        "base_addr": grant.base_addr,
        "layout": grant.layout.to_dict(),
        "nonce": grant.nonce,
    }


def grant_from_dict(data: dict[str, Any]) -> Grant:
    layout = data["layout"]
    return Grant(
        request_id=str(data["request_id"]),
        slot=int(data["slot"]),
        generation=int(data["generation"]),
        engine_id=str(data["engine_id"]),
        base_addr=int(data["base_addr"]),
        layout=layout if isinstance(layout, KVLayout) else KVLayout.from_dict(layout),
        nonce=str(data.get("nonce", "")),
    )


def decode_main(conn: Connection, config: dict[str, Any]) -> None:
    """config: engine_id, layout (dict), options, mode, poll_interval_us, quarantine_s, warmup,
    check_nonce (default True: a ready notify counts only with its grant's nonce), backend
    (default "cpu", the host engine; "two-sided" for the gloo baseline)."""
    setup(f"decode-peer-{os.getpid()}", config.get("log_level"))
    from pdserve_worker.kv.slots import SlotTable
    from pdserve_worker.transfer.leases import SlotWriteLeases
    from pdserve_worker.transfer.pool import KVPool
    from pdserve_worker.transfer.readiness import Readiness
    from pdserve_worker.transfer.registry import create_engine

    backend = create_engine(config.get("backend", "cpu"))
    backend.check(backend.engine.initialize(config["engine_id"], config.get("options", {})), "initialize")
    layout = KVLayout.from_dict(config["layout"])
    pool = KVPool(backend, layout)
    ctypes.memset(pool.base_addr, SENTINEL, pool.nbytes)
    # As a decode worker does it: reserved slots leased (what counts with `pdserve.RemoteWrite=
    # leased`), and a ready notify filed only with its grant's nonce.
    slots = SlotTable(
        layout,
        engine_id=config["engine_id"],
        base_addr=pool.base_addr,
        quarantine_s=config.get("quarantine_s", 30.0),
        leases=SlotWriteLeases(backend, pool.base_addr, layout),
    )
    readiness = Readiness(
        backend,
        config.get("mode", "interrupt"),
        accepts=slots.is_reserved,
        authorize=slots.verify if config.get("check_nonce", True) else None,
        poll_interval_us=config.get("poll_interval_us", 100),
        warmup=pool.warm if config.get("warmup") else None,
    )

    def wait(slot: int, generation: int, timeout_s: float) -> dict[str, Any]:
        message = readiness.wait(slot, generation, timeout_s)
        return {"message": message, "woke_ns": time.perf_counter_ns()}

    def wait_all(grants: list[tuple[int, int]], timeout_s: float) -> list[dict[str, Any]]:
        """Wait for many grants at once, one thread each (as a decode's requests do): each
        one's ready message and the perf_counter_ns (a system-wide clock) it woke at."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max(1, len(grants))) as waiters:
            futures = [waiters.submit(wait, slot, generation, timeout_s) for slot, generation in grants]
            return [f.result() for f in futures]

    def wait_cpu(slot: int, generation: int, seconds: float) -> dict[str, float]:
        """CPU seconds this whole process burns while one request waits `seconds` for nothing."""
        cpu0, wall0 = time.process_time(), time.perf_counter()
        try:
            readiness.wait(slot, generation, seconds)
        except TimeoutError:
            pass
        return {"cpu_s": time.process_time() - cpu0, "wall_s": time.perf_counter() - wall0}

    def release(slot: int, generation: int) -> bool:
        released = slots.release(slot, generation)
        if released:
            readiness.forget(slot)
        return released

    handlers: dict[str, Callable[..., Any]] = {
        "reserve": lambda request_id, ttl_s: grant_to_dict(slots.reserve(request_id, ttl_s)),
        "wait": wait,
        "wait_all": wait_all,
        "wait_cpu": wait_cpu,
        "commit": slots.commit,
        "release": release,
        "expire": lambda: [grant_to_dict(g) for g in slots.expire()],
        "state": lambda slot: slots.state(slot).value,
        "checksums": lambda slot, num_tokens: run_checksums(pool.base_addr, layout, slot, num_tokens),
        "slot_crc": lambda slot: crc(pool.base_addr + layout.slot_span(slot)[0], layout.bytes_per_slot),
        "untouched_beyond": lambda slot, num_tokens: untouched_beyond(pool.base_addr, layout, slot, num_tokens),
        "copies": lambda: backend.engine.copy_stats(),  # type: ignore[attr-defined]
        "security": lambda: {
            **backend.engine.security_stats(),
            **{f"notify_{k}": v for k, v in readiness.drops.totals().items()},
        },
        "fill": lambda slot, byte: (
            ctypes.memset(pool.base_addr + layout.slot_span(slot)[0], byte, layout.bytes_per_slot) and None
        ),
    }
    try:
        _serve(conn, handlers, {"engine_id": config["engine_id"], "base_addr": pool.base_addr, "pid": os.getpid()})
    finally:
        pool.deregister()
        backend.engine.finalize()  # its server stops before the pool's memory goes
        pool.free()


def prefill_main(conn: Connection, config: dict[str, Any]) -> None:
    """config: engine_id (client-only is fine), layout (dict, the source pool), options, seed,
    backend (default "cpu")."""
    setup(f"prefill-peer-{os.getpid()}", config.get("log_level"))
    from pdserve_worker.transfer.pool import KVPool
    from pdserve_worker.transfer.push import KVPusher, PushSource, layer_chunks
    from pdserve_worker.transfer.registry import create_engine

    backend = create_engine(config.get("backend", "cpu"))
    backend.check(backend.engine.initialize(config["engine_id"], config.get("options", {})), "initialize")
    layout = KVLayout.from_dict(config["layout"])
    pool = KVPool(backend, layout)
    data = random.Random(config.get("seed", 0)).randbytes(pool.nbytes)
    ctypes.memmove(pool.base_addr, data, pool.nbytes)
    del data

    def push(
        targets: list[dict[str, Any]],
        num_tokens: int,
        layers_per_chunk: int = 4,
        queue_depth: int = 64,
        timeout_s: float = 10.0,
        delay_before_finish_s: float = 0.0,
        extra: dict[str, Any] | None = None,
        slot: int = 0,
    ) -> dict[str, Any]:
        pusher = KVPusher(
            backend,
            PushSource(pool.base_addr, layout, slot),
            [grant_from_dict(t) for t in targets],
            num_tokens,
            queue_depth=queue_depth,
            timeout_s=timeout_s,
        )
        try:
            for chunk in layer_chunks(layout.layer_range, layers_per_chunk):
                pusher.push_chunk(chunk)
            if delay_before_finish_s:
                time.sleep(delay_before_finish_s)  # a slow prefill: the decode's lease runs out
            stats = pusher.finish({"sent_ns": time.perf_counter_ns(), **(extra or {})})
        except BaseException:
            pusher.abort()
            raise
        log.info(kv(event="peer_pushed", targets=len(targets), bytes=stats.bytes, seconds=f"{stats.seconds:.6f}"))
        return {"puts": stats.puts, "bytes": stats.bytes, "seconds": stats.seconds, "requests": stats.requests}

    handlers: dict[str, Callable[..., Any]] = {
        "push": push,
        "checksums": lambda num_tokens, slot=0: run_checksums(pool.base_addr, layout, slot, num_tokens),
        "connect": lambda engine_id: backend.ensure_connected(engine_id, 5000),
        "disconnect": lambda engine_id: backend.engine.disconnect(engine_id, 1000),
        "link_path": lambda engine_id: backend.engine.link_path(engine_id),
        "copies": lambda: backend.engine.copy_stats(),  # type: ignore[attr-defined]
    }
    try:
        _serve(conn, handlers, {"engine_id": config["engine_id"], "base_addr": pool.base_addr, "pid": os.getpid()})
    finally:
        pool.close()
        backend.engine.finalize()
