"""Readiness: every mode delivers, stale generations are ignored, many waiters share one queue."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from netutil import free_port
from pdserve_common.kv_layout import KVLayout
from pdserve_worker.kv.reservations import LeaseClock
from pdserve_worker.kv.slots import SlotTable, reservation_nonce
from pdserve_worker.transfer.base import TransferBackend
from pdserve_worker.transfer.readiness import Readiness, ReadinessTimeout, SlotNotReserved
from pdserve_worker.transfer.registry import create_engine

KEY = b"k" * 32
LAYOUT = KVLayout(num_slots=4, num_layers=1, max_len=8, kv_heads=1, head_dim=4, dtype="float32")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Side:
    """A decode engine with a slot table, and a client engine that sends ready notifies."""

    def __init__(self) -> None:
        self.decode = create_engine("cpu")
        self.engine_id = f"127.0.0.1:{free_port()}"
        self.decode.check(self.decode.engine.initialize(self.engine_id), "initialize")
        self.client = create_engine("cpu")
        self.client.check(self.client.engine.initialize("127.0.0.1"), "initialize")
        self.client.ensure_connected(self.engine_id, 2000)
        self.clock = Clock()
        self.slots = SlotTable(LAYOUT, quarantine_s=0.0, clock=LeaseClock(self.clock), capability_key=KEY)
        self._timers: list[threading.Timer] = []

    def later(self, delay_s: float, fn: Any, *args: Any, **kwargs: Any) -> None:
        """Run fn on another thread after delay_s; close() waits for it."""
        timer = threading.Timer(delay_s, fn, args=args, kwargs=kwargs)
        self._timers.append(timer)
        timer.start()

    def ready(self, slot: int, generation: int, name: str = "kv_ready", nonce: str | None = None, **extra: Any) -> None:
        """A ready notify as a prefill sends it: with the grant's nonce unless told otherwise."""
        nonce = reservation_nonce(KEY, slot, generation) if nonce is None else nonce
        msg = json.dumps(
            {"request_id": "r", "slot": slot, "generation": generation, "nonce": nonce, "num_tokens": 3, **extra}
        )
        api = self.client.api
        self.client.check(self.client.engine.send_notify(self.engine_id, api.NotifyDesc(name, msg), 2000), "notify")

    def close(self) -> None:
        for timer in self._timers:
            timer.join(5)
        self.client.engine.finalize()
        self.decode.engine.finalize()


@pytest.fixture
def side() -> Iterator[Side]:
    s = Side()
    yield s
    s.close()


class PollOnly:
    """Real HIXL's notify surface: `get_notifies` only, no blocking wait."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def get_notifies(self) -> Any:
        return self._engine.get_notifies()


@pytest.mark.parametrize("mode", ["interrupt", "poll", "spin"])
def test_every_mode_delivers_the_ready_message(side: Side, mode: str) -> None:
    warmed: list[tuple[int, int]] = []
    readiness = Readiness(
        side.decode,
        mode,
        accepts=side.slots.is_reserved,
        authorize=side.slots.verify,
        poll_interval_us=200,
        warmup=lambda s, n: warmed.append((s, n)),
    )
    g = side.slots.reserve("r", 60)
    side.later(0.05, side.ready, g.slot, g.generation, first_token=5)
    message = readiness.wait(g.slot, g.generation, timeout_s=5)
    assert message == {
        "request_id": "r",
        "slot": g.slot,
        "generation": g.generation,
        "nonce": g.nonce,
        "num_tokens": 3,
        "first_token": 5,
    }
    assert warmed == [(g.slot, 3)]


def test_interrupt_mode_polls_when_the_engine_cannot_block(side: Side) -> None:
    backend = TransferBackend("hixl", PollOnly(side.decode.engine), side.decode.api)
    assert backend.blocking is None
    readiness = Readiness(backend, "interrupt", accepts=side.slots.is_reserved, authorize=side.slots.verify)
    g = side.slots.reserve("r", 60)
    side.later(0.05, side.ready, g.slot, g.generation)
    assert readiness.wait(g.slot, g.generation, timeout_s=5)["generation"] == g.generation


def test_a_message_that_arrives_before_the_wait_is_kept(side: Side) -> None:
    readiness = Readiness(side.decode, accepts=side.slots.is_reserved, authorize=side.slots.verify)
    g = side.slots.reserve("r", 60)
    side.ready(g.slot, g.generation)
    assert readiness.try_take(g.slot, g.generation)["slot"] == g.slot
    assert readiness.try_take(g.slot, g.generation) is None  # taken once


def test_stale_generation_is_never_taken_for_the_new_request(side: Side) -> None:
    readiness = Readiness(side.decode, accepts=side.slots.is_reserved, authorize=side.slots.verify)
    old = side.slots.reserve("old", 1.0)
    side.clock.now += 2  # the old lease runs out: its transfer was abandoned
    side.slots.expire()
    new = side.slots.reserve("new", 60)
    assert new.slot == old.slot
    side.ready(old.slot, old.generation)  # the abandoned prefill finishes late
    with pytest.raises(ReadinessTimeout, match=f"slot {new.slot} generation {new.generation}"):
        readiness.wait(new.slot, new.generation, timeout_s=0.3)
    side.ready(new.slot, new.generation)
    assert readiness.wait(new.slot, new.generation, timeout_s=5)["generation"] == new.generation


def test_many_waiters_each_get_their_own_message(side: Side) -> None:
    readiness = Readiness(side.decode, accepts=side.slots.is_reserved, authorize=side.slots.verify)
    grants = [side.slots.reserve(f"r{i}", 60) for i in range(4)]
    results: dict[int, dict[str, Any]] = {}

    def wait(slot: int, generation: int) -> None:
        results[slot] = readiness.wait(slot, generation, timeout_s=5)

    threads = [threading.Thread(target=wait, args=(g.slot, g.generation)) for g in grants]
    for t in threads:
        t.start()
    time.sleep(0.05)
    for g in reversed(grants):  # the first waiter (probably the drainer) is told last
        side.ready(g.slot, g.generation)
        time.sleep(0.01)
    for t in threads:
        t.join(5)
    assert {slot: m["generation"] for slot, m in results.items()} == {g.slot: g.generation for g in grants}


def test_waiting_on_a_slot_whose_lease_ended_raises(side: Side) -> None:
    readiness = Readiness(side.decode, accepts=side.slots.is_reserved, authorize=side.slots.verify)
    g = side.slots.reserve("r", 1.0)
    side.later(0.05, setattr, side.clock, "now", 5.0)
    with pytest.raises(SlotNotReserved, match=f"slot {g.slot} generation {g.generation}"):
        readiness.wait(g.slot, g.generation, timeout_s=5)


def test_other_notifies_go_to_their_handler(side: Side) -> None:
    others: list[str] = []
    readiness = Readiness(
        side.decode,
        accepts=side.slots.is_reserved,
        authorize=side.slots.verify,
        on_other=lambda n: others.append(n.name),
    )
    g = side.slots.reserve("r", 60)
    side.ready(g.slot, g.generation, name="drain_request")
    side.ready(g.slot, g.generation)
    assert readiness.wait(g.slot, g.generation, timeout_s=5)["slot"] == g.slot
    assert others == ["drain_request"]


def test_bad_configuration(side: Side) -> None:
    with pytest.raises(ValueError):
        Readiness(side.decode, "sometimes")
    with pytest.raises(ValueError, match="poll_interval_us"):
        Readiness(side.decode, "poll", poll_interval_us=0)


def test_a_notify_without_the_grants_nonce_is_dropped_counted_and_not_kept(side: Side) -> None:
    """A forged notify (right slot and generation, wrong or missing nonce) is never filed, so
    it can neither wake the waiter nor displace the genuine notify that follows."""
    readiness = Readiness(side.decode, accepts=side.slots.is_reserved, authorize=side.slots.verify)
    g = side.slots.reserve("r", 60)
    side.ready(g.slot, g.generation, nonce="00" * 16, first_token=666)
    side.ready(g.slot, g.generation, nonce=reservation_nonce(b"x" * 32, g.slot, g.generation), first_token=666)
    msg = json.dumps({"slot": g.slot, "generation": g.generation, "num_tokens": 3})  # no nonce at all
    side.client.engine.send_notify(side.engine_id, side.client.api.NotifyDesc("kv_ready", msg), 2000)
    side.ready(g.slot, g.generation, nonce="[]")
    assert readiness.try_take(g.slot, g.generation) is None
    assert readiness.drops.totals() == {"bad_capability": 4}
    side.ready(g.slot, g.generation, first_token=7)
    assert readiness.wait(g.slot, g.generation, timeout_s=5)["first_token"] == 7


def test_drops_are_summarised_not_logged_one_by_one(side: Side, caplog: pytest.LogCaptureFixture) -> None:
    readiness = Readiness(side.decode, accepts=side.slots.is_reserved, authorize=side.slots.verify)
    g = side.slots.reserve("r", 60)
    for i in range(50):
        side.ready(g.slot, g.generation + 1 + i)  # right nonce for a generation that is not live
        side.ready(g.slot, g.generation, nonce=f"{i:032x}")
    msg = "not json"
    side.client.engine.send_notify(side.engine_id, side.client.api.NotifyDesc("kv_ready", msg), 2000)
    with caplog.at_level("INFO"):
        assert readiness.try_take(g.slot, g.generation) is None
        time.sleep(0.05)
        assert readiness.try_take(g.slot, g.generation) is None
    assert readiness.drops.totals() == {"stale": 50, "bad_capability": 50, "malformed": 1}
    assert readiness.drops.summaries == 1
    assert len([r for r in caplog.records if "ready_notifies_dropped" in r.getMessage()]) == 1
