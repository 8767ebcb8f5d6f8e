"""KV digests (transfer/digest.py) over real host engines: every pushed layer chunk carries one in
the ready message, the decode's check passes on what landed (slots, scattered and shared blocks,
head slices; shared memory and TCP), names the layers of a flipped byte (in the pool, or on the
wire through the fault proxy), refuses a ready without a digest by name, and checks nothing when
digests are off."""

from __future__ import annotations

import ctypes
import json
import random
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from netutil import free_port
from pdserve_common.kv_layout import K, KVLayout, V
from pdserve_worker.kv.slots import Grant
from pdserve_worker.transfer.base import FLETCHER64, XXH3_64
from pdserve_worker.transfer.digest import DIGEST_FIELD, KVDigestMismatch, KVDigestRefused, ReadyDigests
from pdserve_worker.transfer.pool import KVPool
from pdserve_worker.transfer.push import KVPusher, PushSource, layer_chunks
from pdserve_worker.transfer.readiness import Readiness
from pdserve_worker.transfer.registry import create_engine
from support.fault_proxy import FaultProxy

LAYERS, BT, TOKENS, HEADS = 6, 4, 13, 2


def _layout(paged: bool, heads: int = HEADS, first_head: int = 0, max_len: int = 64) -> KVLayout:
    extra: dict[str, Any] = dict(block_tokens=BT, num_blocks=16) if paged else {}
    return KVLayout(4, LAYERS, max_len, kv_heads=heads, head_dim=8, dtype="float16", first_head=first_head, **extra)


class Peer:
    def __init__(
        self, layout: KVLayout, engine_id: str, options: dict[str, str] | None = None, algorithm: str = XXH3_64
    ) -> None:
        self.backend = create_engine("cpu")
        self.backend.digest = algorithm  # FLETCHER64: HIXL's device-side sum, here over host tensors
        self.engine_id = engine_id
        self.backend.check(self.backend.engine.initialize(engine_id, options or {}), "initialize")
        self.pool = KVPool(self.backend, layout)
        ctypes.memmove(self.pool.base_addr, random.Random(engine_id).randbytes(self.pool.nbytes), self.pool.nbytes)

    def close(self) -> None:
        self.pool.close()
        self.backend.engine.finalize()


@pytest.fixture(params=[XXH3_64, FLETCHER64])
def algorithm(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def peers(request: pytest.FixtureRequest, algorithm: str) -> Iterator[tuple[Peer, Peer]]:
    transport, paged = getattr(request, "param", ("auto", True))
    decode = Peer(_layout(paged), f"127.0.0.1:{free_port()}", algorithm=algorithm)
    prefill = Peer(_layout(False), "127.0.0.1", {"pdserve.Transport": transport}, algorithm)
    yield prefill, decode
    prefill.close()
    decode.close()


def _grant(decode: Peer, engine_id: str | None = None, blocks: tuple[int, ...] = (), shared: int = 0) -> Grant:
    layout = decode.pool.layout
    return Grant("req", 1, 7, engine_id or decode.engine_id, decode.pool.base_addr, layout, "n", blocks, shared)


def _push(prefill: Peer, decode: Peer, grant: Grant, chunk: int = 4) -> dict[str, Any]:
    """Push TOKENS tokens in chunks of `chunk` layers; the ready message the decode took."""
    source = PushSource(prefill.pool.base_addr, prefill.pool.layout)
    pusher = KVPusher(prefill.backend, source, [grant], TOKENS, queue_depth=4)
    for layers in layer_chunks(range(LAYERS), chunk):
        pusher.push_chunk(layers)
    pusher.finish({"first_token": 5})
    return Readiness(decode.backend).wait(grant.slot, grant.generation, 10.0)


def _checker(decode: Peer, grant: Grant, algorithm: str | None = "") -> ReadyDigests:
    """The decode's check ("": the algorithm its backend declares)."""
    chosen = decode.backend.digest if algorithm == "" else algorithm
    return ReadyDigests(chosen, decode.pool.base_addr, decode.pool.layout, lambda s, g: grant)


@pytest.mark.parametrize("peers", [("auto", True), ("tcp", True), ("auto", False), ("tcp", False)], indirect=True)
def test_each_chunk_carries_a_digest_that_the_landed_bytes_match(peers: tuple[Peer, Peer]) -> None:
    prefill, decode = peers
    paged = decode.pool.layout.paged
    grant = _grant(decode, blocks=(9, 2, 3, 14) if paged else ())
    message = _push(prefill, decode, grant, chunk=4)
    field = message[DIGEST_FIELD]
    assert field["alg"] == decode.backend.digest and field["heads"] == [0, HEADS]
    assert field["ends"] == [4, 6] and len(field["sums"]) == 2  # one per layer chunk
    checked = _checker(decode, grant).check(grant.slot, grant.generation, message)
    assert checked == LAYERS * 2 * TOKENS * decode.pool.layout.bytes_per_token
    if not paged:  # a group follower's check, without a slot table: the same bytes
        follower = ReadyDigests(decode.backend.digest, decode.pool.base_addr, decode.pool.layout, None)
        assert follower.check(grant.slot, grant.generation, message) == checked
    else:
        with pytest.raises(ValueError, match="need its block table"):
            ReadyDigests(decode.backend.digest, decode.pool.base_addr, decode.pool.layout, None)


def test_a_flipped_byte_in_the_pool_is_named_by_its_layers(peers: tuple[Peer, Peer]) -> None:
    prefill, decode = peers
    grant = _grant(decode, blocks=(9, 2, 3, 14))
    message = _push(prefill, decode, grant, chunk=2)
    layout = decode.pool.layout.blocks
    addr = decode.pool.base_addr + layout.offset(3, V, 3) + 5  # layer 3's V, token 9: chunk 2..3
    ctypes.memset(addr, ctypes.c_ubyte.from_address(addr).value ^ 1, 1)
    with pytest.raises(KVDigestMismatch, match="layers 2..3 .* slot 1 generation 7"):
        _checker(decode, grant).check(grant.slot, grant.generation, message)


def test_shared_blocks_and_a_head_slice_are_checked_as_pushed(algorithm: str) -> None:
    """A TP rank's heads 1..1 into a paged pool of heads 0..1 whose first block is shared: the
    digest covers exactly the pushed heads of the pushed tokens; the other head may hold anything."""
    decode = Peer(_layout(True), f"127.0.0.1:{free_port()}", algorithm=algorithm)
    prefill = Peer(_layout(False, heads=1, first_head=1), "127.0.0.1", {"pdserve.Transport": "tcp"}, algorithm)
    try:
        grant = _grant(decode, blocks=(5, 1, 2, 11), shared=1)
        message = _push(prefill, decode, grant, chunk=3)
        assert message[DIGEST_FIELD]["heads"] == [1, 2]
        checker = _checker(decode, grant)
        assert checker.check(1, 7, message) == LAYERS * 2 * (TOKENS - BT) * 16  # 1 head x 8 x fp16
        layout = decode.pool.layout.blocks
        ctypes.memset(decode.pool.base_addr + layout.offset(0, K, 1), 0, 16)  # head 0 of token 4: not pushed
        ctypes.memset(decode.pool.base_addr + layout.offset(0, K, 5), 0, 64)  # the shared block: not pushed
        assert checker.check(1, 7, message) > 0
        ctypes.memset(decode.pool.base_addr + layout.offset(0, K, 1) + 16, 0, 1)  # head 1 of token 4
        with pytest.raises(KVDigestMismatch, match="layers 0..2 \\(heads 1..1\\)"):
            checker.check(1, 7, message)
    finally:
        prefill.close()
        decode.close()


def test_a_ready_without_a_digest_is_refused_by_name_and_nothing_is_checked_when_off(
    peers: tuple[Peer, Peer],
) -> None:
    prefill, decode = peers
    grant = _grant(decode, blocks=(1, 2, 3, 4))
    prefill.backend.digest = None  # a prefill with digests off (or from before them)
    message = _push(prefill, decode, grant)
    assert DIGEST_FIELD not in message
    with pytest.raises(KVDigestRefused, match="carries no 'kv_digest'"):
        _checker(decode, grant).check(1, 7, message)
    assert _checker(decode, grant, None).check(1, 7, message) == 0


@pytest.mark.parametrize(
    "change",
    [
        {"alg": "crc32"},
        {"heads": [0, 9]},
        {"ends": [6, 4]},
        {"ends": [4, 7]},
        {"first": 4},
        {"first": None},
        {"sums": ["zz" * 8, "00" * 8]},
        {"sums": ["0" * 16]},
    ],
)
def test_an_unusable_digest_is_refused_naming_what_is_wrong(peers: tuple[Peer, Peer], change: dict[str, Any]) -> None:
    prefill, decode = peers
    grant = _grant(decode, blocks=(1, 2, 3, 4))
    message = _push(prefill, decode, grant)
    message[DIGEST_FIELD] = {**message[DIGEST_FIELD], **change}
    with pytest.raises(KVDigestRefused, match="'kv_digest' of the ready message of slot 1 generation 7 is unusable"):
        _checker(decode, grant).check(1, 7, message)


def test_a_long_ready_message_carries_the_last_digest_only(peers: tuple[Peer, Peer]) -> None:
    """One chunk per layer and a ready message near HIXL's 1,024 characters: the last running
    digest alone still covers every byte."""
    prefill, decode = peers
    grant = _grant(decode, blocks=(1, 2, 3, 4))
    pusher = KVPusher(prefill.backend, PushSource(prefill.pool.base_addr, prefill.pool.layout), [grant], TOKENS)
    for layers in layer_chunks(range(LAYERS), 1):
        pusher.push_chunk(layers)
    pusher.finish({"pad": "x" * 800})
    message = Readiness(decode.backend).wait(1, 7, 10.0)
    assert message[DIGEST_FIELD]["ends"] == [LAYERS]
    assert _checker(decode, grant).check(1, 7, message) > 0


def test_a_byte_flipped_on_the_wire_is_caught_before_the_ready_message_is_returned(algorithm: str) -> None:
    """The prefill pushes over TCP through the fault proxy, which inverts one byte of KV payload:
    TCP delivers it, the push succeeds, and the decode's readiness raises the mismatch instead
    of returning the message. Without the flip the same road passes."""
    decode_port = free_port()
    decode = Peer(_layout(True), f"127.0.0.1:{decode_port}", algorithm=algorithm)
    prefill = Peer(_layout(False, max_len=4096), "127.0.0.1", {"pdserve.Transport": "tcp"}, algorithm)
    try:
        with FaultProxy() as proxy:
            host, port = proxy.link("decode", ("127.0.0.1", 0), ("127.0.0.1", decode_port))
            readiness = Readiness(decode.backend)
            for flips in (0, 1):
                proxy.flip("decode", flips, min_read=4096)
                blocks = tuple(range(16))
                grant = replace(_grant(decode, f"{host}:{port}", blocks), slot=flips)
                readiness.check = _checker(decode, grant).check
                pusher = KVPusher(prefill.backend, PushSource(prefill.pool.base_addr, prefill.pool.layout), [grant], 64)
                for layers in layer_chunks(range(LAYERS), 2):
                    pusher.push_chunk(layers)
                pusher.finish()
                if flips:
                    with pytest.raises(KVDigestMismatch, match="does not match its digest"):
                        readiness.wait(grant.slot, 7, 10.0)
                else:
                    assert json.loads(json.dumps(readiness.wait(grant.slot, 7, 10.0)))["num_tokens"] == 64
            assert proxy.counters()["decode"]["flipped"] == 1
    finally:
        prefill.close()
        decode.close()


def test_a_notify_for_layers_others_pushed_checks_only_what_its_sender_put() -> None:
    """A group migration's leader holds layers 0..2 and notifies a target member of layers 0..5,
    whose layers 3..5 another member pushed (without a notify): the digest covers 0..2 only,
    and a notify to a target holding none of the sender's layers carries an empty one."""
    from pdserve_worker.decode.migration import MigrationPusher

    decode = Peer(_layout(True), f"127.0.0.1:{free_port()}")
    half = KVLayout(1, 3, 64, kv_heads=HEADS, head_dim=8, dtype="float16", block_tokens=BT, num_blocks=16)
    prefill = Peer(half, "127.0.0.1", {"pdserve.Transport": "tcp"})
    try:
        grant = _grant(decode, blocks=(1, 2, 3, 4))
        source = PushSource(prefill.pool.base_addr, half)
        pusher = MigrationPusher(prefill.backend, source, (5, 6, 7, 8), [grant], TOKENS)
        pusher.push_chunk(range(0, 2))
        pusher.push_chunk(range(2, 3))
        pusher.finish({"first_token": 5})
        message = Readiness(decode.backend).wait(1, 7, 10.0)
        assert message[DIGEST_FIELD]["first"] == 0 and message[DIGEST_FIELD]["ends"] == [2, 3]
        assert _checker(decode, grant).check(1, 7, message) == 3 * 2 * TOKENS * 32
        empty = {**message, DIGEST_FIELD: {**message[DIGEST_FIELD], "ends": [], "sums": []}}
        assert _checker(decode, grant).check(1, 7, empty) == 0
    finally:
        prefill.close()
        decode.close()


def test_the_host_digest_is_the_hash_of_the_bytes_however_they_are_cut() -> None:
    """Contiguous ranges merge, scattered ones and strided head slices do not change the stream:
    the digest is XXH3-64 of the bytes in the order fed."""
    import xxhash

    from pdserve_worker.transfer.digest import HostDigest

    buf = ctypes.create_string_buffer(random.Random(1).randbytes(4096), 4096)
    base = ctypes.addressof(buf)
    digest = HostDigest()
    digest.update(base, 1, 0, 100)
    digest.update(base + 100, 2, 50, 50)  # continues the first: merged
    digest.update(base + 1000, 1, 0, 24)  # a jump
    digest.update(base + 2000, 4, 64, 16)  # a head slice: 16 of every 64 bytes
    expected = buf.raw[:200] + buf.raw[1000:1024] + b"".join(buf.raw[2000 + 64 * i : 2016 + 64 * i] for i in range(4))
    assert digest.intdigest() == xxhash.xxh3_64_intdigest(expected) and digest.bytes == len(expected)
    digest.update(base + 3000, 1, 0, 8)  # it goes on after a snapshot
    assert digest.intdigest() == xxhash.xxh3_64_intdigest(expected + buf.raw[3000:3008])


def _fletcher(data: bytes) -> int:
    """FLETCHER64 by its definition (device_digest.py): A = sum x_i, B = sum (N - i) x_i, mod 2^31 - 1."""
    n, p = len(data), (1 << 31) - 1
    a = sum(data) % p
    b = sum((n - i) * x for i, x in enumerate(data)) % p
    return (a << 32) | b


def test_the_device_digest_is_fletchers_two_sums_however_the_bytes_are_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    """TensorDigest over a registered pool tensor equals the definition over the bytes in the
    order fed: contiguous ranges, a head slice's strided rows, ranges longer than one reduction
    piece; one changed byte changes it; an address in no registered pool is refused by name."""
    import torch

    from pdserve_worker.transfer import device_digest

    monkeypatch.setattr(device_digest, "PIECE", 64)  # several pieces per range, and a partial one
    monkeypatch.setattr(device_digest, "_weights", {})
    pool = torch.frombuffer(bytearray(random.Random(2).randbytes(4096)), dtype=torch.uint8).view(torch.float16)
    raw = pool.view(torch.uint8).numpy().tobytes()
    base = pool.data_ptr()
    device_digest.register(pool)
    try:
        digest = device_digest.TensorDigest()
        digest.update(base, 1, 0, 300)
        digest.update(base + 2000, 4, 64, 16)  # a head slice: 16 of every 64 bytes
        expected = raw[:300] + b"".join(raw[2000 + 64 * i : 2016 + 64 * i] for i in range(4))
        assert digest.intdigest() == _fletcher(expected) and digest.bytes == len(expected)
        digest.update(base + 3000, 1, 0, 200)  # it goes on after a snapshot
        assert digest.intdigest() == _fletcher(expected + raw[3000:3200])
        flipped = bytearray(expected + raw[3000:3200])
        flipped[123] ^= 0x10
        assert _fletcher(bytes(flipped)) != digest.intdigest()
        with pytest.raises(ValueError, match="no KV pool registered for the digest holds 8 bytes at"):
            digest.update(base + 4092, 1, 0, 8)  # runs past the pool's end
    finally:
        device_digest.unregister(pool)
    with pytest.raises(ValueError, match="no KV pool registered"):
        device_digest.TensorDigest().update(base, 1, 0, 8)
