"""Ports `pdserve local` hands down (pdserve_common/inherited_sockets.py): held from the parent's
bind on, so no other process can take one before the child serves it (issue #29: the old
bind-and-release picked a port that was only free until someone else bound it)."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import pytest

from pdserve_common import inherited_sockets as inh

CHILD = textwrap.dedent(
    """
    import sys
    from pdserve_common import inherited_sockets as inh
    port = int(sys.argv[1])
    sock = inh.take(port)
    assert sock is not None and sock.getsockname()[1] == port
    assert inh.take(port) is None  # once
    sock.listen(4)
    print("listening", flush=True)
    conn, _ = sock.accept()
    conn.sendall(b"served by the child")
    conn.close()
    """
)


def test_a_held_port_cannot_be_taken_and_the_child_serves_it() -> None:
    held = inh.bind_for_child("127.0.0.1")
    port = held.getsockname()[1]
    thief = socket.socket()
    with pytest.raises(OSError):  # from the parent's bind on, the port is ours
        thief.bind(("127.0.0.1", port))
    thief.close()
    with socket.socket() as early:  # bound, not listening: nothing connects before a child listens
        assert early.connect_ex(("127.0.0.1", port)) != 0
    env = {inh.LISTEN_FDS_ENV: inh.env_value([held]), "PYTHONPATH": ":".join(sys.path)}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(port)], env=env, pass_fds=(held.fileno(),), stdout=subprocess.PIPE
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == b"listening\n"
        with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
            assert client.recv(64) == b"served by the child"
        assert child.wait(10) == 0
    finally:
        child.kill()
        held.close()


def test_what_is_not_handed_down_binds_as_usual_and_a_wrong_fd_is_named() -> None:
    assert inh.take(12345, env={}) is None
    assert inh.take(12345, env={inh.LISTEN_FDS_ENV: "23456=3"}) is None
    with pytest.raises(ValueError, match="not port=fd"):
        inh.parse("8000:5")
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        wrong = other.getsockname()[1] + 1 if other.getsockname()[1] < 65535 else 1024
        dup = other.dup()  # take() owns what it is given
        with pytest.raises(ValueError, match=f"not a TCP socket bound to port {wrong}"):
            inh.take(wrong, env={inh.LISTEN_FDS_ENV: f"{wrong}={dup.detach()}"})


def test_pdserve_local_hands_each_child_the_ports_its_env_names(tmp_path) -> None:
    """The deployment's own spawn path: a stand-in "python" reports what it was handed."""
    from pdserve_worker.cli.local_deployment import LocalDeployment
    from pdserve_worker.cli.local_plan import LocalPlan

    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho "$PDSERVE_LISTEN_FDS"; ls /proc/self/fd\n')
    fake.chmod(0o755)
    d = LocalDeployment(LocalPlan(port=0, log_dir=tmp_path / "logs"), progress=None, python=str(fake))
    try:
        env = {"PDSERVE_HTTP_PORT": str(d._hold()), "PDSERVE_GRPC_PORT": str(d._hold()), "OTHER": "1"}
        unrelated = d._hold()  # another child's
        child = d._spawn("probe", "prefill", env)
        assert child.proc is not None and child.proc.wait(10) == 0
        fds_line, *listed = (tmp_path / "logs" / "probe.log").read_text().split()
        handed = inh.parse(fds_line)
        assert set(handed) == {int(env["PDSERVE_HTTP_PORT"]), int(env["PDSERVE_GRPC_PORT"])}
        assert unrelated not in handed
        assert {str(fd) for fd in handed.values()} <= set(listed)  # open in the child, at those numbers
    finally:
        d.stop()
    assert d._held == {}  # stop() gave the ports back
