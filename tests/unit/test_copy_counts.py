"""Bytes copied per push, per memory pass, as each transport's own counters report them.

Seed 002's claim in numbers: a one-sided put over shared memory moves the KV bytes once (the
prefill's memmove into the decode's memory; the decode's CPU does nothing), while the
two-sided gloo baseline moves them at least twice more on the receiver (socket into staging,
staging into the KV blocks). The host engine's TCP path sits between: a send and a receive
straight into place, no staging copy. Both engines of a pair run in this process; the
counters are the engines' own (transfer/copy_counts.py), read after a real `KVPusher` push.
"""

from __future__ import annotations

import ctypes
import random
from collections.abc import Iterator

import pytest

from netutil import free_port
from pdserve_common.kv_layout import KVLayout
from pdserve_worker.kv.slots import SlotTable
from pdserve_worker.transfer import hixl_api as api
from pdserve_worker.transfer.base import TransferBackend
from pdserve_worker.transfer.copy_counts import CopyCounts
from pdserve_worker.transfer.pool import KVPool
from pdserve_worker.transfer.push import KVPusher, PushSource, layer_chunks
from pdserve_worker.transfer.readiness import Readiness
from pdserve_worker.transfer.registry import create_engine

LAYOUT = dict(num_layers=4, max_len=64, kv_heads=2, head_dim=16, dtype="bfloat16")
TOKENS = 50


def _engine(name: str, engine_id: str, options: dict[str, str] | None = None) -> TransferBackend:
    backend = create_engine(name)  # type: ignore[arg-type]
    backend.check(backend.engine.initialize(engine_id, options or {}), f"initialize {engine_id}")
    return backend


class Link:
    """A decode engine with a pool and slot table, and a prefill engine with a filled source."""

    def __init__(self, backend: str, transport: str = "auto") -> None:
        self.decode = _engine(backend, f"127.0.0.1:{free_port()}")
        self.prefill = _engine(backend, "127.0.0.1", {"pdserve.Transport": transport} if backend == "cpu" else {})
        self.dst = KVPool(self.decode, KVLayout(num_slots=2, **LAYOUT))
        self.src = KVPool(self.prefill, KVLayout(num_slots=1, **LAYOUT))
        data = random.Random(7).randbytes(self.src.nbytes)
        ctypes.memmove(self.src.base_addr, data, self.src.nbytes)
        self.slots = SlotTable(self.dst.layout, engine_id=self.decode.engine.engine_id, base_addr=self.dst.base_addr)  # type: ignore[attr-defined]
        self.readiness = Readiness(
            self.decode, "interrupt", accepts=self.slots.is_reserved, authorize=self.slots.verify
        )

    def push(self) -> tuple[int, dict[str, int], dict[str, int]]:
        """One prompt of TOKENS tokens into a fresh slot: (KV bytes, prefill's passes, decode's)."""
        before_p, before_d = self.prefill.engine.copy_stats(), self.decode.engine.copy_stats()  # type: ignore[attr-defined]
        grant = self.slots.reserve("r", 30)
        pusher = KVPusher(self.prefill, PushSource(self.src.base_addr, self.src.layout), [grant], TOKENS)
        for chunk in layer_chunks(self.src.layout.layer_range, 2):
            pusher.push_chunk(chunk)
        stats = pusher.finish()
        message = self.readiness.wait(grant.slot, grant.generation, 10)
        assert message["num_tokens"] == TOKENS
        for layer in self.src.layout.layer_range:  # and the bytes are the source's
            for kv_index in (0, 1):
                s_addr, n = self.src.run(0, layer, kv_index, TOKENS)
                d_addr, _ = self.dst.run(grant.slot, layer, kv_index, TOKENS)
                assert ctypes.string_at(s_addr, n) == ctypes.string_at(d_addr, n)
        self.slots.release(grant.slot, grant.generation)
        after_p, after_d = self.prefill.engine.copy_stats(), self.decode.engine.copy_stats()  # type: ignore[attr-defined]
        return (
            stats.bytes,
            {k: after_p[k] - before_p[k] for k in after_p},
            {k: after_d[k] - before_d[k] for k in after_d},
        )

    def close(self) -> None:
        for backend, pool in ((self.prefill, self.src), (self.decode, self.dst)):
            pool.deregister()
            backend.engine.finalize()
            pool.free()


@pytest.fixture
def link(request: pytest.FixtureRequest) -> Iterator[Link]:
    made = Link(*request.param)
    yield made
    made.close()


@pytest.mark.parametrize("link", [("cpu", "auto")], indirect=True)
def test_a_one_sided_shared_memory_push_copies_the_kv_bytes_once(link: Link) -> None:
    kv_bytes, prefill, decode = link.push()
    assert kv_bytes == 4 * 2 * TOKENS * 2 * 16 * 2
    assert prefill == {"memmove": kv_bytes, "socket_send": 0, "socket_recv": 0, "staging_copy": 0}
    assert sum(decode.values()) == 0  # the decode's CPU took no part


@pytest.mark.parametrize("link", [("cpu", "tcp")], indirect=True)
def test_a_one_sided_tcp_push_is_received_straight_into_place(link: Link) -> None:
    kv_bytes, prefill, decode = link.push()
    assert prefill["socket_send"] == kv_bytes and prefill["memmove"] == 0
    assert decode["socket_recv"] == kv_bytes and decode["staging_copy"] == 0


@pytest.mark.parametrize("link", [("two-sided",)], indirect=True)
def test_a_two_sided_push_copies_the_kv_bytes_at_least_twice_more_on_the_receiver(link: Link) -> None:
    kv_bytes, prefill, decode = link.push()
    assert prefill["socket_send"] == kv_bytes and prefill["memmove"] == 0
    assert decode["socket_recv"] == kv_bytes and decode["staging_copy"] == kv_bytes
    assert sum(prefill.values()) + sum(decode.values()) >= 2 * kv_bytes
    kv_again, _, decode_again = link.push()  # the staging buffer is reused, the counts add up
    assert decode_again["staging_copy"] == kv_again == kv_bytes


@pytest.mark.parametrize("link", [("two-sided",)], indirect=True)
def test_a_two_sided_write_outside_the_receivers_registered_memory_is_refused(link: Link) -> None:
    engine, remote = link.prefill.engine, link.decode.engine.engine_id  # type: ignore[attr-defined]
    link.prefill.ensure_connected(remote, 5000)
    outside = link.dst.base_addr + link.dst.nbytes  # just past the decode's pool
    desc = api.TransferOpDesc(link.src.base_addr, outside, 64)
    status, req = engine.transfer_async(remote, api.TransferOp.WRITE, [desc])
    assert status == api.SUCCESS
    assert engine.wait_transfer(req, 10) == api.SUCCESS
    assert engine.get_transfer_status(req) == (api.SUCCESS, api.TransferStatus.FAILED)
    assert link.decode.engine.refused == 1  # type: ignore[attr-defined]
    # An unregistered local source is refused before anything is sent; READ is not offered.
    bad_local = api.TransferOpDesc(link.src.base_addr + link.src.nbytes, link.dst.base_addr, 64)
    assert engine.transfer_async(remote, api.TransferOp.WRITE, [bad_local])[0] == api.PARAM_INVALID
    assert engine.transfer_async(remote, api.TransferOp.READ, [desc])[0] == api.UNSUPPORTED
    kv_bytes, _, _ = link.push()  # the pair still works after a refusal
    assert kv_bytes > 0


def test_the_two_sided_engine_listens_and_connects_on_loopback_only() -> None:
    engine = create_engine("two-sided").engine
    assert engine.initialize("192.0.2.1:5000") == api.PARAM_INVALID  # TEST-NET-1: never contacted
    assert engine.initialize("127.0.0.1") == api.SUCCESS
    assert engine.connect("192.0.2.1:5000", 100) == api.PARAM_INVALID
    engine.finalize()


def test_copy_counts_refuse_an_unknown_pass() -> None:
    counts = CopyCounts()
    counts.add("memmove", 3)
    with pytest.raises(KeyError, match="unknown copy pass 'dma'"):
        counts.add("dma", 1)
    assert counts.snapshot()["memmove"] == counts.total() == 3
