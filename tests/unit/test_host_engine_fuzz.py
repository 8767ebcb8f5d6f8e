"""Property: arbitrary transfer descriptors never crash the host engine or its server.

Whatever addresses and lengths a caller hands `transfer_sync`, the answer is SUCCESS exactly
when every op lies inside registered memory on both sides (and has bytes to move), else
PARAM_INVALID; nothing is left outstanding, and the link still moves bytes afterwards.
"""

from __future__ import annotations

import ctypes
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_host_engine import SIZE, Pair

from pdserve_worker.transfer import hixl_api as api

U64 = (1 << 64) - 1


def _address(base_of: str) -> st.SearchStrategy[tuple[str, int]]:
    """An address near a region (edges included) or anywhere in the 64-bit space."""
    near = st.tuples(st.just(base_of), st.integers(-SIZE, 2 * SIZE))
    anywhere = st.tuples(st.just("abs"), st.integers(0, U64))
    return st.one_of(near, near, anywhere)


op = st.tuples(_address("local"), _address("remote"), st.one_of(st.integers(0, 2 * SIZE), st.integers(0, U64)))


def _resolve(pair: Pair, where: tuple[str, int]) -> int:
    kind, value = where
    base = {"local": pair.local_addr, "remote": pair.remote_addr, "abs": 0}[kind]
    return min(max(base + value, 0), U64)


def _inside(addr: int, length: int, base: int) -> bool:
    return length > 0 and base <= addr and addr + length <= base + SIZE


@pytest.fixture(scope="module", params=["auto", "tcp"])
def linked(request: pytest.FixtureRequest):
    p = Pair(request.param)
    p.connect()
    yield p
    p.close()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(op, min_size=1, max_size=4), write=st.booleans())
def test_arbitrary_descriptors_are_served_or_refused_never_crash(linked: Pair, ops, write: bool) -> None:
    descs, valid = [], True
    for local, remote, length in ops:
        la, ra = _resolve(linked, local), _resolve(linked, remote)
        length = min(length, U64)
        descs.append(api.TransferOpDesc(la, ra, length))
        valid = valid and _inside(la, length, linked.local_addr) and _inside(ra, length, linked.remote_addr)
    status = linked.client.transfer_sync(linked.remote, api.WRITE if write else api.READ, descs, 2000)
    assert status == (api.SUCCESS if valid else api.PARAM_INVALID), (descs, status)
    assert linked.client.outstanding() == 0
    # The engine and its server are still whole: a plain write goes through.
    ctypes.memmove(linked.local_addr, b"still-ok", 8)
    probe = [api.TransferOpDesc(linked.local_addr, linked.remote_addr + SIZE - 8, 8)]
    assert linked.client.transfer_sync(linked.remote, api.WRITE, probe, 2000) == api.SUCCESS
    assert linked.remote_bytes(SIZE - 8, 8) == b"still-ok"


# ---- the wire itself: whatever bytes a peer sends ------------------------------------------------
#
# An engine listening with the service key, leased writes and READ on (the most to attack),
# and a short handshake deadline. Each example opens a connection, optionally passes the
# handshake (an insider), sends a sequence of frames built from arbitrary kinds, arguments,
# sizes and bodies, and half-closes. The server must close the connection within a bound (no
# hang), allocate only bounded memory (tracemalloc's peak), never hit an unexpected exception
# (a `link_failed` ERROR log), and still serve a genuine client afterwards.

import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import socket  # noqa: E402
import tracemalloc  # noqa: E402

from netutil import free_port  # noqa: E402
from pdserve_worker.transfer.backends.host import link_auth, wire  # noqa: E402
from pdserve_worker.transfer.backends.host.engine import Hixl  # noqa: E402

KEY = os.urandom(32)
# What one connection may make the server allocate, at most: before the handshake, nothing
# beyond its fixed 64 KiB read buffer; after it, a frame of 65536 descriptors (1 MiB on the
# wire, a few MiB as Python tuples).
ALLOC_BOUND = {False: 256 << 10, True: 16 << 20}
CLOSE_BOUND_S = 3.0

sizes = st.one_of(
    st.integers(0, 64),
    st.integers(64 << 10, 8 << 20),  # bigger than the read buffer, small enough to be believed
    st.sampled_from(
        [
            wire.MAX_HANDSHAKE_BODY,
            wire.MAX_HANDSHAKE_BODY + 1,
            wire.MAX_NOTIFY_BODY,
            wire.MAX_NOTIFY_BODY + 1,
            wire.MAX_CONTROL_BODY,
            wire.MAX_READ_BYTES + 1,
            SIZE,
            1 << 40,
            U64,
        ]
    ),
    st.integers(0, U64),
)
# Sizes a header may claim: each cap and one past it, the read buffer, and absurd ones.
CLAIMED_SIZES = [
    wire.MAX_HANDSHAKE_BODY,
    wire.MAX_HANDSHAKE_BODY + 1,
    wire.MAX_NOTIFY_BODY,
    wire.MAX_NOTIFY_BODY + 1,
    (64 << 10) + 1,
    1 << 20,
    wire.MAX_CONTROL_BODY,
    wire.MAX_READ_BYTES + 1,
    1 << 40,
    U64,
]
_valid_kinds = st.sampled_from([int(k) for k in wire.Kind])
kinds = st.one_of(_valid_kinds, _valid_kinds, _valid_kinds, st.integers(0, 255))  # mostly frames the server parses


# A frame as drawn: (kind, arg, seq, size, body kind, body bytes, descriptor offsets, truthful size).
frame_spec = st.tuples(
    kinds,
    st.one_of(st.integers(0, 4), st.integers(0, (1 << 32) - 1)),
    st.integers(0, U64),
    sizes,
    st.sampled_from(["none", "bytes", "descs", "json"]),
    st.binary(max_size=256),
    st.lists(st.tuples(st.integers(-64, SIZE + 64), st.integers(0, 2 * SIZE)), max_size=4),
    st.booleans(),
)


def build(spec: tuple, base: int) -> bytes:
    kind, arg, seq, size, body_kind, raw, descs, truthful = spec
    if body_kind == "bytes":
        body = raw
    elif body_kind == "descs":
        body = wire.pack_descs([((base + off) % (U64 + 1), n) for off, n in descs]) + raw[:64]
    elif body_kind == "json":
        body = json.dumps({"v": 1, "nonce": raw[:32].hex(), "client": raw[:8].hex(), "proof": raw.hex()}).encode()
    else:
        body = b""
    return wire.HEADER.pack(kind, arg, seq, len(body) if truthful else size) + body


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class WireTarget:
    def __init__(self) -> None:
        self.server = Hixl()
        self.engine_id = f"127.0.0.1:{free_port()}"
        options = {
            "pdserve.AuthKey": KEY.hex(),
            "pdserve.RemoteWrite": "leased",
            "pdserve.RemoteRead": "1",
            "pdserve.HandshakeTimeoutMs": "500",
            "pdserve.MaxLinks": "16",
        }
        assert self.server.initialize(self.engine_id, options) == api.SUCCESS
        status, self.base = self.server.malloc_mem(SIZE)
        assert status == api.SUCCESS
        assert self.server.register_mem(api.MemDesc(self.base, SIZE), api.MEM_HOST)[0] == api.SUCCESS
        assert self.server.lease_write(self.base, SIZE // 2)[0] == api.SUCCESS
        self.client = Hixl()
        assert self.client.initialize("127.0.0.1", {"pdserve.AuthKey": KEY.hex(), "pdserve.Transport": "tcp"}) == 0
        self.local = (ctypes.c_char * 64)()
        assert self.client.register_mem(api.MemDesc(ctypes.addressof(self.local), 64), api.MEM_HOST)[0] == 0
        self.errors = _Errors()
        logging.getLogger("pdserve_worker.transfer").addHandler(self.errors)

    def still_serves(self, tag: bytes) -> None:
        self.client.disconnect(self.engine_id, 1000)
        assert self.client.connect(self.engine_id, 2000) == api.SUCCESS
        ctypes.memmove(ctypes.addressof(self.local), tag.ljust(64, b"."), 64)
        op = [api.TransferOpDesc(ctypes.addressof(self.local), self.base, 64)]
        assert self.client.transfer_sync(self.engine_id, api.WRITE, op, 2000) == api.SUCCESS
        assert ctypes.string_at(self.base, 64) == tag.ljust(64, b".")

    def close(self) -> None:
        logging.getLogger("pdserve_worker.transfer").removeHandler(self.errors)
        self.client.finalize()
        self.server.finalize()


@pytest.fixture(scope="module")
def wire_target():
    target = WireTarget()
    yield target
    target.close()


def _authenticate(sock: socket.socket) -> None:
    nonce = os.urandom(link_auth.NONCE_BYTES)
    sock.sendall(wire.json_frame(wire.Kind.HELLO, {"v": 1, "nonce": nonce.hex()}))
    reader = wire.FrameReader(sock)
    kind, _, _, size = reader.header()
    server_nonce = bytes.fromhex(str(reader.json(size)["nonce"]))
    proof = link_auth.client_proof(KEY, nonce, server_nonce, "fuzz", "elsewhere")
    sock.sendall(wire.json_frame(wire.Kind.AUTH, {"client": "fuzz", "host": "elsewhere", "proof": proof}))
    kind, _, _, size = reader.header()
    assert kind is wire.Kind.HELLO_ACK
    reader.json(size)


# Hypothesis favours simple draws, so the first frame's kind and whether the peer passed the
# handshake are parameters: every kind is sent first, both before and after authentication.
@pytest.mark.parametrize("insider", [False, True], ids=["stranger", "insider"])
@pytest.mark.parametrize("first_kind", [int(k) for k in wire.Kind] + [0, 200], ids=lambda k: f"kind{k}")
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    first=frame_spec,
    first_size=st.one_of(st.none(), st.sampled_from(CLAIMED_SIZES)),
    rest=st.lists(frame_spec, max_size=3),
)
def test_arbitrary_frames_never_crash_hang_or_balloon_the_server(
    wire_target: WireTarget, first_kind: int, insider: bool, first, first_size, rest
) -> None:
    kind, arg, seq, size, body_kind, raw, descs, truthful = first
    if first_size is not None:  # the first frame claims a size the body does not have
        size, truthful, arg = first_size, False, min(arg, first_size)
    first = (first_kind, arg, seq, size, body_kind, raw, descs, truthful)
    frames = [build(first, wire_target.base)] + [build(spec, wire_target.base) for spec in rest]
    tracemalloc.start()
    baseline = tracemalloc.get_traced_memory()[0]
    host, port = wire_target.engine_id.split(":")
    with socket.create_connection((host, int(port)), timeout=CLOSE_BOUND_S) as sock:
        if insider:
            _authenticate(sock)
        try:
            for f in frames:
                sock.sendall(f)
            sock.shutdown(socket.SHUT_WR)
        except OSError:  # the server already closed it (broken pipe, reset, not connected)
            pass
        deadline = time.monotonic() + CLOSE_BOUND_S
        while True:  # whatever it answers, it must end the connection in time
            assert time.monotonic() < deadline, "the server kept a finished connection open"
            try:
                if not sock.recv(1 << 16):
                    break
            except ConnectionResetError:
                break
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak - baseline < ALLOC_BOUND[insider], (peak - baseline, insider)
    assert not wire_target.errors.records, [r.getMessage() for r in wire_target.errors.records]
    wire_target.still_serves(os.urandom(8).hex().encode())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.lists(st.one_of(st.binary(max_size=300), frame_spec), min_size=1, max_size=8))
def test_arbitrary_datagrams_into_the_notify_inbox_yield_only_wellformed_notifies(
    wire_target: WireTarget, raw: list
) -> None:
    datagrams = [d if isinstance(d, bytes) else build(d, 0) for d in raw]
    from pdserve_worker.transfer.backends.host.notify_inbox import abstract

    name = wire_target.server._notifies.name  # the inbox a same-host client is told of after auth
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.connect(abstract(name))
        for d in datagrams:
            try:
                sock.send(d, socket.MSG_DONTWAIT)
            except (BlockingIOError, OSError):
                pass
    status, got = wire_target.server.get_notifies()
    assert status == api.SUCCESS
    for n in got:
        assert isinstance(n.name, str) and isinstance(n.notify_msg, str)
        assert len(n.name) <= api.MAX_NOTIFY_FIELD and len(n.notify_msg) <= api.MAX_NOTIFY_FIELD
