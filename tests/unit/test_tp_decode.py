"""Rank 0 of a tensor-parallel decode (ranks/decode.py), with a recording fake group: what it
tells the other ranks, the grants it hands out, and how it ends a broken instance. The real
group, pools and pushes run in tests/integration/test_tensor_parallel_serving.py."""

from __future__ import annotations

import signal
import threading
import time

import pytest
import torch

from pdserve_common.kv_layout import KVLayout
from pdserve_worker.decode.generation_loop import GenerationLoop
from pdserve_worker.kv.slots import Grant
from pdserve_worker.ranks import decode as tp_decode
from pdserve_worker.ranks.decode import IDLE, STOP, DecodeStep, MirroredModel, RankPool, TPDecodeGroup
from pdserve_worker.ranks.group import GroupError


class RecordingGroup:
    """A group of `size` whose broadcasts are recorded (and fail once `fail` is set)."""

    def __init__(self, size: int = 2) -> None:
        self.size, self.rank = size, 0
        self.sent: list[object] = []
        self.fail = False

    def broadcast(self, obj: object = None) -> object:
        if self.fail:
            raise GroupError("tensor-parallel group (rank 0 of 2): connection closed by peer")
        self.sent.append(obj)
        return obj


class FakeModel:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.config = "the model's config"

    def decode_step(self, cache, slots, positions, token_ids):
        self.calls.append((tuple(slots), tuple(positions), tuple(token_ids)))
        return torch.zeros(len(slots), 4)


class FakeCache:
    def table(self, slot: int) -> tuple[int, ...]:
        return {0: (3, 4), 2: (7,)}[slot]


def test_each_decode_step_is_described_to_the_other_ranks_before_it_runs():
    group, model = RecordingGroup(), FakeModel()
    mirrored = MirroredModel(model, group)  # type: ignore[arg-type]
    mirrored.decode_step(FakeCache(), [0, 2], [5, 9], [11, 12])  # type: ignore[arg-type]
    assert group.sent == [DecodeStep((0, 2), (5, 9), (11, 12), ((3, 4), (7,)))]
    assert model.calls == [((0, 2), (5, 9), (11, 12))]
    assert mirrored.config == "the model's config"  # everything else is the model's


def test_idle_ticks_reach_the_other_ranks_only_past_the_interval(monkeypatch):
    group = RecordingGroup()
    mirrored = MirroredModel(FakeModel(), group)  # type: ignore[arg-type]
    mirrored.idle()
    assert group.sent == []  # just created: nothing to keep alive yet
    monkeypatch.setattr(tp_decode, "IDLE_EVERY_S", 0.0)
    mirrored.idle()
    assert group.sent == [IDLE]


def test_a_failed_collective_ends_the_instance_once(monkeypatch):
    killed: list[tuple[int, int]] = []
    monkeypatch.setattr(tp_decode.os, "kill", lambda pid, sig: killed.append((pid, sig)))
    group = RecordingGroup()
    mirrored = MirroredModel(FakeModel(), group)  # type: ignore[arg-type]
    group.fail = True
    for _ in range(2):
        with pytest.raises(GroupError):
            mirrored.decode_step(FakeCache(), [0], [1], [2])  # type: ignore[arg-type]
    assert mirrored.broken and [sig for _, sig in killed] == [signal.SIGTERM]


def test_a_grant_names_every_ranks_pool_and_head_range():
    layout = KVLayout(num_slots=4, num_layers=2, max_len=64, kv_heads=1, head_dim=8, block_tokens=16, num_blocks=16)
    group = TPDecodeGroup.__new__(TPDecodeGroup)
    theirs = [RankPool("127.0.0.1:9001", 0x1000 * (r + 1), {**layout.to_dict(), "first_head": r}) for r in (1, 2)]
    group.others = theirs
    grant = Grant("req", 1, 7, "127.0.0.1:9000", 0x500, layout, nonce="ab", blocks=(4, 5), shared=1)
    grants = group.grants(grant)
    assert grants[0] is grant and [g.layout.first_head for g in grants] == [0, 1, 2]
    assert [g.base_addr for g in grants[1:]] == [0x1000 * 2, 0x1000 * 3]
    assert all((g.slot, g.generation, g.nonce, g.blocks, g.shared) == (1, 7, "ab", (4, 5), 1) for g in grants)


def test_close_tells_the_others_to_stop_unless_the_group_is_broken():
    group = RecordingGroup()
    hooks = TPDecodeGroup.__new__(TPDecodeGroup)
    hooks.group, hooks.model, hooks.leases = group, None, None  # type: ignore[assignment]
    hooks.close()
    assert group.sent == [STOP]
    hooks.model = MirroredModel(FakeModel(), group)  # type: ignore[arg-type]
    hooks.model.broken = True
    hooks.close()
    assert group.sent == [STOP]


def test_the_generation_loop_calls_an_idle_generator_hook_while_nothing_comes(monkeypatch):
    """On the loop's own thread (the one that runs the collectives), not from another."""
    from pdserve_worker.decode import generation_loop

    monkeypatch.setattr(generation_loop, "IDLE_TICK_S", 0.01)
    threads: list[str] = []

    class IdleGenerator:
        ticks_when_idle = True  # (model/engine.Generator: the loop wakes to call `idle`)

        def has_work(self) -> bool:
            return False

        def idle(self) -> None:
            threads.append(threading.current_thread().name)

    loop = GenerationLoop(IdleGenerator(), name="tp-loop")  # type: ignore[arg-type]
    loop.start()
    time.sleep(0.2)
    loop.stop()
    assert len(threads) >= 3 and set(threads) == {"tp-loop"}


class LeaseGroup(RecordingGroup):
    """The lease channel of a group of 3: what rank 0 sends, and each other rank's answer to a grant."""

    def __init__(self, answers: list[object]) -> None:
        super().__init__(size=3)
        self.leased: list[object] = []
        self.answers = answers

    def lease_broadcast(self, obj: object = None) -> object:
        if self.fail:
            raise GroupError("tensor-parallel group (rank 0 of 3): connection closed by peer")
        self.leased.append(obj)
        return obj

    def lease_gather(self, obj: object) -> list[object]:
        return [obj, *self.answers]


class OwnLeases:
    def __init__(self) -> None:
        self.live: dict[tuple[int, int], tuple[int, ...]] = {}

    def granted(self, slot: int, generation: int, blocks) -> None:
        self.live[(slot, generation)] = tuple(blocks)

    def ended(self, slot: int, generation: int) -> None:
        self.live.pop((slot, generation), None)

    def __len__(self) -> int:
        return len(self.live)


def test_rank_0_grants_a_lease_on_every_rank_before_the_grant_goes_out_and_ends_it_there_too():
    """#32: the other ranks' engines are leased like rank 0's; a grant waits for their answers."""
    from pdserve_worker.ranks.decode import END, GRANT, RankLeases

    group, own = LeaseGroup([None, None]), OwnLeases()
    leases = RankLeases(own, group)  # type: ignore[arg-type]
    try:
        leases.granted(3, 70, (5, 6))
        assert own.live == {(3, 70): (5, 6)} and group.leased == [(GRANT, 3, 70, (5, 6))]
        leases.ended(3, 70)
        assert own.live == {} and group.leased[-1] == (END, 3, 70)
        group.answers = [None, "engine refused a write lease for slot 4's blocks"]
        with pytest.raises(RuntimeError, match="rank refused the write lease of slot 4"):
            leases.granted(4, 71, (7,))
        assert own.live == {} and group.leased[-2:] == [(GRANT, 4, 71, (7,)), (END, 4, 71)]  # given back
        group.fail = True
        with pytest.raises(GroupError):
            leases.granted(5, 72, (8,))
        assert own.live == {}  # nobody keeps a lease of a grant that failed
    finally:
        group.fail = False
        leases.close()
    assert group.leased[-1] == STOP


def test_a_quiet_lease_channel_is_kept_alive(monkeypatch):
    from pdserve_worker.ranks.decode import RankLeases

    monkeypatch.setattr(tp_decode, "IDLE_EVERY_S", 0.0)
    group = LeaseGroup([None, None])
    leases = RankLeases(OwnLeases(), group)  # type: ignore[arg-type]
    try:
        deadline = time.monotonic() + 5
        while IDLE not in group.leased and time.monotonic() < deadline:
            time.sleep(0.05)
        assert IDLE in group.leased
    finally:
        leases.close()


def test_another_rank_applies_each_lease_message_and_answers_grants():
    from pdserve_worker.ranks.decode import END, GRANT, serve_leases

    class Scripted:
        def __init__(self, messages: list[object]) -> None:
            self.messages, self.answers = messages, []

        def lease_broadcast(self, obj: object = None) -> object:
            return self.messages.pop(0)

        def lease_gather(self, obj: object) -> None:
            self.answers.append(obj)

    class Refusing(OwnLeases):
        def granted(self, slot, generation, blocks):
            if slot == 9:
                raise RuntimeError("engine refused a write lease for slot 9's blocks")
            super().granted(slot, generation, blocks)

    own = Refusing()
    group = Scripted([(GRANT, 1, 10, (2, 3)), IDLE, (GRANT, 9, 11, (4,)), (GRANT, 2, 12, (5,)), (END, 1, 10), STOP])
    serve_leases(group, own)  # type: ignore[arg-type]
    assert own.live == {(2, 12): (5,)}
    assert group.answers == [None, "engine refused a write lease for slot 9's blocks", None]


def test_a_drain_asks_every_other_rank_to_push_its_heads_and_waits_for_their_bytes():
    """Draining, rank 0 sends each handed-over request's PushOrder on the lease channel; the
    notify waits for every rank's answer (its bytes); a rank that answers why it failed, or a
    broken channel, fails the migration (MemberUnavailable: the router re-prefills)."""
    from pdserve_worker.ranks.decode import PUSH, PushOrder, RankLeases, RankPushes
    from pdserve_worker.ranks.group import MemberUnavailable

    group = LeaseGroup([4096, 2048])
    leases = RankLeases(OwnLeases(), group)  # type: ignore[arg-type]
    target = Grant("r", 1, 2, "127.0.0.1:9", 4096, KVLayout(1, 2, 16, 2, 4, block_tokens=4, num_blocks=4))
    order = PushOrder(3, 70, (5, 6), 7, (target,), 2.0, 4)
    try:
        pushes = RankPushes(leases, order)
        assert pushes.wait() == 4096 + 2048
        pushes.settle()
        assert group.leased[-1] == (PUSH, 3, 70, order)
        group.answers = [4096, "put of layers 0..1 to decode at 127.0.0.1:9 timed out"]
        with pytest.raises(MemberUnavailable, match="rank 2 did not push its heads: put of layers 0..1"):
            RankPushes(leases, order).wait()
        group.fail = True
        failed = RankPushes(leases, order)
        failed.settle()  # (settle never raises: it only waits)
        with pytest.raises(MemberUnavailable, match="did not push their heads"):
            failed.wait()
    finally:
        group.fail = False
        leases.close()


def test_another_rank_pushes_on_order_and_answers_what_came_of_it():
    from pdserve_worker.ranks.decode import PUSH, PushOrder, serve_leases

    class Scripted:
        def __init__(self, messages: list[object]) -> None:
            self.messages, self.answers = messages, []

        def lease_broadcast(self, obj: object = None) -> object:
            return self.messages.pop(0)

        def lease_gather(self, obj: object) -> None:
            self.answers.append(obj)

    orders = [PushOrder(1, 10, (2,), 3, (), 1.0, 4), PushOrder(2, 11, (3,), 3, (), 1.0, 4)]
    done: list[PushOrder] = []

    def push(order: PushOrder) -> int | str:
        done.append(order)
        return 512 if order.slot == 1 else "target gone"

    group = Scripted([(PUSH, 1, 10, orders[0]), (PUSH, 2, 11, orders[1]), STOP])
    serve_leases(group, OwnLeases(), push)  # type: ignore[arg-type]
    assert done == orders and group.answers == [512, "target gone"]
    unable = Scripted([(PUSH, 1, 10, orders[0]), STOP])
    serve_leases(unable, OwnLeases())  # type: ignore[arg-type]
    assert unable.answers == ["this rank does not push"]
