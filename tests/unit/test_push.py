"""KVPusher: exactly the owned layers, only the prompt's tokens, bounded in flight, clear errors."""

from __future__ import annotations

import ctypes
import json
import random
from collections.abc import Iterator
from typing import Any

import pytest

from netutil import free_port
from pdserve_common.kv_layout import K, KVLayout, V
from pdserve_worker.kv.slots import Grant
from pdserve_worker.transfer.base import TransferBackend
from pdserve_worker.transfer.pool import KVPool
from pdserve_worker.transfer.push import KVPusher, PushError, PushSource, layer_chunks, prefill_and_push
from pdserve_worker.transfer.registry import create_engine

LAYERS = 6
TOKENS = 5


def layout(num_slots: int, max_len: int, first_layer: int = 0, num_layers: int = LAYERS) -> KVLayout:
    return KVLayout(num_slots, num_layers, max_len, kv_heads=2, head_dim=4, dtype="float16", first_layer=first_layer)


class Decode:
    """A decode member: a listening engine and a registered pool filled with 0xEE."""

    def __init__(self, lay: KVLayout) -> None:
        self.backend = create_engine("cpu")
        self.engine_id = f"127.0.0.1:{free_port()}"
        self.backend.check(self.backend.engine.initialize(self.engine_id), "initialize")
        self.pool = KVPool(self.backend, lay)
        ctypes.memset(self.pool.base_addr, 0xEE, self.pool.nbytes)

    def target(self, slot: int, generation: int = 1, request_id: str = "req") -> Grant:
        return Grant(
            request_id,
            slot,
            generation,
            self.engine_id,
            self.pool.base_addr,
            self.pool.layout,
            nonce=f"nonce-{slot}-{generation}",
        )

    def run(self, slot: int, layer: int, kv_index: int, n: int, start: int = 0) -> bytes:
        addr, length = self.pool.run(slot, layer, kv_index, n, start)
        return ctypes.string_at(addr, length)

    def close(self) -> None:
        self.pool.close()
        self.backend.engine.finalize()


class Prefill:
    def __init__(self, options: dict[str, str] | None = None) -> None:
        self.backend = create_engine("cpu")
        self.backend.check(self.backend.engine.initialize("127.0.0.1", options or {}), "initialize")
        self.pool = KVPool(self.backend, layout(1, TOKENS + 3))
        data = random.Random(7).randbytes(self.pool.nbytes)
        ctypes.memmove(self.pool.base_addr, data, self.pool.nbytes)
        self.source = PushSource(self.pool.base_addr, self.pool.layout)

    def run(self, layer: int, kv_index: int, n: int = TOKENS) -> bytes:
        addr, length = self.pool.run(0, layer, kv_index, n)
        return ctypes.string_at(addr, length)

    def close(self) -> None:
        self.pool.close()
        self.backend.engine.finalize()


@pytest.fixture(params=["auto", "tcp"])
def prefill(request: pytest.FixtureRequest) -> Iterator[Prefill]:
    p = Prefill({"pdserve.Transport": request.param})
    yield p
    p.close()


@pytest.fixture
def decodes() -> Iterator[list[Decode]]:
    made: list[Decode] = []
    yield made
    for d in made:
        d.close()


def test_each_target_gets_exactly_its_layers_and_only_the_prompt(prefill: Prefill, decodes: list[Decode]) -> None:
    full = Decode(layout(3, 16))
    low = Decode(layout(2, 16, first_layer=0, num_layers=3))
    high = Decode(layout(2, 16, first_layer=3, num_layers=3))
    decodes += [full, low, high]
    targets = [full.target(2), low.target(1), high.target(0)]
    pusher = KVPusher(prefill.backend, prefill.source, targets, TOKENS, queue_depth=8)
    for chunk in layer_chunks(range(LAYERS), 4):
        pusher.push_chunk(chunk)
    stats = pusher.finish({"first_token": 42})
    assert stats.puts == 2 * LAYERS * 2 and stats.bytes == stats.puts * TOKENS * 16
    for d, slot in ((full, 2), (low, 1), (high, 0)):
        for layer in d.pool.layout.layer_range:
            for kv_index in (K, V):
                assert d.run(slot, layer, kv_index, TOKENS) == prefill.run(layer, kv_index)
                assert d.run(slot, layer, kv_index, 16 - TOKENS, TOKENS) == b"\xee" * (16 - TOKENS) * 16
        for other in range(d.pool.layout.num_slots):
            if other != slot:
                assert d.run(other, d.pool.layout.first_layer, K, 16) == b"\xee" * 256
        status, notes = d.backend.engine.get_notifies()
        assert [n.name for n in notes] == ["kv_ready"]
        message = json.loads(notes[0].notify_msg)
        digest = message.pop("kv_digest")  # one per layer chunk of the target's (test_kv_digest.py)
        assert digest["ends"] == {2: [4, 6], 1: [3], 0: [4, 6]}[slot]  # chunks 0..3 and 4..5, cut to its layers
        assert message == {
            "request_id": "req",
            "slot": slot,
            "generation": 1,
            "nonce": f"nonce-{slot}-1",  # the grant's capability travels with the notify
            "num_tokens": TOKENS,
            "first_token": 42,
        }


class Recording:
    """Wraps a real engine and records how many runs are in flight per remote at any time."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._runs: dict[int, tuple[str, int]] = {}
        self.in_flight: dict[str, int] = {}
        self.peak: dict[str, int] = {}

    def transfer_async(self, remote: str, op: int, descs: list[Any], *args: Any) -> tuple[int, int]:
        status, req = self._engine.transfer_async(remote, op, descs, *args)
        if status == 0:
            self._runs[req] = (remote, len(descs))
            self.in_flight[remote] = self.in_flight.get(remote, 0) + len(descs)
            self.peak[remote] = max(self.peak.get(remote, 0), self.in_flight[remote])
        return status, req

    def get_transfer_status(self, req: int) -> Any:
        status, state = self._engine.get_transfer_status(req)
        if state != 0 and req in self._runs:  # not WAITING: terminal, reported once
            remote, n = self._runs.pop(req)
            self.in_flight[remote] -= n
        return status, state

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def test_queue_depth_bounds_runs_in_flight_per_target(decodes: list[Decode]) -> None:
    prefill = Prefill({"pdserve.Transport": "tcp"})
    try:
        a, b = Decode(layout(1, 16)), Decode(layout(1, 16))
        decodes += [a, b]
        recording = Recording(prefill.backend.engine)
        backend = TransferBackend("cpu", recording, prefill.backend.api)
        pusher = KVPusher(backend, prefill.source, [a.target(0), b.target(0)], TOKENS, queue_depth=3)
        pusher.push_chunk(range(LAYERS))  # 12 runs per target, at most 3 in flight
        pusher.finish()
        assert recording.peak == {a.engine_id: 3, b.engine_id: 3}
        assert pusher.stats.depth_waits > 0
        assert all(a.run(0, layer, V, TOKENS) == prefill.run(layer, V) for layer in range(LAYERS))
    finally:
        prefill.close()


def test_resource_exhausted_is_waited_out(decodes: list[Decode]) -> None:
    prefill = Prefill({"pdserve.MaxOutstandingTransfers": "1", "pdserve.Transport": "tcp"})
    try:
        targets = []
        for _ in range(3):
            decodes.append(Decode(layout(1, 16)))
            targets.append(decodes[-1].target(0))
        pusher = KVPusher(prefill.backend, prefill.source, targets, TOKENS, queue_depth=2)
        for chunk in layer_chunks(range(LAYERS), 2):
            pusher.push_chunk(chunk)
        pusher.finish()
        assert pusher.stats.resource_exhausted > 0
        for d in decodes:
            assert d.run(0, LAYERS - 1, K, TOKENS) == prefill.run(LAYERS - 1, K)
    finally:
        prefill.close()


def test_a_failed_put_names_target_and_layers(decodes: list[Decode]) -> None:
    prefill = Prefill({"pdserve.Transport": "tcp"})
    try:
        d = Decode(layout(1, 16))
        decodes.append(d)
        pusher = KVPusher(prefill.backend, prefill.source, [d.target(0, generation=9)], TOKENS)
        d.backend.engine.deregister_mem(d.pool.handle)  # the server now refuses every write
        d.pool.handle = 0
        with pytest.raises(PushError, match=rf"layers 0\.\.1 to {d.engine_id} slot=0 generation=9.*failed"):
            pusher.push_chunk(range(2))  # the refusal may come back now or while finishing
            pusher.push_chunk(range(2, LAYERS))
            pusher.finish()
    finally:
        prefill.close()


def test_finish_refuses_when_a_target_misses_layers(prefill: Prefill, decodes: list[Decode]) -> None:
    d = Decode(layout(1, 16))
    decodes.append(d)
    pusher = KVPusher(prefill.backend, prefill.source, [d.target(0)], TOKENS)
    pusher.push_chunk(range(0, 4))
    with pytest.raises(PushError, match=r"layers 4\.\.5 were pushed"):
        pusher.finish()
    assert d.backend.engine.get_notifies()[1] == []  # nobody was told the slot is ready


def test_bad_requests_are_rejected_before_any_byte_moves(prefill: Prefill, decodes: list[Decode]) -> None:
    d = Decode(layout(1, 4))
    decodes.append(d)
    with pytest.raises(ValueError, match="num_tokens=5 does not fit"):
        KVPusher(prefill.backend, prefill.source, [d.target(0)], TOKENS)
    other = Decode(KVLayout(1, LAYERS, 16, kv_heads=4, head_dim=4, dtype="float16"))
    decodes.append(other)
    with pytest.raises(ValueError, match="kv_heads=4"):
        KVPusher(prefill.backend, prefill.source, [other.target(0)], TOKENS)
    wide = Decode(layout(1, 16, num_layers=LAYERS + 1))
    decodes.append(wide)
    with pytest.raises(ValueError, match="holds layers"):
        KVPusher(prefill.backend, prefill.source, [wide.target(0)], TOKENS)
    ok = Decode(layout(1, 16))
    decodes.append(ok)
    pusher = KVPusher(prefill.backend, prefill.source, [ok.target(0)], TOKENS)
    with pytest.raises(ValueError, match="not in the source pool"):
        pusher.push_chunk(range(LAYERS, LAYERS + 1))
    pusher = KVPusher(prefill.backend, prefill.source, [ok.target(0)], TOKENS)
    pusher.push_chunk(range(LAYERS))
    with pytest.raises(ValueError, match="must not set"):
        pusher.finish({"slot": 3})
    with pytest.raises(ValueError, match="over HIXL's 1024"):
        pusher.finish({"big": "x" * 1024})


def test_unreachable_target_is_a_push_error(prefill: Prefill) -> None:
    target = Grant("r", 0, 1, f"127.0.0.1:{free_port()}", 4096, layout(1, 16))
    with pytest.raises(PushError, match="cannot reach target"):
        KVPusher(prefill.backend, prefill.source, [target], TOKENS, connect_timeout_ms=200)


def test_prefill_and_push_pipelines_or_not(prefill: Prefill, decodes: list[Decode]) -> None:
    d = Decode(layout(2, 16))
    decodes.append(d)
    for slot, pipelined in ((0, True), (1, False)):
        events: list[str] = []
        pusher = KVPusher(prefill.backend, prefill.source, [d.target(slot)], TOKENS)
        original = pusher.push_chunk

        def push_chunk(chunk: range, original: Any = original, events: list[str] = events) -> None:
            events.append(f"push{chunk.start}")
            original(chunk)

        pusher.push_chunk = push_chunk  # type: ignore[method-assign]
        prefill_and_push(
            lambda c, events=events: events.append(f"compute{c.start}"),
            pusher,
            layer_chunks(range(LAYERS), 3),
            pipelined=pipelined,
        )
        expected = (
            ["compute0", "push0", "compute3", "push3"] if pipelined else ["compute0", "compute3", "push0", "push3"]
        )
        assert events == expected
        assert d.run(slot, 4, V, TOKENS) == prefill.run(4, V)


def test_a_decodes_grant_is_the_push_target_and_keeps_its_nonce_out_of_logs() -> None:
    from pdserve_worker.kv.slots import SlotTable

    lay = layout(2, 16)
    grant = SlotTable(lay, engine_id="10.1.1.1:9", base_addr=1 << 20).reserve("r", 5)
    assert (grant.engine_id, grant.base_addr, grant.layout, grant.slot) == ("10.1.1.1:9", 1 << 20, lay, 0)
    assert len(bytes.fromhex(grant.nonce)) == 16
    assert grant.nonce not in repr(grant) and grant.nonce not in grant.describe()


def test_layer_chunks() -> None:
    assert layer_chunks(range(2, 9), 3) == [range(2, 5), range(5, 8), range(8, 9)]
    with pytest.raises(ValueError):
        layer_chunks(range(4), 0)


def test_a_group_migrates_each_members_layers_into_any_split_and_notifies_once(decodes: list[Decode]) -> None:
    """decode/migration.py: a layer-sharded group (layers 0-2 and 3-5) hands a request over to a
    plain decode and to a group split otherwise (0-1, 2-5). Each source member writes exactly the
    layers it and each target share; only the leader notifies, once per target."""
    from pdserve_worker.decode.migration import MigrationPusher

    members = []
    for first, seed in ((0, 1), (3, 2)):
        backend = create_engine("cpu")
        backend.check(backend.engine.initialize("127.0.0.1", {}), "initialize")
        pool = KVPool(backend, layout(2, 16, first_layer=first, num_layers=3))
        ctypes.memmove(pool.base_addr, random.Random(seed).randbytes(pool.nbytes), pool.nbytes)
        members.append((backend, pool))
    full, low, high = Decode(layout(3, 16)), Decode(layout(2, 16, 0, 2)), Decode(layout(2, 16, 2, 4))
    decodes += [full, low, high]
    try:
        for targets in ([full.target(2)], [low.target(1), high.target(0)]):
            pushers = [
                MigrationPusher(backend, PushSource(pool.base_addr, pool.layout, 1), (), targets, TOKENS)
                for backend, pool in members
            ]
            for pusher, (_, pool) in zip(pushers, members, strict=True):
                for chunk in layer_chunks(pool.layout.layer_range, 2):
                    pusher.push_chunk(chunk)
            follower_stats = pushers[1].settle()
            leader_stats = pushers[0].finish({"first_token": 7})
            assert leader_stats.bytes + follower_stats.bytes == LAYERS * 2 * TOKENS * 16  # every layer once
            for t in targets:
                d = next(x for x in (full, low, high) if x.engine_id == t.engine_id)
                for layer in d.pool.layout.layer_range:
                    _, pool = members[0] if layer < 3 else members[1]
                    for kv_index in (K, V):
                        addr, length = pool.run(1, layer, kv_index, TOKENS)
                        assert d.run(t.slot, layer, kv_index, TOKENS) == ctypes.string_at(addr, length)
                _, notes = d.backend.engine.get_notifies()
                assert [json.loads(n.notify_msg)["first_token"] for n in notes] == [7]  # the leader's, once
    finally:
        for backend, pool in members:
            pool.close()
            backend.engine.finalize()


def test_a_member_that_fails_its_push_fails_the_migration_before_any_notify(decodes: list[Decode]) -> None:
    """push_handoff's `before_notify` (a group's followers' pushes): if one failed, the leader's
    push is aborted and the target is never told its KV is there — the router then resumes the
    request by re-prefilling instead of decoding from half a KV."""
    from pdserve_worker.decode.layer_shards import LayerShardError
    from pdserve_worker.decode.migration import Handoff, PushPace, push_handoff
    from pdserve_worker.model.engine import Detached

    backend = create_engine("cpu")
    backend.check(backend.engine.initialize("127.0.0.1", {}), "initialize")
    pool = KVPool(backend, layout(2, 16, first_layer=0, num_layers=3))
    target = Decode(layout(2, 16))
    decodes.append(target)
    handoff = Handoff(Detached("req", 1, [1, 2, 3], [4, 5], seed=3), on_done=lambda: None)

    def follower_failed() -> int:
        raise LayerShardError("group member at 127.0.0.1:1 did not push its layers: UNAVAILABLE gone")

    try:
        with pytest.raises(LayerShardError, match="did not push its layers"):
            push_handoff(
                backend,
                PushSource(pool.base_addr, pool.layout, 1),
                (),
                handoff,
                [target.target(0)],
                PushPace(layers_per_chunk=2, timeout_s=5),
                before_notify=follower_failed,
            )
        _, notes = target.backend.engine.get_notifies()
        assert notes == []
    finally:
        pool.close()
        backend.engine.finalize()


def test_strided_runs_split_into_bounded_runs_cover_the_same_descriptors() -> None:
    """push.split_runs: a slot pool's head slice is one strided run of a whole prompt (its "block"
    is the slot), so a run longer than the limit is cut; the pieces, in order, are exactly the
    original descriptors, and no group holds more than the limit."""
    from pdserve_common.kv_layout import Strided
    from pdserve_worker.transfer.push import split_runs

    runs = [Strided(0, 1000, 3, 16, 32, 16), Strided(48, 5000, 10, 16, 32, 16), Strided(208, 9000, 1, 0, 0, 64)]
    groups = split_runs(runs, 4)
    assert all(sum(r.copies for r in g) <= 4 for g in groups)
    assert [d for g in groups for r in g for d in r.descriptors()] == [d for r in runs for d in r.descriptors()]
    assert split_runs([], 4) == []
