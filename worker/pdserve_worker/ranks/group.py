"""One tensor-parallel instance's process group: torch.distributed, one process per rank.

gloo on the CPU, nccl on CUDA, hccl on Ascend (torch_npu registers it) runs the model's
all_reduce; what the ranks say besides (rank 0's next pass, each rank's "my pushes landed") are
small Python objects on a gloo group (the device group's collectives take device tensors).

Every collective has a deadline (`timeout_s`): a rank that died or hangs makes the others' next
collective raise, and the instance stops as one. gloo honours it on every op; nccl and hccl
through their watchdogs (`TORCH_NCCL_ASYNC_ERROR_HANDLING`, `HCCL_EXEC_TIMEOUT`), which abort.
All ranks are in one pod, so nothing of the group listens off loopback: the rendezvous is a
FileStore or a TCPStore on a socket we bind to a loopback `address`, and every gloo device is
made on the loopback interface (`gloo_on_loopback`), not the pod's IP: a gloo listener keeps a
descriptor for each connection anyone opens to it (#58 A9). nccl's and hccl's bootstrap
listeners are set onto loopback too (`device_backend_on_loopback`).
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import logging
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pdserve_common.logs import kv

log = logging.getLogger(__name__)

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
# What rank 0 broadcasts besides a pass or a step: "keep waiting" and "stop" (ranks/prefill.py,
# ranks/decode.py).
IDLE, STOP = "idle", "stop"
DEFAULT_TIMEOUT_S = 60.0
GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"  # read by torch each time it makes a gloo group's device


class GroupError(RuntimeError):
    """A collective of the instance's group failed or timed out: a rank died or hangs."""


class MemberUnavailable(RuntimeError):
    """A member of a decode's group (a layer shard, a tensor-parallel rank) did not answer:
    Generate answers UNAVAILABLE, and the router resumes the request on another decode."""


def backend_for(device: str) -> str:
    """The collective backend of a device ("cpu", "cuda:0", "npu:1")."""
    kind = device.split(":", 1)[0]
    if kind not in BACKENDS:
        raise ValueError(f"no collective backend for device {device!r}; expected one of {sorted(BACKENDS)}")
    if kind == "npu":
        try:
            import torch_npu  # noqa: F401  (registers the "hccl" backend with torch.distributed)
        except ImportError as exc:
            raise RuntimeError(
                f"tensor parallelism on {device!r} needs torch_npu (pip install 'pdserve[npu]')"
            ) from exc
    return BACKENDS[kind]


@dataclass(frozen=True)
class GroupSpec:
    """Where a rank's group meets: `size` ranks, this one `rank`, rendezvous at `address`."""

    size: int
    rank: int
    address: str  # host:port of rank 0's rendezvous (or file:///path, a FileStore: no port at all)
    device: str = "cpu"
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} outside a group of {self.size}")
        host, _, port = self.address.rpartition(":")
        if not self.address.startswith("file://") and (not host or not port.isdigit()):
            raise ValueError(f"tensor-parallel rendezvous address must be host:port, got {self.address!r}")
        if not self.address.startswith("file://") and not _is_loopback(host):
            raise ValueError(f"tensor-parallel rendezvous must be on loopback (one pod), got {self.address!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"tensor-parallel timeout must be positive, got {self.timeout_s}")

    def store(self) -> tuple[Any, socket.socket | None]:
        """The rendezvous store, and for a TCPStore on rank 0 the loopback socket it serves on
        (torch's own server would listen on every interface): keep it open until the group ends."""
        timeout = datetime.timedelta(seconds=self.timeout_s)
        if self.address.startswith("file://"):
            return dist.FileStore(self.address.removeprefix("file://"), self.size), None
        host, _, port = self.address.rpartition(":")
        host = host.strip("[]")
        if self.rank != 0:
            return dist.TCPStore(host, int(port), self.size, False, timeout), None
        listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, int(port)))
            listener.listen(128)
            store = dist.TCPStore(host, int(port), self.size, True, timeout, master_listen_fd=listener.fileno())
        except BaseException:
            listener.close()
            raise
        return store, listener


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def loopback_interface() -> str:
    """The name of this host's loopback interface ("lo" on Linux)."""
    names = [name for _, name in socket.if_nameindex()]
    for name in ("lo", "lo0"):
        if name in names:
            return name
    raise RuntimeError(f"no loopback interface (lo or lo0) among this host's interfaces {names}")


@contextlib.contextmanager
def gloo_on_loopback() -> Iterator[None]:
    """gloo groups made inside get their device (and listener) on the loopback interface,
    whatever GLOO_SOCKET_IFNAME says outside (other gloo users of the process keep theirs)."""
    saved = os.environ.get(GLOO_IFNAME_ENV)
    os.environ[GLOO_IFNAME_ENV] = loopback_interface()
    try:
        yield
    finally:
        if saved is None:
            del os.environ[GLOO_IFNAME_ENV]
        else:
            os.environ[GLOO_IFNAME_ENV] = saved


# The device backends' own bootstrap listeners, pinned to loopback for the life of the process:
# nccl and hccl read these when they make a communicator, lazily, at the first collective (so a
# context like gloo_on_loopback's would be gone by then). Both take "=name" as an exact match
# (NCCL's and CANN's environment-variable references); HCCL_IF_IP outranks HCCL_SOCKET_IFNAME.
DEVICE_LOOPBACK_ENV = {
    "nccl": lambda lo: {"NCCL_SOCKET_IFNAME": f"={lo}"},
    "hccl": lambda lo: {"HCCL_SOCKET_IFNAME": f"={lo}", "HCCL_IF_IP": "127.0.0.1"},
}


def device_backend_on_loopback(backend: str) -> dict[str, str]:
    """Set this process's nccl or hccl bootstrap onto loopback (all ranks are in one pod); the
    variables set, logged with what they replaced. gloo: nothing (gloo_on_loopback does it)."""
    settings = DEVICE_LOOPBACK_ENV.get(backend, lambda lo: {})(loopback_interface())
    for name, value in settings.items():
        if os.environ.get(name, value) != value:
            log.info(kv(event="tp_bootstrap_on_loopback", variable=name, was=os.environ[name], now=value))
        os.environ[name] = value
    return settings


class TPGroup:
    """This process's membership of its instance's group (torch.distributed's default group)."""

    def __init__(self, spec: GroupSpec) -> None:
        self.spec = spec
        self.size, self.rank = spec.size, spec.rank
        backend = backend_for(spec.device)
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        device_backend_on_loopback(backend)
        store, self._store_listener = spec.store()
        try:
            with gloo_on_loopback():
                dist.init_process_group(backend, store=store, world_size=spec.size, rank=spec.rank, timeout=timeout)
                # Control messages (Python objects) travel on the CPU: the default group when it is gloo.
                self._cpu = None if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
                # Write leases (ranks/decode.py) on a gloo group of their own: rank 0 sends them from
                # whichever thread grants a reservation while its loop thread runs steps on the group above.
                self._leases = dist.new_group(backend="gloo", timeout=timeout)
        except BaseException:
            self.close()
            raise
        log.info(kv(event="tp_group_joined", rank=spec.rank, size=spec.size, backend=backend, address=spec.address))

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over the group, in place (the model's `reduce`); GroupError when a rank is gone."""
        self._collective(dist.all_reduce, tensor)
        return tensor

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's `obj`, on every rank (rank 0 passes it, the others receive it)."""
        return self._broadcast(obj, self._cpu)

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj`, in rank order, on rank 0 (None on the others)."""
        return self._gather(obj, self._cpu)

    def lease_broadcast(self, obj: Any = None) -> Any:
        """`broadcast` on the lease channel."""
        return self._broadcast(obj, self._leases)

    def lease_gather(self, obj: Any) -> list[Any] | None:
        """`gather` on the lease channel."""
        return self._gather(obj, self._leases)

    def _broadcast(self, obj: Any, group: Any) -> Any:
        box = [obj if self.rank == 0 else None]
        self._collective(dist.broadcast_object_list, box, src=0, group=group)
        return box[0]

    def _gather(self, obj: Any, group: Any) -> list[Any] | None:
        out: list[Any] | None = [None] * self.size if self.rank == 0 else None
        self._collective(dist.gather_object, obj, out, dst=0, group=group)
        return out

    def _collective(self, op: Any, *args: Any, **kwargs: Any) -> None:
        try:
            op(*args, **kwargs)
        except (RuntimeError, dist.DistBackendError) as exc:  # a peer died, hung past the timeout, or left
            raise GroupError(f"tensor-parallel group (rank {self.rank} of {self.size}): {exc}") from exc

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        if self._store_listener is not None:
            self._store_listener.close()
            self._store_listener = None
