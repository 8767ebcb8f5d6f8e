"""Free loopback ports for processes we start and that bind them later (tests, a TP instance's
ranks, the two-sided transport; `pdserve local` hands its children bound sockets instead:
pdserve_common/inherited_sockets.py).

A port found with bind(0) and then closed is only free until someone else takes it, and
bind(0) draws from the kernel's ephemeral range — the same range every outbound connection
of every process on the machine draws its source port from. Under load (several suites, a
busy `pdserve local`) a worker then failed to bind its gRPC or transfer port. So ports are
drawn at random from *below* the ephemeral range, where only listeners compete, checked
bindable, and never handed out twice by one process. (No library offers this: the stdlib has
only bind(0); portpicker, the usual answer, also draws from the ephemeral range.)
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

_LOW = 10000  # above the well-known and most registered service ports
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_given: set[int] = set()
_lock = threading.Lock()
_rng = random.SystemRandom()


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux default 32768; elsewhere 49152)."""
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152  # IANA's dynamic range: the BSDs, macOS and Windows


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` nobody listens on now, outside the ephemeral range, new to this process."""
    high = ephemeral_low()
    if high - _LOW < 1000:  # an odd kernel setting leaves no room below: fall back to bind(0)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return int(s.getsockname()[1])
    with _lock:
        for _ in range(200):
            port = _rng.randrange(_LOW, high)
            if port not in _given and _bindable(host, port):
                _given.add(port)
                return port
    raise OSError(f"no free port on {host} in [{_LOW}, {high}) after 200 tries")
