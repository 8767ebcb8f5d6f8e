"""A push into a paged decode pool: over shared memory and TCP, into non-contiguous blocks, the
KV read through the block table equals the source, nothing else is written, shared blocks are
skipped, and with leased writes only the reservation's own blocks are writable."""

from __future__ import annotations

import ctypes
import json
import random
from collections.abc import Iterator

import pytest

from netutil import free_port
from pdserve_common.kv_layout import K, KVLayout, V
from pdserve_worker.kv.blocks import BlockTable
from pdserve_worker.kv.slots import Grant
from pdserve_worker.transfer.leases import BlockWriteLeases, LeaseTable
from pdserve_worker.transfer.pool import KVPool
from pdserve_worker.transfer.push import KVPusher, PushError, PushSource, layer_chunks
from pdserve_worker.transfer.registry import create_engine

LAYERS, BT, TOKENS = 4, 4, 13  # 13 tokens: 3 whole blocks and one partly used


def slot_layout(num_slots: int, max_len: int) -> KVLayout:
    return KVLayout(num_slots, LAYERS, max_len, kv_heads=2, head_dim=4, dtype="float16")


def paged_layout(num_blocks: int = 16) -> KVLayout:
    return KVLayout(8, LAYERS, 64, kv_heads=2, head_dim=4, dtype="float16", block_tokens=BT, num_blocks=num_blocks)


class PagedDecode:
    def __init__(self, options: dict[str, str] | None = None) -> None:
        self.backend = create_engine("cpu")
        self.engine_id = f"127.0.0.1:{free_port()}"
        self.backend.check(self.backend.engine.initialize(self.engine_id, options or {}), "initialize")
        self.pool = KVPool(self.backend, paged_layout())
        ctypes.memset(self.pool.base_addr, 0xEE, self.pool.nbytes)

    def grant(self, blocks: tuple[int, ...], shared: int = 0, slot: int = 0) -> Grant:
        return Grant(
            "req",
            slot,
            7,
            self.engine_id,
            self.pool.base_addr,
            self.pool.layout,
            nonce="n",
            blocks=blocks,
            shared=shared,
        )

    def token(self, blocks: tuple[int, ...], layer: int, kv_index: int, t: int) -> bytes:
        b = self.pool.layout.blocks
        offset = b.offset(layer, kv_index, blocks[t // BT]) + (t % BT) * b.bytes_per_token
        return ctypes.string_at(self.pool.base_addr + offset, b.bytes_per_token)

    def block_bytes(self, layer: int, kv_index: int, block: int) -> bytes:
        b = self.pool.layout.blocks
        return ctypes.string_at(self.pool.base_addr + b.offset(layer, kv_index, block), b.bytes_per_block)

    def close(self) -> None:
        self.pool.close()
        self.backend.engine.finalize()


class Prefill:
    def __init__(self, transport: str) -> None:
        self.backend = create_engine("cpu")
        self.backend.check(self.backend.engine.initialize("127.0.0.1", {"pdserve.Transport": transport}), "init")
        self.pool = KVPool(self.backend, slot_layout(1, 16))
        ctypes.memmove(self.pool.base_addr, random.Random(3).randbytes(self.pool.nbytes), self.pool.nbytes)
        self.source = PushSource(self.pool.base_addr, self.pool.layout)

    def token(self, layer: int, kv_index: int, t: int) -> bytes:
        addr, length = self.pool.run(0, layer, kv_index, 1, t)
        return ctypes.string_at(addr, length)

    def close(self) -> None:
        self.pool.close()
        self.backend.engine.finalize()


@pytest.fixture(params=["auto", "tcp"])
def prefill(request: pytest.FixtureRequest) -> Iterator[Prefill]:
    p = Prefill(request.param)
    yield p
    p.close()


@pytest.fixture
def decode() -> Iterator[PagedDecode]:
    d = PagedDecode()
    yield d
    d.close()


@pytest.mark.parametrize("shared", [0, 1])
def test_kv_lands_in_scattered_blocks_as_the_table_says(prefill: Prefill, decode: PagedDecode, shared: int) -> None:
    blocks = (9, 2, 3, 14)  # runs: [9], [2, 3], [14]
    pusher = KVPusher(prefill.backend, prefill.source, [decode.grant(blocks, shared)], TOKENS, queue_depth=4)
    for chunk in layer_chunks(range(LAYERS), 3):
        pusher.push_chunk(chunk)
    stats = pusher.finish({"first_token": 5})
    runs = 3 if not shared else 2  # the shared block [9] is not pushed
    assert stats.puts == LAYERS * 2 * runs
    assert stats.bytes == LAYERS * 2 * (TOKENS - shared * BT) * decode.pool.layout.bytes_per_token
    for layer in range(LAYERS):
        for kv_index in (K, V):
            for t in range(TOKENS):
                expected = b"\xee" * 16 if t < shared * BT else prefill.token(layer, kv_index, t)
                assert decode.token(blocks, layer, kv_index, t) == expected
            for t in range(TOKENS, len(blocks) * BT):  # the tail of the last block: untouched
                assert decode.token(blocks, layer, kv_index, t) == b"\xee" * 16
            for other in set(range(16)) - set(blocks):
                assert decode.block_bytes(layer, kv_index, other) == b"\xee" * BT * 16
    _, notes = decode.backend.engine.get_notifies()
    assert json.loads(notes[0].notify_msg)["num_tokens"] == TOKENS


def test_a_prompt_longer_than_its_blocks_is_refused(prefill: Prefill, decode: PagedDecode) -> None:
    with pytest.raises(ValueError, match="do not fit its 3 blocks"):
        KVPusher(prefill.backend, prefill.source, [decode.grant((1, 2, 3))], TOKENS)


def test_leased_writes_reach_only_the_reservations_own_blocks() -> None:
    """The decode's block table leases exactly its grant's writable blocks: a push into them
    lands; a grant forged with someone else's blocks is refused by the engine. (Over TCP, where
    the decode's server receives every write: a same-host peer that maps the pool is bounded by
    the service link's key instead, as for slots.)"""
    decode = PagedDecode({"pdserve.RemoteWrite": "leased"})
    prefill = Prefill("tcp")
    try:
        leases = BlockWriteLeases(decode.backend, decode.pool.base_addr, decode.pool.layout)
        table = BlockTable(
            decode.pool.layout, engine_id=decode.engine_id, base_addr=decode.pool.base_addr, leases=leases
        )
        first = table.reserve("a", 30, num_tokens=2 * BT)
        grant = table.reserve("b", 30, num_tokens=TOKENS)
        assert len(leases) == 2
        pusher = KVPusher(prefill.backend, prefill.source, [grant], TOKENS)
        pusher.push_chunk(range(LAYERS))
        pusher.finish()
        assert decode.token(grant.blocks, 0, K, 0) == prefill.token(0, K, 0)
        table.commit(grant.slot, grant.generation)  # the KV is in: its blocks are no longer writable
        forged = decode.grant(first.blocks + grant.blocks[:2])  # a's blocks are a's, not ours
        table.commit(first.slot, first.generation)
        pusher = KVPusher(prefill.backend, prefill.source, [forged], TOKENS)
        with pytest.raises(PushError):
            pusher.push_chunk(range(LAYERS))
            pusher.finish()
        assert len(leases) == 0
        assert decode.backend.host.security_stats()["write_leases"] == 0
    finally:
        prefill.close()
        decode.close()


def test_lease_table_finds_a_lease_among_many_and_refuses_overlaps() -> None:
    table = LeaseTable()
    ids = [table.grant(1000 + 100 * i, 50) for i in range(200)]
    assert table.covers(1000 + 100 * 137 + 10, 40)
    assert not table.covers(1000 + 100 * 137 + 10, 41)  # runs past its lease
    assert not table.covers(1000 + 100 * 137 + 60, 10)  # the gap between two leases
    assert not table.covers(999, 2)
    with pytest.raises(ValueError, match="overlaps"):
        table.grant(1000 + 100 * 5 + 49, 10)
    with pytest.raises(ValueError, match="overlaps"):
        table.grant(1000 + 100 * 5 - 1, 2)
    table.grant(1000 + 100 * 5 + 50, 50)  # exactly between two: fine
    assert table.revoke(ids[137]) and not table.covers(1000 + 100 * 137 + 10, 40)
    assert not table.revoke(ids[137])
    assert len(table) == 200


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_a_long_head_slice_lands_exactly_in_requests_of_bounded_size(transport: str) -> None:
    """A tensor-parallel rank holding heads 2..3 of a 4-head decode pool writes one 16-byte
    piece per token per (layer, K|V): 10,000 tokens make 40,000 of them per layer pair. They go
    in requests of at most MAX_REQUEST_DESCRIPTORS (over TCP a frame takes at most 65,536, and
    one oversized request would have cost the link), every piece lands in its row's slice, and
    the other rank's heads stay untouched."""
    from pdserve_worker.transfer.push import MAX_REQUEST_DESCRIPTORS

    layers, tokens, bt = 2, 10_000, 16
    src_layout = KVLayout(1, layers, tokens, kv_heads=2, head_dim=4, dtype="float16", first_head=2)
    dst_layout = KVLayout(
        1, layers, tokens, kv_heads=4, head_dim=4, dtype="float16", block_tokens=bt, num_blocks=tokens // bt
    )
    src_backend, dst_backend = create_engine("cpu"), create_engine("cpu")
    dst_id = f"127.0.0.1:{free_port()}"
    try:
        src_backend.check(src_backend.engine.initialize("127.0.0.1", {"pdserve.Transport": transport}), "init")
        dst_backend.check(dst_backend.engine.initialize(dst_id), "init")
        src, dst = KVPool(src_backend, src_layout), KVPool(dst_backend, dst_layout)
        ctypes.memmove(src.base_addr, random.Random(5).randbytes(src.nbytes), src.nbytes)
        ctypes.memset(dst.base_addr, 0xEE, dst.nbytes)
        blocks = tuple(reversed(range(tokens // bt)))  # nothing consecutive
        grant = Grant("req", 0, 1, dst_id, dst.base_addr, dst_layout, nonce="n", blocks=blocks)
        sizes: list[int] = []
        submit = src_backend.engine.transfer_async

        def recording(remote: str, op: int, descs: list[object], *args: object) -> tuple[int, int]:
            sizes.append(len(descs))
            return submit(remote, op, descs, *args)

        src_backend.engine.transfer_async = recording  # type: ignore[method-assign]
        pusher = KVPusher(src_backend, PushSource(src.base_addr, src_layout), [grant], tokens, queue_depth=8)
        pusher.push_chunk(range(layers))
        stats = pusher.finish({})
        assert stats.puts == sum(sizes) == layers * 2 * tokens
        assert max(sizes) <= MAX_REQUEST_DESCRIPTORS and len(sizes) >= layers * 2 * tokens // MAX_REQUEST_DESCRIPTORS
        geometry, row, half = dst_layout.blocks, dst_layout.blocks.bytes_per_token, src_layout.bytes_per_token
        for layer in range(layers):
            for kv_index in (K, V):
                sent = ctypes.string_at(*src.run(0, layer, kv_index, tokens))
                for t in range(0, tokens, 997):  # a spread of tokens, each in its block
                    at = dst.base_addr + geometry.offset(layer, kv_index, blocks[t // bt]) + (t % bt) * row
                    assert ctypes.string_at(at + half, half) == sent[t * half : (t + 1) * half]
                    assert ctypes.string_at(at, half) == b"\xee" * half  # heads 0..1: the other rank's
        src.close()
        dst.close()
    finally:
        src_backend.engine.finalize()
        dst_backend.engine.finalize()
