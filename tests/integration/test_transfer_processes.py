"""Acceptance: KV transfer between real processes on 127.0.0.1 (multiprocessing, spawn).

Decode and prefill peers (support.transfer_peers) are separate processes with their
own engines; this test process drives them, and in some tests is itself the prefill client.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from netutil import free_port
from pdserve_common.kv_layout import KVLayout, shard_layers
from pdserve_worker.transfer import hixl_api as api
from pdserve_worker.transfer.base import TransferBackend
from pdserve_worker.transfer.registry import create_engine
from support.local_run import stop_process
from support.transfer_peers import PeerError, PeerProcess, decode_main, prefill_main

pytestmark = pytest.mark.slow

KV = dict(kv_heads=2, head_dim=16, dtype="bfloat16")


def decode_layout(slots: int = 4, layers: int = 8, max_len: int = 64, first_layer: int = 0) -> KVLayout:
    return KVLayout(num_slots=slots, num_layers=layers, max_len=max_len, first_layer=first_layer, **KV)


def prefill_layout(layers: int = 8, max_len: int = 48) -> KVLayout:
    return KVLayout(num_slots=1, num_layers=layers, max_len=max_len, **KV)


@pytest.fixture
def peers() -> Iterator[Callable[..., PeerProcess]]:
    """Start peers; every one is stopped (and, failing that, killed) after the test."""
    started: list[PeerProcess] = []

    def start(main: Any, **config: Any) -> PeerProcess:
        started.append(PeerProcess.start(main, config))
        return started[-1]

    yield start
    for peer in started:
        if peer.process.is_alive():
            os.kill(peer.process.pid, signal.SIGCONT)  # in case a test left it stopped
        peer.stop()


def start_decode(peers: Callable[..., PeerProcess], layout: KVLayout, **config: Any) -> PeerProcess:
    return peers(decode_main, engine_id=f"127.0.0.1:{free_port()}", layout=layout.to_dict(), **config)


def start_prefill(
    peers: Callable[..., PeerProcess], layout: KVLayout, seed: int, transport: str = "auto"
) -> PeerProcess:
    return peers(
        prefill_main,
        engine_id="127.0.0.1",
        layout=layout.to_dict(),
        seed=seed,
        options={"pdserve.Transport": transport},
    )


@pytest.fixture
def client() -> Iterator[TransferBackend]:
    """This process as a client engine (it sends notifies in the readiness tests)."""
    backend = create_engine("cpu")
    backend.check(backend.engine.initialize("127.0.0.1"), "initialize")
    yield backend
    backend.engine.finalize()


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_pushed_kv_equals_the_source_bytes(peers: Callable[..., PeerProcess], transport: str) -> None:
    decode = start_decode(peers, decode_layout())
    prefill = start_prefill(peers, prefill_layout(), seed=11, transport=transport)
    grant = decode.call("reserve", request_id="r1", ttl_s=30)
    decode.send("wait", slot=grant["slot"], generation=grant["generation"], timeout_s=30)
    stats = prefill.call("push", targets=[grant], num_tokens=41, layers_per_chunk=3)
    ready = decode.result()["message"]
    assert prefill.call("link_path", engine_id=decode.info["engine_id"]) == ("shm" if transport == "auto" else "tcp")
    assert (ready["request_id"], ready["slot"], ready["generation"], ready["num_tokens"]) == (
        "r1",
        grant["slot"],
        grant["generation"],
        41,
    )
    assert stats["puts"] == 16 and stats["bytes"] == 16 * 41 * 64
    assert decode.call("checksums", slot=grant["slot"], num_tokens=41) == prefill.call("checksums", num_tokens=41)
    assert decode.call("untouched_beyond", slot=grant["slot"], num_tokens=41)


def test_two_sided_push_between_processes_lands_the_source_bytes(peers: Callable[..., PeerProcess]) -> None:
    """The gloo send/recv baseline (transfer/backends/two_sided.py) between real processes: the same
    bytes land, the ready notify follows them, and the decode's CPU did the staging copy."""
    decode = start_decode(peers, decode_layout(), backend="two-sided")
    prefill = peers(prefill_main, engine_id="127.0.0.1", layout=prefill_layout().to_dict(), seed=3, backend="two-sided")
    for request_id, tokens in (("r1", 41), ("r2", 7)):
        grant = decode.call("reserve", request_id=request_id, ttl_s=30)
        decode.send("wait", slot=grant["slot"], generation=grant["generation"], timeout_s=30)
        stats = prefill.call("push", targets=[grant], num_tokens=tokens, layers_per_chunk=3)
        assert decode.result()["message"]["request_id"] == request_id
        assert decode.call("checksums", slot=grant["slot"], num_tokens=tokens) == prefill.call(
            "checksums", num_tokens=tokens
        )
        assert decode.call("untouched_beyond", slot=grant["slot"], num_tokens=tokens)
        decode.call("release", slot=grant["slot"], generation=grant["generation"])
    pushed = 16 * (41 + 7) * 64
    assert stats["bytes"] == 16 * 7 * 64
    assert prefill.call("copies")["socket_send"] == pushed
    received = decode.call("copies")
    assert received["socket_recv"] == received["staging_copy"] == pushed


def test_four_prefills_write_one_decode_concurrently_without_corruption(peers: Callable[..., PeerProcess]) -> None:
    decode = start_decode(peers, decode_layout(slots=6, max_len=128))
    prefills = [start_prefill(peers, prefill_layout(max_len=120), seed=100 + i) for i in range(4)]
    grants = [decode.call("reserve", request_id=f"r{i}", ttl_s=30) for i in range(4)]
    pristine = decode.call("slot_crc", slot=5)
    tokens = [120, 97, 64, 1]
    for prefill, grant, n in zip(prefills, grants, tokens):
        prefill.send("push", targets=[grant], num_tokens=n, layers_per_chunk=1, queue_depth=4)
    for prefill in prefills:
        prefill.result()
    for prefill, grant, n in zip(prefills, grants, tokens):
        assert decode.call("checksums", slot=grant["slot"], num_tokens=n) == prefill.call("checksums", num_tokens=n)
        assert decode.call("untouched_beyond", slot=grant["slot"], num_tokens=n)
    assert decode.call("slot_crc", slot=4) == decode.call("slot_crc", slot=5) == pristine
    for grant in grants:
        message = decode.call("wait", slot=grant["slot"], generation=grant["generation"], timeout_s=10)["message"]
        assert message["request_id"] == grant["request_id"]


def test_64_layers_into_8_decode_targets_with_queue_depth_128(peers: Callable[..., PeerProcess]) -> None:
    layers = 64
    # Four members hold the whole model; four more form one layer-sharded group.
    layouts = [decode_layout(slots=1, layers=layers, max_len=32) for _ in range(4)]
    layouts += [decode_layout(slots=1, layers=len(r), max_len=32, first_layer=r.start) for r in shard_layers(layers, 4)]
    decodes = [start_decode(peers, lay) for lay in layouts]
    prefill = start_prefill(peers, prefill_layout(layers=layers, max_len=32), seed=5)
    grants = [d.call("reserve", request_id="big", ttl_s=60) for d in decodes]
    stats = prefill.call("push", targets=grants, num_tokens=30, layers_per_chunk=4, queue_depth=128, timeout_s=30)
    assert stats["puts"] == 4 * layers * 2 + layers * 2  # each sharded layer goes to one member only
    source = prefill.call("checksums", num_tokens=30)
    for d, lay, grant in zip(decodes, layouts, grants):
        got = d.call("checksums", slot=grant["slot"], num_tokens=30)
        assert got == {k: v for k, v in source.items() if int(k.split("/")[0]) in lay.layer_range}
        assert (
            d.call("wait", slot=grant["slot"], generation=grant["generation"], timeout_s=10)["message"]["num_tokens"]
            == 30
        )


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_out_of_range_descriptors_are_param_invalid(peers: Callable[..., PeerProcess], transport: str) -> None:
    layout = decode_layout(slots=1)
    decode = start_decode(peers, layout)
    backend = create_engine("cpu")
    backend.check(backend.engine.initialize("127.0.0.1", {"pdserve.Transport": transport}), "initialize")
    try:
        local = (ctypes.c_char * 4096)()
        backend.check(
            backend.engine.register_mem(api.MemDesc(ctypes.addressof(local), 4096), api.MEM_HOST)[0], "register"
        )
        remote, base = decode.info["engine_id"], decode.info["base_addr"]
        backend.ensure_connected(remote, 5000)
        end = base + layout.total_bytes
        cases = {
            "inside": (ctypes.addressof(local), base, 64),
            "past the pool's end": (ctypes.addressof(local), end - 32, 64),
            "before the pool": (ctypes.addressof(local), base - 64, 64),
            "unregistered local": (ctypes.addressof(local) + 4096 - 32, base, 64),
        }
        got = {
            name: backend.engine.transfer_sync(remote, api.WRITE, [api.TransferOpDesc(*c)], 2000)
            for name, c in cases.items()
        }
        assert got == {
            "inside": api.SUCCESS,
            "past the pool's end": api.PARAM_INVALID,
            "before the pool": api.PARAM_INVALID,
            "unregistered local": api.PARAM_INVALID,
        }
    finally:
        backend.engine.finalize()


def test_a_timed_out_put_raises_and_the_lease_expiry_frees_the_slot(peers: Callable[..., PeerProcess]) -> None:
    decode = start_decode(peers, decode_layout(slots=1), quarantine_s=30)
    prefill = start_prefill(peers, prefill_layout(), seed=3, transport="tcp")
    grant = decode.call("reserve", request_id="stuck", ttl_s=1.0)
    prefill.call("connect", engine_id=decode.info["engine_id"])
    stop_process(decode.process.pid)  # a hung decode: it never acknowledges
    try:
        with pytest.raises(PeerError) as err:
            prefill.call("push", targets=[grant], num_tokens=40, timeout_s=0.5, wait_s=30)
    finally:
        os.kill(decode.process.pid, signal.SIGCONT)
    assert err.value.kind == "PushError"
    assert f"to {decode.info['engine_id']} slot=0 generation={grant['generation']}" in str(err.value)
    assert "layers 0..3" in str(err.value) and "timed out" in str(err.value)
    time.sleep(max(0.0, 1.1 - 0.5))  # past the 1 s lease
    assert [g["request_id"] for g in decode.call("expire")] == ["stuck"]
    assert decode.call("state", slot=0) == "quarantined"
    with pytest.raises(PeerError, match="NoFreeSlot"):
        decode.call("reserve", request_id="next", ttl_s=5)


def test_a_late_ready_of_an_abandoned_generation_is_ignored(peers: Callable[..., PeerProcess]) -> None:
    decode = start_decode(peers, decode_layout(slots=1), quarantine_s=0.5)
    prefill = start_prefill(peers, prefill_layout(), seed=4)
    old = decode.call("reserve", request_id="old", ttl_s=0.5)
    prefill.send("push", targets=[old], num_tokens=20, delay_before_finish_s=1.5)  # too slow
    with pytest.raises(PeerError, match="SlotNotReserved|ReadinessTimeout"):
        decode.call("wait", slot=old["slot"], generation=old["generation"], timeout_s=5)
    decode.call("expire")
    time.sleep(0.6)  # the quarantine passes
    new = decode.call("reserve", request_id="new", ttl_s=30)
    assert new["slot"] == old["slot"] and new["generation"] != old["generation"]
    prefill.result(wait_s=30)  # the late push finished and sent its (stale) ready
    with pytest.raises(PeerError, match="ReadinessTimeout"):
        decode.call("wait", slot=new["slot"], generation=new["generation"], timeout_s=0.5)
    prefill.call("push", targets=[new], num_tokens=33)
    message = decode.call("wait", slot=new["slot"], generation=new["generation"], timeout_s=10)["message"]
    assert (message["request_id"], message["generation"], message["num_tokens"]) == ("new", new["generation"], 33)
    assert decode.call("checksums", slot=new["slot"], num_tokens=33) == prefill.call("checksums", num_tokens=33)


@pytest.mark.parametrize("mode", ["interrupt", "poll", "spin"])
def test_every_readiness_mode_delivers(peers: Callable[..., PeerProcess], client: TransferBackend, mode: str) -> None:
    decode = start_decode(peers, decode_layout(slots=2), mode=mode, poll_interval_us=500, warmup=True)
    client.ensure_connected(decode.info["engine_id"], 5000)
    for i in range(3):
        grant = decode.call("reserve", request_id=f"m{i}", ttl_s=30)
        decode.send("wait", slot=grant["slot"], generation=grant["generation"], timeout_s=10)
        time.sleep(0.02)
        body = json.dumps(
            {
                "request_id": f"m{i}",
                "slot": grant["slot"],
                "generation": grant["generation"],
                "nonce": grant["nonce"],
                "num_tokens": 7,
            }
        )
        client.check(
            client.engine.send_notify(decode.info["engine_id"], api.NotifyDesc("kv_ready", body), 5000), "notify"
        )
        assert decode.result()["message"]["request_id"] == f"m{i}"
        assert decode.call("commit", slot=grant["slot"], generation=grant["generation"])
        assert decode.call("release", slot=grant["slot"], generation=grant["generation"])


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_terminal_status_is_reported_once_across_processes(peers: Callable[..., PeerProcess], transport: str) -> None:
    decode = start_decode(peers, decode_layout(slots=1))
    backend = create_engine("cpu")
    backend.check(backend.engine.initialize("127.0.0.1", {"pdserve.Transport": transport}), "initialize")
    try:
        status, addr = backend.engine.malloc_mem(4096)
        backend.check(backend.engine.register_mem(api.MemDesc(addr, 4096), api.MEM_HOST)[0], "register")
        backend.ensure_connected(decode.info["engine_id"], 5000)
        status, req = backend.engine.transfer_async(
            decode.info["engine_id"], api.WRITE, [api.TransferOpDesc(addr, decode.info["base_addr"], 4096)]
        )
        assert status == api.SUCCESS
        seen = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            seen.append(backend.engine.get_transfer_status(req))
            if seen[-1][1] is not api.TransferStatus.WAITING:
                break
        assert seen[-1] == (api.SUCCESS, api.TransferStatus.COMPLETED)
        assert all(s == (api.SUCCESS, api.TransferStatus.WAITING) for s in seen[:-1])
        assert backend.engine.get_transfer_status(req) == (api.FAILED, api.TransferStatus.FAILED)
    finally:
        backend.engine.finalize()


def test_resource_exhausted_past_the_bounds_and_recovery(peers: Callable[..., PeerProcess]) -> None:
    decode = start_decode(peers, decode_layout(slots=1), options={"pdserve.NotifyQueueSize": "2"})
    backend = create_engine("cpu")
    backend.check(
        backend.engine.initialize("127.0.0.1", {"pdserve.MaxOutstandingTransfers": "8", "pdserve.Transport": "tcp"}),
        "initialize",
    )
    try:
        status, addr = backend.engine.malloc_mem(4096)
        backend.check(backend.engine.register_mem(api.MemDesc(addr, 4096), api.MEM_HOST)[0], "register")
        remote = decode.info["engine_id"]
        backend.ensure_connected(remote, 5000)
        op = [api.TransferOpDesc(addr, decode.info["base_addr"], 512)]
        reqs = [backend.engine.transfer_async(remote, api.WRITE, op) for _ in range(8)]
        assert [s for s, _ in reqs] == [api.SUCCESS] * 8
        assert backend.engine.transfer_async(remote, api.WRITE, op) == (api.RESOURCE_EXHAUSTED, 0)
        for _, req in reqs:  # drain: each is queried until terminal
            while backend.engine.get_transfer_status(req)[1] is api.TransferStatus.WAITING:
                time.sleep(0.001)
        assert backend.engine.transfer_async(remote, api.WRITE, op)[0] == api.SUCCESS
        # The decode's notify queue holds 2 until someone drains it.
        grant = decode.call("reserve", request_id="q", ttl_s=30)
        body = json.dumps(
            {
                "request_id": "q",
                "slot": grant["slot"],
                "generation": grant["generation"],
                "nonce": grant["nonce"],
                "num_tokens": 1,
            }
        )
        sent = [backend.engine.send_notify(remote, api.NotifyDesc("kv_ready", body), 2000) for _ in range(3)]
        assert sent == [api.SUCCESS, api.SUCCESS, api.RESOURCE_EXHAUSTED]
        assert (
            decode.call("wait", slot=grant["slot"], generation=grant["generation"], timeout_s=5)["message"][
                "request_id"
            ]
            == "q"
        )
        assert backend.engine.send_notify(remote, api.NotifyDesc("kv_ready", body), 2000) == api.SUCCESS
    finally:
        backend.engine.finalize()
