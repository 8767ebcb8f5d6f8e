"""#58 A9: a TP group's listeners (ranks/group.py) are on loopback only. A gloo listener keeps a
descriptor for every connection anyone opens to it, never released (17.8k on one rank in 134 s);
its device was made on whatever the pod's hostname resolves to (the pod IP) or on
GLOO_SOCKET_IFNAME, and torch's TCPStore server listens on every interface. Every rank of an
instance is in one pod, so now neither is reachable from another pod."""

from __future__ import annotations

import fcntl
import ipaddress
import multiprocessing
import socket
import struct

import pytest
import torch

from netutil import free_port
from pdserve_worker.ranks.group import GroupSpec, device_backend_on_loopback, gloo_on_loopback, loopback_interface


def non_loopback_ipv4() -> tuple[str, str] | None:
    """(interface, IPv4 address) of this host's first interface that is not loopback, if any."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                reply = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
        address = socket.inet_ntoa(reply[20:24])
        if not ipaddress.ip_address(address).is_loopback:
            return name, address
    return None


def test_ranks_listen_on_loopback_only_and_are_refused_from_the_hosts_address():
    from support.tp_ranks import listening_rank

    other = non_loopback_ipv4()
    # With GLOO_SOCKET_IFNAME naming the host's own interface (as a pod's environment might, or
    # as the pod's hostname resolving to its IP does), the group still listens on loopback.
    ifname = other[0] if other else None
    ctx = multiprocessing.get_context("spawn")
    out, done = ctx.Queue(), ctx.Event()
    spawned = torch.multiprocessing.start_processes(
        listening_rank,
        args=(2, f"127.0.0.1:{free_port()}", ifname, out, done),
        nprocs=2,
        join=False,
        start_method="spawn",
    )
    try:
        reports = sorted(out.get(timeout=180) for _ in range(2))
        for rank, total, lease, env_ifname, listening in reports:
            assert (total, lease) == (2.0, "lease"), rank  # the group works
            assert env_ifname == ifname, rank  # the process's own setting is left as it was
            assert listening, f"rank {rank} listens on nothing"
            assert all(ipaddress.ip_address(addr).is_loopback for addr, _ in listening), (rank, listening)
        ports = [port for *_, listening in reports for _, port in listening]
        assert len(ports) >= 1 + 2 * 2  # the store's, and at least one gloo device per rank and group
        if other is None:
            pytest.skip("this host has no non-loopback address to connect from (the loopback binds were checked)")
        for port in ports:
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((other[1], port), timeout=5).close()
    finally:
        done.set()
        spawned.join(timeout=60)


def test_the_rendezvous_must_be_on_loopback():
    GroupSpec(2, 0, "127.0.0.1:29500")
    GroupSpec(2, 0, "[::1]:29500")
    GroupSpec(2, 0, "file:///tmp/x/store")
    for address in ("10.0.0.5:29500", "0.0.0.0:29500", "pod-0.svc:29500"):
        with pytest.raises(ValueError, match="must be on loopback"):
            GroupSpec(2, 0, address)


def test_gloo_groups_are_made_on_the_loopback_interface_and_the_setting_restored(monkeypatch):
    import os

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9")
    with gloo_on_loopback():
        assert os.environ["GLOO_SOCKET_IFNAME"] == loopback_interface() == "lo"
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth9"
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    with gloo_on_loopback():
        pass
    assert "GLOO_SOCKET_IFNAME" not in os.environ


@pytest.mark.parametrize(
    ("backend", "expected"),
    [
        ("nccl", {"NCCL_SOCKET_IFNAME": "=lo"}),
        ("hccl", {"HCCL_SOCKET_IFNAME": "=lo", "HCCL_IF_IP": "127.0.0.1"}),
        ("gloo", {}),
    ],
)
def test_device_backends_bootstrap_on_loopback_whatever_the_pod_set(monkeypatch, backend, expected):
    """nccl and hccl read their interface when they make a communicator (lazily, after the group
    is made), so the setting stays for the process; a pod's own setting is replaced, not kept."""
    import os

    names = ("NCCL_SOCKET_IFNAME", "HCCL_SOCKET_IFNAME", "HCCL_IF_IP")
    for name in names:
        monkeypatch.setenv(name, "eth0" if name != "HCCL_IF_IP" else "10.0.0.5")
    assert device_backend_on_loopback(backend) == expected
    for name in names:
        assert os.environ[name] == expected.get(name, "eth0" if name != "HCCL_IF_IP" else "10.0.0.5")
