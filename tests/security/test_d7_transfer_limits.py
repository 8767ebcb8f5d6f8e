"""D7: what one peer can make a transfer server spend is bounded.

Before: no connection cap, no handshake timeout, a 24-byte header made the server allocate
4 MiB, one 64 KiB READ frame asked for 16 GiB. Each attack here runs against the host
engine's server in its own process (a stand-in decode with the worker's options, some limits
turned down so the test is quick) and checks the bound, and that the server still serves.
"""

from __future__ import annotations

import ctypes
import time

import pytest

from pdserve_worker.transfer import hixl_api as api
from pdserve_worker.transfer.backends.host import wire
from pdserve_worker.transfer.registry import create_engine
from security.conftest import KEY
from support import attacker

pytestmark = [pytest.mark.slow, pytest.mark.timing]


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def legit_connect(engine_id: str) -> int:
    backend = create_engine("cpu")
    assert backend.engine.initialize("127.0.0.1", {"pdserve.AuthKey": KEY.hex(), "pdserve.Transport": "tcp"}) == 0
    try:
        return backend.engine.connect(engine_id, 2000)
    finally:
        backend.engine.finalize()


def test_connections_beyond_the_cap_are_closed_at_once_and_idle_ones_time_out(decode_peer) -> None:
    decode = decode_peer(**{"pdserve.MaxLinks": "8", "pdserve.HandshakeTimeoutMs": "1500"})
    engine_id = decode.info["engine_id"]
    # Fill every place, say nothing: from addresses of their own each (one address holds at
    # most 4 handshakes, test_transfer_accept.py), so the cap, not a share, is what fills.
    idle = [attacker.connect(engine_id, source=f"127.0.0.{10 + i}") for i in range(8)]
    time.sleep(0.2)
    started = time.monotonic()
    # Each newcomer cuts the oldest silent handshake (review of issue 13: refusing the newest
    # let 8 squatters, renewed at each deadline, keep every genuine peer out).
    extra = [attacker.connect(engine_id, source=f"127.0.0.{30 + i}") for i in range(20)]
    for sock in idle + extra[:12]:  # the 20 oldest are cut at once, not at their deadline
        assert attacker.recv_all_until_close(sock, timeout_s=2) == b""
        sock.close()
    assert time.monotonic() - started < 1.2
    assert legit_connect(engine_id) == api.SUCCESS  # a genuine peer gets in while they squat
    for sock in extra[12:]:  # the rest: cut by the genuine peer, or at their deadline
        assert attacker.recv_all_until_close(sock, timeout_s=4) == b""
        sock.close()
    stats = decode.call("security")
    assert stats["handshake_evicted"] >= 21 and stats.get("handshake_timeout", 0) <= 7, stats
    assert stats["handshakes_pending"] == 0
    # Authenticated links count against the cap too: a ninth is refused, until one leaves.
    links = []
    for _ in range(8):  # one after the other: an address's handshakes at once are capped at 8
        links.append(attacker.connect(engine_id))
        attacker.authenticate(links[-1], KEY)
    assert legit_connect(engine_id) == api.FAILED
    links.pop().close()
    time.sleep(0.2)
    assert legit_connect(engine_id) == api.SUCCESS
    for sock in links:
        sock.close()


def test_a_trickled_handshake_is_cut_at_its_deadline(decode_peer) -> None:
    """Slowloris: one byte every 100 ms keeps each recv busy, not the handshake alive."""
    decode = decode_peer(**{"pdserve.HandshakeTimeoutMs": "500"})
    frame = wire.json_frame(wire.Kind.HELLO, {"v": 1, "nonce": "ab" * 32})
    started = time.monotonic()
    with attacker.connect(decode.info["engine_id"]) as sock:
        try:
            for byte in frame:
                sock.sendall(bytes([byte]))
                time.sleep(0.1)
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert attacker.recv_all_until_close(sock, timeout_s=3) == b""
    assert time.monotonic() - started < 2.0 < len(frame) * 0.1
    assert decode.call("security")["handshake_timeout"] == 1


@pytest.mark.parametrize("size", [4 << 20, 1 << 30, (1 << 64) - 1])
def test_an_unauthenticated_header_allocates_nothing(decode_peer, size: int) -> None:
    """A HELLO that declares a huge body is refused before a byte of it is read: 64 of them
    leave the server's memory where it was (before: 4 MiB allocated for each)."""
    decode = decode_peer()
    pid = decode.info["pid"]
    for _ in range(3):  # warm up whatever a first connection costs
        with attacker.connect(decode.info["engine_id"]) as sock:
            sock.sendall(wire.header(wire.Kind.HELLO, 0, 0, 16))
    before = rss_kib(pid)
    for _ in range(64):
        with attacker.connect(decode.info["engine_id"]) as sock:
            sock.sendall(wire.header(wire.Kind.HELLO, 0, 0, size) + b"x" * 1000)
            assert attacker.recv_all_until_close(sock) == b""
    assert rss_kib(pid) - before < 8 << 10, (before, rss_kib(pid))
    assert decode.call("security")["handshake_invalid"] >= 64
    assert legit_connect(decode.info["engine_id"]) == api.SUCCESS


def test_a_read_frame_cannot_ask_for_more_than_the_cap(decode_peer) -> None:
    """With READ on (a pull mode), one frame's answer is capped: 16384 descriptors over the
    whole pool (512 MiB asked in a 256 KiB frame) get PARAM_INVALID and not a byte; the link
    goes on serving reads within the cap."""
    decode = decode_peer(**{"pdserve.RemoteRead": "1"})
    base, pool = decode.info["base_addr"], decode.info["layout"].total_bytes
    with attacker.connect(decode.info["engine_id"]) as sock:
        attacker.authenticate(sock, KEY)
        sock.sendall(attacker.read_request([(base, pool)] * 16384, seq=1))
        assert attacker.ack(sock) == (api.PARAM_INVALID, 0)
        sock.sendall(attacker.read_request([(base, 64)], seq=2))
        status, size = attacker.ack(sock)
        assert (status, size) == (api.SUCCESS, 64)
        assert len(attacker._exactly(sock, 64)) == 64
    assert decode.call("security")["read_too_big"] == 1
    # The client side refuses such a request before it sends anything.
    backend = create_engine("cpu")
    assert backend.engine.initialize("127.0.0.1", {"pdserve.AuthKey": KEY.hex(), "pdserve.Transport": "tcp"}) == 0
    try:
        local = (ctypes.c_char * 64)()
        addr = ctypes.addressof(local)
        assert backend.engine.register_mem(api.MemDesc(addr, 64), api.MEM_HOST)[0] == api.SUCCESS
        assert backend.engine.connect(decode.info["engine_id"], 2000) == api.SUCCESS
        descs = [api.TransferOpDesc(addr, base, 64)] * ((wire.MAX_READ_BYTES // 64) + 1)
        assert (
            backend.engine.transfer_sync(decode.info["engine_id"], api.TransferOp.READ, descs, 5000)
            == api.PARAM_INVALID
        )
    finally:
        backend.engine.finalize()


@pytest.mark.parametrize(
    "frame",
    [
        wire.header(wire.Kind.NOTIFY, 8, 1, 1 << 30),  # a notify body of 1 GiB
        wire.header(wire.Kind.WRITE, 1, 1, 1 << 50),  # a write payload of 1 PiB
        wire.header(wire.Kind.WRITE, 1 << 20, 1, 0),  # a million descriptors
        wire.header(wire.Kind.HELLO_ACK, 0, 1, 0),  # a server's frame from a client
    ],
    ids=["notify-1GiB", "write-1PiB", "descs-1M", "wrong-kind"],
)
def test_oversized_or_wrong_frames_drop_the_link_without_allocating(decode_peer, frame: bytes) -> None:
    """Even an authenticated peer (the key holder) cannot make the server allocate from a
    header: the caps are checked before anything is read, and the link is dropped."""
    decode = decode_peer()
    pid = decode.info["pid"]
    before = rss_kib(pid)
    for _ in range(8):
        with attacker.connect(decode.info["engine_id"]) as sock:
            attacker.authenticate(sock, KEY)
            sock.sendall(frame)
            assert attacker.recv_all_until_close(sock) == b""
    assert rss_kib(pid) - before < 8 << 10
    assert legit_connect(decode.info["engine_id"]) == api.SUCCESS
