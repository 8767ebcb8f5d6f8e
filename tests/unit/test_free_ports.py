"""Ports handed to processes that bind them later: outside the ephemeral range, bindable, never twice."""

from __future__ import annotations

import socket

from pdserve_worker.util import free_ports
from pdserve_worker.util.free_ports import ephemeral_low, free_port


def test_ports_are_below_the_ephemeral_range_unique_and_bindable() -> None:
    low = ephemeral_low()
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(free_ports._LOW <= p < low for p in ports)
    with socket.socket() as s:  # a handed-out port is really free
        s.bind(("127.0.0.1", ports[-1]))


def test_a_port_someone_listens_on_is_never_handed_out(monkeypatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        with socket.socket() as probe:  # a port free now (busy + 1 may be another connection's)
            probe.bind(("127.0.0.1", 0))
            other = probe.getsockname()[1]
        draws = iter([busy, busy, other])
        monkeypatch.setattr(free_ports, "_LOW", 1024)
        monkeypatch.setattr(free_ports, "ephemeral_low", lambda: 65536)
        monkeypatch.setattr(free_ports._rng, "randrange", lambda a, b: next(draws))
        monkeypatch.setattr(free_ports, "_given", set())
        assert free_port() == other


def test_exhaustion_is_an_error_that_names_the_range(monkeypatch) -> None:
    monkeypatch.setattr(free_ports, "_bindable", lambda host, port: False)
    try:
        free_port()
    except OSError as exc:
        assert "no free port on 127.0.0.1" in str(exc)
    else:
        raise AssertionError("free_port returned with nothing bindable")
