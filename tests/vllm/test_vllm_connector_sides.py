"""pdserve's vLLM connector without vLLM: its scheduler sides, a decode receiver and a prefill
pusher on two real host engines in this process, with torch tensors shaped like vLLM's CPU KV
cache. The push lands layer by layer in exactly the granted blocks; a forged or late notify,
a late write, an abort and a timeout each leave the reservation the one way they should."""

from __future__ import annotations

import json
import secrets
import socket
import time
from types import SimpleNamespace

import pytest
import torch

from netutil import free_port
from pdserve_worker.engines.vllm.decode_worker import IDLE_WAIT_S, DecodeReceiver
from pdserve_worker.engines.vllm.grant import (
    GRANT_PARAM,
    READY_NOTIFY,
    RESERVE_PARAM,
    ConnectorSettings,
    KVGeometry,
    VllmGrant,
    ready_message,
)
from pdserve_worker.engines.vllm.plane import KVPlane
from pdserve_worker.engines.vllm.prefill_worker import PrefillPusher, PushOrder
from pdserve_worker.engines.vllm.scheduler import DecodeScheduler, PrefillScheduler

BT = 4  # tokens per block
LAYERS = ("model.layers.0.attn", "model.layers.1.attn", "model.layers.2.attn")


def caches(num_blocks: int, fill: bool) -> dict[str, torch.Tensor]:
    """vLLM CPU's layout: (2, blocks, kv heads, block tokens, head dim) per layer."""
    make = torch.randn if fill else torch.zeros
    return {name: make(2, num_blocks, 2, BT, 8).to(torch.bfloat16) for name in LAYERS}


class Sink:
    """The grant sink: what pdserve's decode worker will be (here: a socket the test reads)."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.conn: socket.socket | None = None
        self.buffer = b""

    def grant(self) -> VllmGrant:
        if self.conn is None:
            self.server.settimeout(10)
            self.conn, _ = self.server.accept()
            self.conn.settimeout(10)
        while b"\n" not in self.buffer:
            self.buffer += self.conn.recv(65536)
        line, _, self.buffer = self.buffer.partition(b"\n")
        return VllmGrant.from_wire(json.loads(line)["grant"])

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.server.close()


@pytest.fixture
def pair():
    sink = Sink()
    key = secrets.token_hex(32)
    listen = f"127.0.0.1:{free_port()}"
    decode_settings = ConnectorSettings(listen=listen, link_key=key, grant_sink=sink.address, quarantine_s=0.05)
    d_plane, p_plane = KVPlane(decode_settings, "decode"), KVPlane(ConnectorSettings(link_key=key), "prefill")
    d_cache, p_cache = caches(12, fill=False), caches(8, fill=True)
    d_plane.open(d_cache, BT)
    p_plane.open(p_cache, BT)
    receiver, pusher = DecodeReceiver(d_plane), PrefillPusher(p_plane)
    pusher.registered(p_plane.geometry)
    yield SimpleNamespace(sink=sink, receiver=receiver, pusher=pusher, d_cache=d_cache, p_cache=p_cache)
    receiver.close()
    p_plane.close()
    d_plane.close()
    sink.close()


def request(req_id: str, tokens: int, params: dict) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, prompt_token_ids=list(range(tokens)), kv_transfer_params=params)


def blocks(ids: list[int]) -> SimpleNamespace:
    return SimpleNamespace(get_block_ids=lambda: (ids,))


def reserve(pair, sched: DecodeScheduler, req_id: str, tokens: int, ids: list[int]) -> VllmGrant:
    """The decode's scheduler reserves, its worker leases and announces: the grant the sink saw."""
    req = request(req_id, tokens, {RESERVE_PARAM: True})
    assert sched.get_num_new_matched_tokens(req, 0) == (tokens, True)
    sched.update_state_after_alloc(req, blocks(ids), tokens)
    step = sched.build_connector_meta()
    pair.receiver.start_step(step.new, step.ended)
    return pair.sink.grant()


def run_step(pusher: PrefillPusher, orders: list[PushOrder]) -> None:
    pusher.start_step(orders)
    for name in LAYERS:  # as vLLM's attention layers call save_kv_layer, one after another
        pusher.save_layer(name)
    pusher.end_step()


def step_output(new=(), cached=None, scheduled=None) -> SimpleNamespace:
    cached = cached or SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])
    return SimpleNamespace(
        scheduled_new_reqs=list(new), scheduled_cached_reqs=cached, num_scheduled_tokens=scheduled or {}
    )


def wait_finished(receiver: DecodeReceiver, timeout_s: float = 10.0) -> tuple[set[str], set[str]]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, failed = receiver.finished()
        if done:
            return done, failed
        time.sleep(0.005)
    return set(), set()


def test_a_chunked_prefill_lands_layer_by_layer_in_exactly_the_granted_blocks(pair) -> None:
    d_sched, p_sched = DecodeScheduler(BT), PrefillScheduler(BT)
    decode_blocks = [7, 3, 9, 10, 11]  # 18 tokens: 5 blocks, the last one partial
    grant = reserve(pair, d_sched, "req-1", 18, decode_blocks)
    assert grant.block_ids == tuple(decode_blocks) and grant.num_tokens == 18
    assert d_sched.has_pending_push_work()

    prefill_req = request("p-1", 18, {GRANT_PARAM: grant.to_wire()})
    p_sched.update_state_after_alloc(prefill_req, blocks([0, 1, 2]), 0)
    new = SimpleNamespace(req_id="p-1", block_ids=([0, 1, 2],), num_computed_tokens=0)
    first = p_sched.build_connector_meta(step_output([new], scheduled={"p-1": 10}))  # chunked: 10 of 18
    assert [(o.src, o.dst, o.final) for o in first] == [((0, 1, 2), (7, 3, 9), False)]
    run_step(pair.pusher, first)
    assert pair.receiver.finished() == (set(), set())  # no ready notify before the last chunk

    cached = SimpleNamespace(
        req_ids=["p-1"], resumed_req_ids=set(), new_block_ids=[([4, 5],)], num_computed_tokens=[10]
    )
    second = p_sched.build_connector_meta(step_output(cached=cached, scheduled={"p-1": 8}))
    assert [(o.src, o.dst, o.final) for o in second] == [
        ((2, 4, 5), (9, 10, 11), True)
    ]  # block 2 again: it was partial
    run_step(pair.pusher, second)

    assert wait_finished(pair.receiver) == ({"req-1"}, set())
    d_sched.update_connector_output(["req-1"])
    assert not d_sched.has_pending_push_work()
    for name in LAYERS:
        for src, dst in zip([0, 1, 2, 4, 5], decode_blocks):
            assert torch.equal(pair.d_cache[name][:, dst], pair.p_cache[name][:, src]), (name, src, dst)
        untouched = [b for b in range(12) if b not in decode_blocks]
        assert not pair.d_cache[name][:, untouched].any()  # nothing outside the grant was written
    assert pair.pusher.counts["puts"] == 2 * len(LAYERS)  # one put per layer per step
    assert pair.pusher.counts["notifies"] == 1 and pair.receiver.counts["ready"] == 1

    # Late: the same grant's blocks are no longer leased, so a replayed push is refused.
    before = {name: pair.d_cache[name].clone() for name in LAYERS}
    run_step(pair.pusher, [PushOrder(grant, (6,), (7,), True)])
    assert pair.pusher.counts["failed"] == 1
    assert all(torch.equal(before[name], pair.d_cache[name]) for name in LAYERS)
    assert pair.receiver.finished() == (set(), set())
    assert pair.receiver.counts["dropped_bad_capability"] == 1  # its notify names an ended reservation


def test_a_forged_notify_is_dropped_and_a_failed_push_fails_over_to_recompute(pair) -> None:
    d_sched = DecodeScheduler(BT)
    grant = reserve(pair, d_sched, "req-2", 8, [1, 2])
    engine = pair.pusher.plane.backend
    engine.ensure_connected(grant.engine_id, 2000)
    forged = engine.api.NotifyDesc(READY_NOTIFY, ready_message("req-2", "00" * 16, 8, True))
    assert engine.engine.send_notify(grant.engine_id, forged, 2000) == engine.api.SUCCESS
    time.sleep(0.05)
    assert pair.receiver.finished() == (set(), set())
    assert pair.receiver.counts["dropped_bad_capability"] == 1

    run_step(pair.pusher, [PushOrder(grant, (), (), True, "the prefill request ended early")])
    assert wait_finished(pair.receiver) == ({"req-2"}, {"req-2"})  # received, and failed: vLLM recomputes
    assert pair.receiver.counts["failed"] == 1 and not pair.receiver.pending()
    d_sched.update_connector_output(["req-2"])
    # vLLM recomputes from token 0 and asks again: the request is never reserved a second time.
    assert d_sched.get_num_new_matched_tokens(request("req-2", 8, {RESERVE_PARAM: True}), 0) == (0, False)


def test_an_abort_revokes_the_leases_and_frees_the_blocks_once_after_quarantine(pair) -> None:
    d_sched = DecodeScheduler(BT)
    grant = reserve(pair, d_sched, "req-3", 8, [4, 5])
    d_sched.request_finished(request("req-3", 8, {RESERVE_PARAM: True}))  # the client went away
    step = d_sched.build_connector_meta()
    assert step.ended == ["req-3"]
    pair.receiver.start_step(step.new, step.ended)
    assert pair.receiver.finished() == (set(), set())  # in quarantine: vLLM keeps the blocks

    run_step(pair.pusher, [PushOrder(grant, (0, 1), (4, 5), True)])  # a prefill that did not hear
    assert pair.pusher.counts["failed"] == 1  # its writes were refused
    assert not any(pair.d_cache[name][:, [4, 5]].any() for name in LAYERS)

    assert wait_finished(pair.receiver) == ({"req-3"}, set())  # once the quarantine is over
    assert pair.receiver.finished() == (set(), set())  # and only once
    d_sched.update_connector_output(["req-3"])
    assert not d_sched.has_pending_push_work()


def test_no_ready_notify_within_the_timeout_fails_over(pair) -> None:
    pair.receiver.plane.settings = ConnectorSettings(
        listen="x:1", link_key="00", grant_sink=pair.sink.address, ready_timeout_s=0.05
    )
    reserve(pair, DecodeScheduler(BT), "req-4", 4, [0])
    assert wait_finished(pair.receiver) == ({"req-4"}, {"req-4"})
    assert pair.receiver.counts["timeouts"] == 1


def test_geometry_of_both_vllm_layouts_and_grant_checks() -> None:
    kv_first = KVGeometry.of(caches(6, fill=False), BT)
    assert kv_first.num_blocks == 6 and all(len(p) == 2 for p in kv_first.planes)
    assert kv_first.block_bytes == kv_first.block_stride == 2 * BT * 8 * 2
    block_first = KVGeometry.of({"a": torch.zeros(6, 2, BT, 16, dtype=torch.bfloat16)}, BT)
    assert block_first.num_blocks == 6 and block_first.planes[0] == (block_first.planes[0][0],)
    spans = kv_first.block_spans(0, [1, 2, 4])
    assert len(spans) == 4 and spans[0][1] == 2 * kv_first.block_bytes  # 1-2 merged, per plane
    with pytest.raises(ValueError, match="planes per layer"):
        block_first.check_matches(KVGeometry.of({"a": torch.zeros(2, 6, 2, BT, 16, dtype=torch.bfloat16)}, BT))

    grant = VllmGrant("r", "127.0.0.1:1", "ab", 9, 0, (1, 2, 3), kv_first)
    assert VllmGrant.from_wire(json.loads(json.dumps(grant.to_wire()))) == grant
    for field, value, match in (
        ("block_ids", [1, 2], "its 9 tokens need 3"),
        ("block_ids", [1, 2, 6], "outside the decode's 6 blocks"),
        ("num_tokens", "9", "'num_tokens' must be an integer"),
        ("nonce", "", "'nonce' must be a non-empty string"),
    ):
        wire = grant.to_wire()
        wire[field] = value
        with pytest.raises(ValueError, match=match):
            VllmGrant.from_wire(wire)
    with pytest.raises(ValueError, match="pdserve_quarantine_s must be > 0"):
        ConnectorSettings.parse({"pdserve_quarantine_s": 0})
    assert ConnectorSettings.parse({"pdserve_link_key": "ab", "other": 1}).link_key == "ab"


def test_an_idle_decode_step_sleeps_on_the_notify_inbox_instead_of_spinning(pair) -> None:
    grant = reserve(pair, DecodeScheduler(BT), "req-5", 4, [6])
    start = time.perf_counter()
    assert pair.receiver.finished(idle=True) == (set(), set())
    assert time.perf_counter() - start >= IDLE_WAIT_S * 0.9  # slept (vLLM's loop would spin here)
    run_step(pair.pusher, [PushOrder(grant, (3,), (6,), True)])
    deadline = time.monotonic() + 10
    got: tuple[set[str], set[str]] = (set(), set())
    while not got[0] and time.monotonic() < deadline:
        got = pair.receiver.finished(idle=True)  # returns as soon as the notify is in
    assert got == ({"req-5"}, set())
    assert not pair.receiver.pending()  # nothing waits now: an idle step no longer sleeps
