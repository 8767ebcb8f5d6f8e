"""The host engine keeps the HIXL binding's contract (HIXL.md 2.1), on both of its paths.

Two engines in one process: the client maps the server's segments exactly as a process on
the same host would (the shared-memory path), or is told to use TCP. The multi-process
acceptance tests live in tests/integration/test_transfer_processes.py.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Iterator

import pytest

from netutil import free_port
from pdserve_worker.transfer import hixl_api as api
from pdserve_worker.transfer.backends.host.engine import Hixl, get_capability

SIZE = 1 << 16


class Pair:
    """A listening engine with one allocated, registered region, and a client engine."""

    def __init__(self, transport: str, client_options: dict[str, str] | None = None) -> None:
        self.server = Hixl()
        self.remote = f"127.0.0.1:{free_port()}"
        assert self.server.initialize(self.remote) == api.SUCCESS
        status, self.remote_addr = self.server.malloc_mem(SIZE)
        assert status == api.SUCCESS
        status, self.remote_handle = self.server.register_mem(api.MemDesc(self.remote_addr, SIZE), api.MEM_HOST)
        assert status == api.SUCCESS
        self.client = Hixl()
        options = {"pdserve.Transport": transport, **(client_options or {})}
        assert self.client.initialize("127.0.0.1", options) == api.SUCCESS
        # The client's memory is plain ctypes memory, not the engine's: any registered memory works.
        self.local = (ctypes.c_char * SIZE)()
        self.local_addr = ctypes.addressof(self.local)
        status, _ = self.client.register_mem(api.MemDesc(self.local_addr, SIZE), api.MEM_HOST)
        assert status == api.SUCCESS

    def connect(self) -> None:
        assert self.client.connect(self.remote, 2000) == api.SUCCESS

    def remote_bytes(self, offset: int, n: int) -> bytes:
        return ctypes.string_at(self.remote_addr + offset, n)

    def close(self) -> None:
        self.client.finalize()
        self.server.finalize()


@pytest.fixture(params=["auto", "tcp"])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    p = Pair(request.param)
    p.connect()
    assert p.client.link_path(p.remote) == ("shm" if request.param == "auto" else "tcp")
    yield p
    p.close()


def wait_terminal(engine: Hixl, req_id: int, timeout_s: float = 5.0) -> tuple[int, api.TransferStatus]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status, state = engine.get_transfer_status(req_id)
        if state is not api.TransferStatus.WAITING:
            return status, state
        time.sleep(0.001)
    raise AssertionError(f"request {req_id} still WAITING after {timeout_s}s")


def test_write_then_read_moves_the_bytes(pair: Pair) -> None:
    ctypes.memmove(pair.local_addr, b"abcdefgh" * 8, 64)
    ops = [
        api.TransferOpDesc(pair.local_addr, pair.remote_addr + 100, 32),
        api.TransferOpDesc(pair.local_addr + 32, pair.remote_addr + 4000, 32),
    ]
    assert pair.client.transfer_sync(pair.remote, api.WRITE, ops, 2000) == api.SUCCESS
    assert pair.remote_bytes(100, 32) == (b"abcdefgh" * 4)
    assert pair.remote_bytes(4000, 32) == (b"abcdefgh" * 4)
    ctypes.memmove(pair.remote_addr + 500, b"0123456789", 10)
    read = [api.TransferOpDesc(pair.local_addr + 1000, pair.remote_addr + 500, 10)]
    assert pair.client.transfer_sync(pair.remote, api.READ, read, 2000) == api.SUCCESS
    assert ctypes.string_at(pair.local_addr + 1000, 10) == b"0123456789"


def test_ranges_outside_registered_memory_are_param_invalid(pair: Pair) -> None:
    inside = api.TransferOpDesc(pair.local_addr, pair.remote_addr, 16)
    past_remote_end = api.TransferOpDesc(pair.local_addr, pair.remote_addr + SIZE - 8, 16)
    unregistered_local = api.TransferOpDesc(pair.local_addr + SIZE - 8, pair.remote_addr, 16)
    zero_length = api.TransferOpDesc(pair.local_addr, pair.remote_addr, 0)
    for bad in (past_remote_end, unregistered_local, zero_length):
        assert pair.client.transfer_sync(pair.remote, api.WRITE, [inside, bad], 1000) == api.PARAM_INVALID
        assert pair.client.transfer_async(pair.remote, api.WRITE, [bad]) == (api.PARAM_INVALID, 0)
    assert pair.client.transfer_sync(pair.remote, api.WRITE, [], 1000) == api.PARAM_INVALID
    assert pair.client.transfer_sync(pair.remote, api.WRITE, [inside], 0) == api.PARAM_INVALID
    assert pair.client.transfer_sync(pair.remote, 7, [inside], 1000) == api.PARAM_INVALID
    assert pair.client.outstanding() == 0  # nothing refused was left behind


def test_a_batch_of_strided_runs_lands_each_run_and_one_bad_run_refuses_the_batch(pair: Pair) -> None:
    """A TP rank's push is thousands of short runs, each a slice of a wider row on the far
    side; the engine checks such a batch against its extremes at once (host/engine.py
    `_resolve_within`). Every run must land where it says, and one run outside the region, a
    or zero length must still refuse the whole batch."""
    span, row, runs = 4, 16, 512
    ctypes.memmove(pair.local_addr, bytes(range(256)) * 8, span * runs)
    ops = [api.TransferOpDesc(pair.local_addr + i * span, pair.remote_addr + 8 + i * row, span) for i in range(runs)]
    assert pair.client.transfer_sync(pair.remote, api.WRITE, ops, 2000) == api.SUCCESS
    sent = ctypes.string_at(pair.local_addr, span * runs)
    landed = pair.remote_bytes(0, row * runs + 8)
    assert all(landed[8 + i * row : 8 + i * row + span] == sent[i * span : (i + 1) * span] for i in range(runs))
    assert landed[8 + span : 8 + row] == bytes(row - span)  # the rest of each row untouched
    for bad in (
        api.TransferOpDesc(pair.local_addr, pair.remote_addr + SIZE - 2, span),
        api.TransferOpDesc(pair.local_addr, pair.remote_addr, 0),
        api.TransferOpDesc(pair.local_addr, pair.remote_addr - span, span),
    ):
        assert pair.client.transfer_sync(pair.remote, api.WRITE, [*ops, bad], 1000) == api.PARAM_INVALID
    assert pair.client.outstanding() == 0


def test_a_strided_batch_reads_back_and_unequal_runs_in_one_batch_land_too(pair: Pair) -> None:
    """The zero-copy path copies a batch of equal short runs in one numpy pass
    (host/batch_copy.py), both ways; a batch mixing lengths takes the run-by-run loop. Either
    way each run moves exactly its bytes: compared with what the loop of slices would give."""
    span, row, runs = 8, 24, 64
    pattern = bytes((i * 7) % 251 for i in range(row * runs))
    ctypes.memmove(pair.remote_addr + 16, pattern, len(pattern))
    reads = [api.TransferOpDesc(pair.local_addr + i * span, pair.remote_addr + 16 + i * row, span) for i in range(runs)]
    assert pair.client.transfer_sync(pair.remote, api.READ, reads, 2000) == api.SUCCESS
    got = ctypes.string_at(pair.local_addr, span * runs)
    assert got == b"".join(pattern[i * row : i * row + span] for i in range(runs))
    lengths = [1 + (i * 5) % 23 for i in range(runs)]  # unequal: the loop
    starts = [sum(lengths[:i]) for i in range(runs)]
    ctypes.memmove(pair.local_addr, pattern, sum(lengths))
    writes = [
        api.TransferOpDesc(pair.local_addr + a, pair.remote_addr + 8192 + 32 * i, n)
        for i, (a, n) in enumerate(zip(starts, lengths))
    ]
    assert pair.client.transfer_sync(pair.remote, api.WRITE, writes, 2000) == api.SUCCESS
    landed = pair.remote_bytes(8192, 32 * runs)
    assert all(landed[32 * i : 32 * i + n] == pattern[a : a + n] for i, (a, n) in enumerate(zip(starts, lengths)))
    assert all(landed[32 * i + n : 32 * (i + 1)] == bytes(32 - n) for i, n in enumerate(lengths))


def test_a_tcp_request_over_the_frame_limit_is_refused_and_the_link_lives_on() -> None:
    """The server drops a link whose frame declares more than wire.MAX_DESCS_PER_FRAME
    descriptors; the client refuses such a request itself (PARAM_INVALID), so one oversized
    call never costs every other transfer on the link."""
    from pdserve_worker.transfer.backends.host import wire

    p = Pair("tcp")
    try:
        p.connect()
        too_many = [
            api.TransferOpDesc(p.local_addr + i % 64, p.remote_addr + i % 64, 1)
            for i in range(wire.MAX_DESCS_PER_FRAME + 1)
        ]
        assert p.client.transfer_sync(p.remote, api.WRITE, too_many, 2000) == api.PARAM_INVALID
        ctypes.memmove(p.local_addr, b"still-up", 8)
        assert (
            p.client.transfer_sync(p.remote, api.WRITE, [api.TransferOpDesc(p.local_addr, p.remote_addr, 8)], 2000)
            == api.SUCCESS
        )
        assert p.remote_bytes(0, 8) == b"still-up"
    finally:
        p.close()


def test_memory_registered_after_connect_is_not_reachable_over_that_link(pair: Pair) -> None:
    status, late = pair.server.malloc_mem(4096)
    assert status == api.SUCCESS
    assert pair.server.register_mem(api.MemDesc(late, 4096), api.MEM_HOST)[0] == api.SUCCESS
    op = [api.TransferOpDesc(pair.local_addr, late, 64)]
    assert pair.client.transfer_sync(pair.remote, api.WRITE, op, 1000) == api.PARAM_INVALID
    assert pair.client.disconnect(pair.remote) == api.SUCCESS
    pair.connect()  # a new link learns the new region
    assert pair.client.transfer_sync(pair.remote, api.WRITE, op, 1000) == api.SUCCESS


def test_server_refuses_a_write_into_memory_deregistered_after_connect() -> None:
    p = Pair("tcp")
    try:
        p.connect()
        assert p.server.deregister_mem(p.remote_handle) == api.SUCCESS
        op = [api.TransferOpDesc(p.local_addr, p.remote_addr, 64)]
        # The client still believes the region exists; the server checks again and refuses.
        assert p.client.transfer_sync(p.remote, api.WRITE, op, 2000) == api.PARAM_INVALID
        assert p.remote_bytes(0, 64) == bytes(64)
    finally:
        p.close()


def test_terminal_status_is_reported_once(pair: Pair) -> None:
    status, req = pair.client.transfer_async(
        pair.remote, api.WRITE, [api.TransferOpDesc(pair.local_addr, pair.remote_addr, 128)]
    )
    assert status == api.SUCCESS and req != 0
    assert wait_terminal(pair.client, req) == (api.SUCCESS, api.TransferStatus.COMPLETED)
    assert pair.client.get_transfer_status(req) == (api.FAILED, api.TransferStatus.FAILED)
    assert pair.client.get_transfer_status(123456789) == (api.FAILED, api.TransferStatus.FAILED)


def test_resource_exhausted_past_the_outstanding_bound_then_recovers() -> None:
    p = Pair("auto", {"pdserve.MaxOutstandingTransfers": "4"})
    try:
        p.connect()
        op = [api.TransferOpDesc(p.local_addr, p.remote_addr, 64)]
        reqs = [p.client.transfer_async(p.remote, api.WRITE, op) for _ in range(4)]
        assert all(status == api.SUCCESS for status, _ in reqs)
        # Completed but not yet queried still counts, as in HIXL's CS client.
        assert p.client.transfer_async(p.remote, api.WRITE, op) == (api.RESOURCE_EXHAUSTED, 0)
        for _, req in reqs:
            assert wait_terminal(p.client, req)[1] is api.TransferStatus.COMPLETED
        status, req = p.client.transfer_async(p.remote, api.WRITE, op)
        assert status == api.SUCCESS
        assert wait_terminal(p.client, req)[1] is api.TransferStatus.COMPLETED
    finally:
        p.close()


def test_get_all_transfer_status_reports_finished_once_and_echoes_user_data(pair: Pair) -> None:
    op = [api.TransferOpDesc(pair.local_addr, pair.remote_addr, 64)]
    args = api.TransferArgs()
    args.user_data = 77
    _, req = pair.client.transfer_async(pair.remote, api.WRITE, op, args)
    wait_terminal_all = time.monotonic() + 5
    results: list[api.TransferResult] = []
    while time.monotonic() < wait_terminal_all and not results:
        status, results = pair.client.get_all_transfer_status(api.GetTransferStatusArgs(skip_waiting=True))
        assert status == api.SUCCESS
    assert [(r.req, r.user_data, r.status) for r in results] == [(req, 77, api.TransferStatus.COMPLETED)]
    assert pair.client.get_all_transfer_status() == (api.SUCCESS, [])


def test_notifies_go_client_to_server_and_drain(pair: Pair) -> None:
    assert pair.client.send_notify(pair.remote, api.NotifyDesc("kv_ready", "one")) == api.SUCCESS
    assert pair.client.send_notify(pair.remote, api.NotifyDesc("other", "two")) == api.SUCCESS
    status, got = pair.server.get_notifies()
    assert status == api.SUCCESS
    assert [(n.name, n.notify_msg) for n in got] == [("kv_ready", "one"), ("other", "two")]
    assert pair.server.get_notifies() == (api.SUCCESS, [])
    # Server → client is not a thing: the server has no link to its client.
    assert pair.server.send_notify("127.0.0.1", api.NotifyDesc("x", "y")) == api.NOT_CONNECTED
    assert pair.client.send_notify(pair.remote, api.NotifyDesc("x", "y" * 1025)) == api.PARAM_INVALID
    assert pair.client.send_notify(pair.remote, api.NotifyDesc("x", "y"), 0) == api.PARAM_INVALID


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_notify_queue_is_bounded_and_recovers_after_draining(transport: str) -> None:
    p = Pair(transport)
    p.server.finalize()
    p.server = Hixl()
    assert p.server.initialize(p.remote, {"pdserve.NotifyQueueSize": "3"}) == api.SUCCESS
    try:
        p.connect()
        statuses = [p.client.send_notify(p.remote, api.NotifyDesc("n", str(i))) for i in range(40)]
        accepted = statuses.count(api.SUCCESS)
        assert statuses == [api.SUCCESS] * accepted + [api.RESOURCE_EXHAUSTED] * (40 - accepted)
        if transport == "tcp":
            assert accepted == 3
        else:  # on this host the inbox's kernel datagram queue holds a few more in flight
            with open("/proc/sys/net/unix/max_dgram_qlen") as f:
                assert 3 < accepted <= 3 + int(f.read()) + 1
        got = p.server.get_notifies()[1]
        assert sorted(int(n.notify_msg) for n in got) == list(range(accepted))  # none lost
        assert p.client.send_notify(p.remote, api.NotifyDesc("n", "again")) == api.SUCCESS
        assert [n.notify_msg for n in p.server.get_notifies()[1]] == ["again"]
    finally:
        p.close()


def test_wait_notifies_blocks_until_a_notify_arrives(pair: Pair) -> None:
    t0 = time.monotonic()
    assert pair.server.wait_notifies(0.05) == (api.TIMEOUT, [])
    assert time.monotonic() - t0 >= 0.045
    result: list[tuple[int, list[api.NotifyDesc]]] = []
    waiter = threading.Thread(target=lambda: result.append(pair.server.wait_notifies(5.0)))
    waiter.start()
    time.sleep(0.05)
    assert waiter.is_alive()  # still blocked: nothing was sent
    assert pair.client.send_notify(pair.remote, api.NotifyDesc("kv_ready", "go")) == api.SUCCESS
    waiter.join(5.0)
    assert result and result[0][0] == api.SUCCESS
    assert [n.notify_msg for n in result[0][1]] == ["go"]


def test_connection_rules() -> None:
    p = Pair("auto")
    try:
        assert (
            p.client.transfer_sync(p.remote, api.WRITE, [api.TransferOpDesc(p.local_addr, p.remote_addr, 8)])
            == api.NOT_CONNECTED
        )
        assert p.client.disconnect(p.remote) == api.NOT_CONNECTED
        p.connect()
        assert p.client.connect(p.remote) == api.ALREADY_CONNECTED
        assert p.client.connect(f"127.0.0.1:{free_port()}", 200) == api.TIMEOUT  # nobody listens
        assert p.client.connect("127.0.0.1", 200) == api.PARAM_INVALID  # no port: not a server
        assert p.client.connect(p.remote, 0) == api.PARAM_INVALID
        assert p.client.disconnect(p.remote) == api.SUCCESS
        assert p.client.disconnect(p.remote) == api.NOT_CONNECTED
    finally:
        p.close()


def test_async_connect_reports_progress() -> None:
    p = Pair("auto")
    try:
        assert p.client.get_async_connect_status(p.remote) == (api.SUCCESS, api.AsyncConnectStatus.NOT_CONNECT)
        assert p.client.connect_async(p.remote, 2000) == api.SUCCESS
        deadline = time.monotonic() + 5
        while p.client.get_async_connect_status(p.remote)[1] is not api.AsyncConnectStatus.CONNECTED:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert p.client.get_all_async_connect_status() == (api.SUCCESS, {p.remote: api.AsyncConnectStatus.CONNECTED})
        assert p.client.connect_async(p.remote, 0) == api.PARAM_INVALID
    finally:
        p.close()


def test_registration_rules_and_calls_before_initialize() -> None:
    engine = Hixl()
    assert engine.register_mem(api.MemDesc(4096, 16), api.MEM_HOST) == (api.FAILED, 0)
    assert engine.get_transfer_status(1) == (api.FAILED, api.TransferStatus.FAILED)
    assert engine.initialize("127.0.0.1", {"pdserve.Transport": "carrier-pigeon"}) == api.PARAM_INVALID
    assert engine.initialize("127.0.0.1") == api.SUCCESS
    assert engine.initialize("127.0.0.1") == api.SUCCESS  # repeated: SUCCESS, like the binding
    try:
        buf = (ctypes.c_char * 64)()
        desc = api.MemDesc(ctypes.addressof(buf), 64)
        status, handle = engine.register_mem(desc, api.MEM_HOST)
        assert status == api.SUCCESS and handle
        assert engine.register_mem(desc, api.MEM_HOST) == (api.SUCCESS, handle)  # idempotent
        assert engine.register_mem(api.MemDesc(0, 64), api.MEM_HOST)[0] == api.PARAM_INVALID
        assert engine.deregister_mem(handle) == api.SUCCESS
        assert engine.deregister_mem(handle) == api.SUCCESS  # repeated / unknown: SUCCESS
        assert engine.deregister_mem(0) == api.PARAM_INVALID
        assert engine.malloc_mem(64, api.MEM_DEVICE) == (api.UNSUPPORTED, 0)
        assert engine.free_mem(12345) == api.PARAM_INVALID
    finally:
        engine.finalize()


def test_a_bug_inside_a_call_becomes_failed_not_an_exception(pair: Pair) -> None:
    class Broken:
        @property
        def local_addr(self) -> int:
            raise RuntimeError("boom")

    assert pair.client.transfer_sync(pair.remote, api.WRITE, [Broken()], 1000) == api.FAILED


def test_capabilities() -> None:
    assert get_capability(api.FeatureType.AUTO_CONNECT) == (api.SUCCESS, api.FEATURE_SUPPORTED)
    assert get_capability(api.FeatureType.CLIENT_SERVER_COMM) == (api.SUCCESS, api.FEATURE_NOT_SUPPORTED)
    assert get_capability(99) == (api.SUCCESS, api.FEATURE_NOT_SUPPORTED)


def test_auto_connect_links_on_first_transfer() -> None:
    p = Pair("auto", {api.OPTION_AUTO_CONNECT: "1"})
    try:
        op = [api.TransferOpDesc(p.local_addr, p.remote_addr, 8)]
        assert p.client.transfer_sync(p.remote, api.WRITE, op, 2000) == api.SUCCESS
        assert p.client.link_path(p.remote) == "shm"
    finally:
        p.close()


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_requests_handed_to_the_engines_threads_complete(transport: str) -> None:
    # Inline limits 0: every async copy goes to a copy thread, every TCP frame to the sender.
    p = Pair(transport, {"pdserve.InlineCopyMaxBytes": "0", "pdserve.InlineSendMaxBytes": "0"})
    try:
        p.connect()
        ctypes.memmove(p.local_addr, bytes(range(256)) * 64, 16384)
        writes = [api.TransferOpDesc(p.local_addr + i * 4096, p.remote_addr + 8192 * i, 4096) for i in range(4)]
        status, req = p.client.transfer_async(p.remote, api.WRITE, writes)
        assert status == api.SUCCESS
        assert wait_terminal(p.client, req) == (api.SUCCESS, api.TransferStatus.COMPLETED)
        for i in range(4):
            assert p.remote_bytes(8192 * i, 4096) == ctypes.string_at(p.local_addr + i * 4096, 4096)
        reads = [api.TransferOpDesc(p.local_addr + 32768 + 4096 * i, p.remote_addr + 8192 * i, 4096) for i in range(4)]
        status, req = p.client.transfer_async(p.remote, api.READ, reads)
        assert wait_terminal(p.client, req)[1] is api.TransferStatus.COMPLETED
        assert ctypes.string_at(p.local_addr + 32768, 16384) == ctypes.string_at(p.local_addr, 16384)
        assert p.client.transfer_sync(p.remote, api.WRITE, writes[:1], 2000) == api.SUCCESS
    finally:
        p.close()


def test_a_lost_server_fails_the_link_and_a_new_one_can_be_reached() -> None:
    p = Pair("tcp")
    try:
        p.connect()
        p.server.finalize()  # the decode process went away
        op = [api.TransferOpDesc(p.local_addr, p.remote_addr, 64)]
        deadline = time.monotonic() + 5
        while p.client.link_path(p.remote) is not None and time.monotonic() < deadline:
            p.client.transfer_sync(p.remote, api.WRITE, op, 500)  # fails; the reader notices
            time.sleep(0.01)
        assert p.client.transfer_sync(p.remote, api.WRITE, op, 500) == api.NOT_CONNECTED
        p.server = Hixl()
        assert p.server.initialize(p.remote) == api.SUCCESS  # restarted on the same address
        status, p.remote_addr = p.server.malloc_mem(SIZE)
        assert p.server.register_mem(api.MemDesc(p.remote_addr, SIZE), api.MEM_HOST)[0] == api.SUCCESS
        assert p.client.connect(p.remote, 2000) == api.SUCCESS  # the broken link is replaced
        op = [api.TransferOpDesc(p.local_addr, p.remote_addr, 64)]
        assert p.client.transfer_sync(p.remote, api.WRITE, op, 2000) == api.SUCCESS
    finally:
        p.close()


# ---- who may use a link, and for what (transfer/backends/host/server.py's policy) ------------------------------------
KEY_A, KEY_B = "a1" * 32, "b2" * 32


@pytest.mark.parametrize(
    "server_key,client_key,ok",
    [
        (KEY_A, KEY_A, True),
        (KEY_A, KEY_B, False),
        (KEY_A, None, False),
        (None, KEY_A, False),
        (None, None, True),
    ],
    ids=["same-key", "other-key", "keyless-client", "keyless-server", "no-auth-like-hixl"],
)
@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_a_link_needs_the_same_key_on_both_ends(
    transport: str, server_key: str | None, client_key: str | None, ok: bool
) -> None:
    server = Hixl()
    remote = f"127.0.0.1:{free_port()}"
    assert server.initialize(remote, {"pdserve.AuthKey": server_key} if server_key else {}) == api.SUCCESS
    client = Hixl()
    options = {"pdserve.Transport": transport} | ({"pdserve.AuthKey": client_key} if client_key else {})
    assert client.initialize("127.0.0.1", options) == api.SUCCESS
    try:
        assert client.connect(remote, 2000) == (api.SUCCESS if ok else api.FAILED)
        assert (client.link_path(remote) is not None) is ok
        if server_key:
            assert server.security_stats().get("auth_failed", 0) == (0 if ok or client_key is None else 1)
    finally:
        client.finalize()
        server.finalize()


def test_leased_mode_writes_only_leased_ranges_and_read_can_be_off() -> None:
    p = Pair("tcp")
    p.server.finalize()
    p.server = Hixl()
    assert p.server.initialize(p.remote, {"pdserve.RemoteWrite": "leased", "pdserve.RemoteRead": "0"}) == api.SUCCESS
    status, p.remote_addr = p.server.malloc_mem(SIZE)
    assert p.server.register_mem(api.MemDesc(p.remote_addr, SIZE), api.MEM_HOST)[0] == api.SUCCESS
    try:
        p.connect()
        op = [api.TransferOpDesc(p.local_addr, p.remote_addr + 128, 64)]
        assert p.client.transfer_sync(p.remote, api.WRITE, op, 2000) == api.PARAM_INVALID
        status, lease = p.server.lease_write(p.remote_addr + 128, 64)
        assert status == api.SUCCESS
        assert p.client.transfer_sync(p.remote, api.WRITE, op, 2000) == api.SUCCESS
        assert p.client.transfer_sync(p.remote, api.READ, op, 2000) == api.PARAM_INVALID
        wide = [api.TransferOpDesc(p.local_addr, p.remote_addr + 128, 65)]
        assert p.client.transfer_sync(p.remote, api.WRITE, wide, 2000) == api.PARAM_INVALID
        assert p.server.revoke_write(lease) == api.SUCCESS
        assert p.server.revoke_write(lease) == api.SUCCESS  # repeated: SUCCESS, like deregister_mem
        assert p.client.transfer_sync(p.remote, api.WRITE, op, 2000) == api.PARAM_INVALID
        stats = p.server.security_stats()
        assert (stats["write_not_leased"], stats["read_disabled"], stats["write_leases"]) == (3, 1, 0)
        assert p.server.lease_write(p.remote_addr + SIZE - 8, 16) == (api.PARAM_INVALID, 0)  # not registered
    finally:
        p.close()


@pytest.mark.parametrize(
    "options",
    [
        {"pdserve.RemoteWrite": "everything"},
        {"pdserve.RemoteRead": "yes"},
        {"pdserve.AuthKey": "abc"},
        {"pdserve.AuthKey": "ab" * 4},
        {"pdserve.MaxLinks": "0"},
        {"pdserve.HandshakeTimeoutMs": "-1"},
    ],
)
def test_bad_access_options_are_refused_at_initialize(options: dict[str, str]) -> None:
    engine = Hixl()
    assert engine.initialize(f"127.0.0.1:{free_port()}", options) == api.PARAM_INVALID


def test_the_key_never_shows_in_the_options_repr() -> None:
    from pdserve_worker.transfer.backends.host.options import HostEngineOptions

    parsed = HostEngineOptions.parse({"pdserve.AuthKey": KEY_A})
    assert parsed.auth_key == bytes.fromhex(KEY_A)
    assert KEY_A not in repr(parsed) and KEY_A not in repr(parsed.server_policy())


def test_an_authenticated_engines_inbox_takes_datagrams_only_from_its_own_user() -> None:
    """The kernel's credentials on each datagram decide (SO_PASSCRED): the inbox is told it
    runs as another uid, so this process's datagrams are a stranger's and are dropped."""
    import socket

    from pdserve_worker.transfer.backends.host import wire
    from pdserve_worker.transfer.backends.host.notify_inbox import NotifyInbox, abstract

    frame = wire.notify_frame(b"kv_ready{}", 8)
    for check, kept in ((True, 1), (False, 1)):
        inbox = NotifyInbox(8, check_sender=check)
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(abstract(inbox.name))
            sock.send(frame)
            assert len(inbox.drain()) == kept  # our own uid: kept
            inbox._uid += 1
            sock.send(frame)
            assert len(inbox.drain()) == (0 if check else 1)
        assert inbox.drops.totals() == ({"other_user": 1} if check else {})
        inbox.close()
