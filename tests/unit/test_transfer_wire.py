"""The host engine's framing helpers: buffered frames, scatter/gather resumption, engine ids."""

from __future__ import annotations

import socket
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve_worker.transfer.backends.host import wire
from pdserve_worker.transfer.backends.host.netio import _advance, parse_engine_id, recvmsg_into_all, sendmsg_all


def test_frames_survive_arbitrary_segmentation() -> None:
    a, b = socket.socketpair()
    payload = bytes(range(256)) * 300
    stream = (
        wire.json_frame(wire.Kind.NOTIFY, {"name": "n", "msg": "m"}, seq=5)
        + wire.header(wire.Kind.WRITE, 1, 6, len(payload))
        + payload
    )

    def dribble() -> None:
        for i in range(0, len(stream), 777):  # odd-sized pieces split headers and bodies
            a.sendall(stream[i : i + 777])

    t = threading.Thread(target=dribble)
    t.start()
    reader = wire.FrameReader(b, capacity=1024)
    kind, _, seq, size = reader.header()
    assert (kind, seq, reader.json(size)) == (wire.Kind.NOTIFY, 5, {"name": "n", "msg": "m"})
    kind, arg, seq, size = reader.header()
    assert (kind, arg, seq, size) == (wire.Kind.WRITE, 1, 6, len(payload))
    first, second = bytearray(1000), bytearray(len(payload) - 1000)
    reader.readinto([memoryview(first), memoryview(second)])
    assert bytes(first + second) == payload
    t.join()
    a.close()
    with pytest.raises(ConnectionError):
        reader.header()
    b.close()


def test_unknown_frame_kind_is_a_protocol_error() -> None:
    a, b = socket.socketpair()
    a.sendall(wire.HEADER.pack(99, 0, 0, 0))
    with pytest.raises(wire.ProtocolError, match="unknown frame kind 99"):
        wire.FrameReader(b).header()
    a.close()
    b.close()


@given(st.lists(st.integers(0, 50), max_size=8), st.data())
def test_advance_drops_exactly_n_bytes(sizes: list[int], data: st.DataObject) -> None:
    views = [memoryview(bytes([i]) * n) for i, n in enumerate(sizes)]
    total = b"".join(bytes(v) for v in views)
    n = data.draw(st.integers(0, len(total)))
    assert b"".join(bytes(v) for v in _advance([v for v in views if len(v)], n)) == total[n:]


def test_scatter_gather_round_trip_larger_than_socket_buffers() -> None:
    a, b = socket.socketpair()
    parts = [bytes([i % 251]) * (1 << 18) for i in range(12)]  # 3 MB in 12 views
    sender = threading.Thread(target=sendmsg_all, args=(a, [memoryview(p) for p in parts]))
    sender.start()
    into = [bytearray(len(p)) for p in parts]
    recvmsg_into_all(b, [memoryview(x) for x in into])
    sender.join()
    assert [bytes(x) for x in into] == parts
    a.close()
    b.close()


@pytest.mark.parametrize(
    ("engine_id", "expected"),
    [
        ("10.0.0.1:26000", ("10.0.0.1", 26000)),
        ("10.0.0.1", ("10.0.0.1", 0)),
        ("10.0.0.1:-1", ("10.0.0.1", 0)),
        ("[fe80::1]:5000", ("fe80::1", 5000)),
        ("[fe80::1]", ("fe80::1", 0)),
        ("fe80::1", ("fe80::1", 0)),
    ],
)
def test_engine_ids(engine_id: str, expected: tuple[str, int]) -> None:
    assert parse_engine_id(engine_id) == expected


@pytest.mark.parametrize("bad", ["", "host:port", "[::1", "[::1]5000", "h:70000"])
def test_bad_engine_ids(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_engine_id(bad)
