"""Links that cross a real network link that can be cut: a veth pair per worker into a network
namespace of our own, and back (iproute2; needs root). The soak's partition fault
(benchmarks/soak.py --links netns).

For worker i the path of every connection to one of its ports p is

    client → 127.0.0.2:p (FaultProxy, group NAME: delay/stall/reset)
           → 10.213.i.2:p   (relay in namespace pdsoak-PID, across veth pair i)
           → 10.213.i.1:p   (FaultProxy, group back:NAME, across veth pair i again)
           → 127.0.0.1:p    (the worker)

`partition(name, True)` sets the namespace's end of worker i's pair down: the kernel drops the
packets of both legs (TCP retransmits, new connections' SYNs go unanswered) until it is set up
again. Nothing else of the machine is touched; `close()` deletes the namespace (and with it
every pair) and stops the relay, by PID.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from support.fault_proxy import FaultProxy

SUBNET = "10.213"


def available() -> str | None:
    """Why this cannot run here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


class NetnsLinks:
    def __init__(self, proxy: FaultProxy) -> None:
        reason = available()
        if reason is not None:
            raise RuntimeError(f"--links netns: {reason}")
        self.proxy = proxy
        self.ns = f"pdsoak-{os.getpid()}"
        self._index: dict[str, int] = {}
        self._relay_specs: list[str] = []
        self._fronts: list[tuple[str, tuple[str, int], tuple[str, int]]] = []
        self._relay: subprocess.Popen[str] | None = None
        _ip("netns", "add", self.ns)
        _ip("-n", self.ns, "link", "set", "lo", "up")

    def _pair(self, i: int) -> tuple[str, str]:
        return f"pds{os.getpid() % 100000}x{i}", f"pds{os.getpid() % 100000}y{i}"

    def add(self, name: str, ports: list[int], advertised: str, target: str = "127.0.0.1") -> None:
        """Worker `name`'s ports, reached at `advertised`, through a veth pair of its own."""
        i = self._index.setdefault(name, len(self._index))
        outer, inner = self._pair(i)
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner, "netns", self.ns)
        _ip("addr", "add", f"{SUBNET}.{i}.1/24", "dev", outer)
        _ip("link", "set", outer, "up")
        _ip("-n", self.ns, "addr", "add", f"{SUBNET}.{i}.2/24", "dev", inner)
        _ip("-n", self.ns, "link", "set", inner, "up")
        for port in ports:
            self.proxy.link(f"back:{name}", (f"{SUBNET}.{i}.1", port), (target, port))
            self._relay_specs.append(f"{SUBNET}.{i}.2:{port}={SUBNET}.{i}.1:{port}")
            self._fronts.append((name, (advertised, port), (f"{SUBNET}.{i}.2", port)))

    def start(self) -> None:
        """The relay in the namespace, then the fronts that lead into it."""
        script = Path(__file__).with_name("fault_proxy.py")
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        self._relay = subprocess.Popen(
            ["ip", "netns", "exec", self.ns, sys.executable, str(script), *self._relay_specs],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self._relay.stdout is not None
        line = self._relay.stdout.readline()
        if "relaying" not in line:
            raise RuntimeError(f"the relay in {self.ns} did not start (exit {self._relay.poll()})")
        for name, listen, upstream in self._fronts:
            self.proxy.link(name, listen, upstream)

    def partition(self, name: str, cut: bool) -> None:
        """Cut (or heal) every link into worker `name` at the namespace's end of its veth pair."""
        _, inner = self._pair(self._index[name])
        _ip("-n", self.ns, "link", "set", inner, "down" if cut else "up")

    def close(self) -> None:
        if self._relay is not None and self._relay.poll() is None:
            self._relay.terminate()  # by PID: `ip netns exec` execs the relay itself
            try:
                self._relay.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._relay.kill()
                self._relay.wait(timeout=10)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True, timeout=10)
        for i in self._index.values():  # the pairs went with the namespace; an outer end left over would be ours
            subprocess.run(["ip", "link", "del", self._pair(i)[0]], capture_output=True, timeout=10)
