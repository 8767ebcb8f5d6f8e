"""The soak's fault-injecting proxy (tests/support/fault_proxy.py) does what it says: forwards,
delays, stalls then delivers everything, resets connections with RST, and flips only bytes of
WRITE payload however the stream is cut into reads."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest

from support import netns_links
from support.fault_proxy import FaultProxy, WritePayloads


@pytest.fixture
def echo() -> Iterator[tuple[str, int]]:
    """An echo server on 127.0.0.1 (a free port), stopped by the test."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            try:
                while data := conn.recv(65536):
                    conn.sendall(data)
            except ConnectionResetError:
                return  # what a reset does to the upstream side too

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[:2]
    stop.set()
    thread.join()
    server.close()


def round_trip(sock: socket.socket, payload: bytes) -> tuple[bytes, float]:
    started = time.monotonic()
    sock.sendall(payload)
    got = b""
    while len(got) < len(payload):
        chunk = sock.recv(65536)
        if not chunk:
            break
        got += chunk
    return got, time.monotonic() - started


def test_forwards_delays_stalls_and_resets(echo: tuple[str, int]) -> None:
    with FaultProxy() as proxy:
        addr = proxy.link("decode-0", ("127.0.0.1", 0), echo)
        with socket.create_connection(addr, timeout=5) as sock:
            got, fast = round_trip(sock, b"x" * 1000)
            assert got == b"x" * 1000

            proxy.delay("decode-0", ms=150, seconds=5)
            got, slow = round_trip(sock, b"hello")
            assert got == b"hello" and slow >= 0.3 > fast  # 150 ms each way

            proxy.delay("decode-0", ms=0, seconds=0)
            proxy.stall("decode-0", seconds=0.6)
            got, stalled = round_trip(sock, b"held, not lost")
            assert got == b"held, not lost" and stalled >= 0.5  # silence, then everything

            assert proxy.reset("decode-0") == 1
            with pytest.raises(ConnectionResetError):
                sock.sendall(b"after the reset")
                if not sock.recv(10):
                    raise AssertionError("an orderly close, not a reset")
        counters = proxy.counters()["decode-0"]
        assert counters["connections"] == 1 and counters["resets"] == 1 and counters["bytes"] >= 2000


def test_an_upstream_that_refuses_is_a_reset_for_the_client() -> None:
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()  # nothing listens there now
    with FaultProxy() as proxy:
        addr = proxy.link("gone", ("127.0.0.1", 0), ("127.0.0.1", port))
        # The reset may reach the client while its connect completes (a loaded machine) or at
        # its first read: either way a reset, never an orderly close.
        with pytest.raises(ConnectionResetError):
            with socket.create_connection(addr, timeout=5) as sock:
                if not sock.recv(10):
                    raise AssertionError("an orderly close, not a reset")


@pytest.mark.skipif(netns_links.available() is not None, reason=str(netns_links.available()))
def test_a_veth_partition_silences_the_link_until_it_heals(echo: tuple[str, int]) -> None:
    """The soak's partition (tests/support/netns_links.py): the path crosses a veth pair into a
    namespace and back; cut, a message gets no answer (the kernel drops it, nothing errors);
    healed, TCP delivers it. The proxy path above is tested without root."""
    with FaultProxy() as proxy:
        links = netns_links.NetnsLinks(proxy)
        try:
            links.add("decode-0", [echo[1]], advertised="127.0.0.3", target=echo[0])
            links.start()
            with socket.create_connection(("127.0.0.3", echo[1]), timeout=5) as sock:
                assert round_trip(sock, b"through the namespace")[0] == b"through the namespace"
                links.partition("decode-0", cut=True)
                sock.settimeout(1.0)
                sock.sendall(b"sent during the partition")
                with pytest.raises(TimeoutError):
                    sock.recv(100)  # silence, not an error
                links.partition("decode-0", cut=False)
                sock.settimeout(10.0)
                got = b""
                while len(got) < len(b"sent during the partition"):
                    got += sock.recv(100)
                assert got == b"sent during the partition"  # retransmitted once healed
        finally:
            links.close()
        assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.count(links.ns) == 0


def test_write_payload_is_found_wherever_the_reads_cut_the_frames() -> None:
    """Three frames of the host engine's framing (a NOTIFY, a WRITE of 2 descriptors and 40
    payload bytes, a WRITE without payload) cut into reads at every size from 1 to the whole:
    the spans cover exactly the 40 payload bytes, never a header, a descriptor or a body."""
    from pdserve_worker.transfer.backends.host import wire

    notify = wire.notify_frame(b"namebody", 4, seq=1)
    payload = bytes(range(100, 140))
    write = wire.header(wire.Kind.WRITE, 2, 2, len(payload)) + wire.pack_descs([(4096, 20), (8192, 20)]) + payload
    empty = wire.header(wire.Kind.WRITE, 0, 3, 0)
    stream = notify + write + empty + notify
    first = len(notify) + wire.HEADER.size + 2 * wire.DESC.size
    expected = set(range(first, first + len(payload)))
    for cut in range(1, len(stream) + 1):
        tracker, found = WritePayloads(), set()
        for at in range(0, len(stream), cut):
            for start, end in tracker.spans(stream[at : at + cut]):
                found |= set(range(at + start, at + end))
        assert found == expected, f"reads of {cut} bytes"
