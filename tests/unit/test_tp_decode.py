"""Rank 0 of a tensor-parallel decode (decode/tp_decode.py), with a recording fake group: what it
tells the other ranks, the grants it hands out, and how it ends a broken instance. The real
group, pools and pushes run in tests/integration/test_tensor_parallel_serving.py."""

from __future__ import annotations

import signal
import threading
import time

import pytest
import torch

from pdserve_common.kv_layout import KVLayout
from pdserve_worker.decode import tp_decode
from pdserve_worker.decode.generation_loop import GenerationLoop
from pdserve_worker.decode.tp_decode import IDLE, STOP, DecodeStep, MirroredModel, RankPool, TPDecodeGroup
from pdserve_worker.kv.slots import Grant
from pdserve_worker.serving.tp_group import GroupError


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
    hooks.group, hooks.model = group, None  # type: ignore[assignment]
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
        def has_work(self) -> bool:
            return False

        def idle(self) -> None:
            threads.append(threading.current_thread().name)

    loop = GenerationLoop(IdleGenerator(), name="tp-loop")  # type: ignore[arg-type]
    loop.start()
    time.sleep(0.2)
    loop.stop()
    assert len(threads) >= 3 and set(threads) == {"tp-loop"}
