"""Review of issue 13: the transfer server's accept path under pressure from unauthenticated peers.

- Out of file descriptors (anyone can cause it: the pod HTTP port is open to the cluster and
  every connection there costs the process one), `accept()` fails with EMFILE. The acceptor
  thread took any OSError for "the listener was closed" and returned: the decode never
  accepted another KV link until it was restarted, though nothing else looked wrong.
- At most 32 handshakes may be pending. Refusing the newest once they were all taken let a
  peer without the key hold every pending place with 32 silent connections (renewed every
  5 s deadline) and so keep every genuine prefill from linking.

Each attack runs against a stand-in decode process (the host engine's server with the
worker's options) and checks that a genuine peer still links afterwards, or meanwhile.
"""

from __future__ import annotations

import os
import resource
import socket
import time

import pytest

from security.conftest import KEY
from support import attacker

pytestmark = pytest.mark.slow


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def genuine_handshake(engine_id: str, timeout_s: float = 3.0) -> dict:
    with attacker.connect(engine_id, timeout_s) as sock:
        return attacker.authenticate(sock, KEY)


def test_running_out_of_descriptors_does_not_stop_the_transfer_server_for_good(decode_peer) -> None:
    decode = decode_peer()
    pid = decode.process.pid
    assert "regions" in genuine_handshake(decode.info["engine_id"])
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    held: list[socket.socket] = []
    try:
        # Room for 2 more descriptors: the third connection's accept() fails with EMFILE.
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (open_fds(pid) + 2, hard))
        # From addresses of their own (one address holds at most 8 handshakes); more than the
        # limit leaves room for, even if a descriptor counted above was on its way out.
        held = [attacker.connect(decode.info["engine_id"], source=f"127.0.0.{2 + i}") for i in range(16)]
        met = time.monotonic() + 5  # the acceptor meets EMFILE (polled: a loaded machine is slow to get there)
        while decode.call("security").get("accept_failed", 0) < 1:
            assert time.monotonic() < met, "the acceptor never ran out of descriptors"
            time.sleep(0.05)
    finally:
        for sock in held:
            sock.close()
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
    deadline = time.monotonic() + 5
    while True:
        try:
            assert "regions" in genuine_handshake(decode.info["engine_id"], 1.0)
            break
        except (OSError, AssertionError):
            assert time.monotonic() < deadline, "the transfer server accepts no link after running out of fds"
    assert decode.call("security").get("accept_failed", 0) >= 1


def test_silent_connections_cannot_keep_a_genuine_peer_from_linking(decode_peer) -> None:
    decode = decode_peer(**{"pdserve.HandshakeTimeoutMs": "20000"})
    engine = decode.info["engine_id"]
    # From 10 addresses, 4 each: more than the 32 pending places, each address at its share.
    squatters = [attacker.connect(engine, source=f"127.0.0.{2 + i % 10}") for i in range(40)]
    try:
        time.sleep(0.3)
        for _ in range(3):  # again and again while the squatters stay
            assert "regions" in genuine_handshake(engine)
        assert decode.call("security")["handshakes_pending"] <= 32
    finally:
        for sock in squatters:
            sock.close()


def test_one_address_holds_at_most_its_share_of_the_handshakes(decode_peer) -> None:
    """#29: one attacking address could take every pending place, or churn them by eviction
    (a newcomer cuts the oldest), cutting a genuine prefill's handshake again and again. Now
    one address holds at most pdserve.MaxHandshakesPerPeer (8) and its newcomers are closed."""
    decode = decode_peer(**{"pdserve.HandshakeTimeoutMs": "20000"})
    engine = decode.info["engine_id"]
    squatters = [attacker.connect(engine, source="127.0.0.2") for _ in range(40)]
    try:
        time.sleep(0.3)
        stats = decode.call("security")
        assert stats["handshakes_pending"] <= 8, stats
        assert stats.get("peer_handshake_cap", 0) >= 30, stats
        assert stats.get("handshake_evicted", 0) == 0, stats  # nobody else's handshake was cut
        for _ in range(3):
            assert "regions" in genuine_handshake(engine)  # from 127.0.0.1
    finally:
        for sock in squatters:
            sock.close()
