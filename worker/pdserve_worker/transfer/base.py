"""What every transfer backend is: the seam between the KV code and an engine.

Code above transfer/ never imports `hixl` or a backend module; `registry.create_engine` makes a
`TransferBackend` by name: the engine, typed as `TransferEngine` (the HIXL binding's methods
this project calls), and `api`, the module of the descriptor types, enums and status codes it
accepts (the real `hixl`, or our mirror `hixl_api`), so one code drives both.
What only the host engine can do is declared by the factory, never found by probing:
- `blocking` (`BlockingWaits`): sleep until a notify arrives or a put completes (real HIXL
  has only the draining calls; readiness and the pusher then poll).
- `host` (`HostExtensions`): memory that peers of the same host map (`malloc_mem`), write
  leases, and counts of what the engine's server refused.
On real HIXL each calling thread must carry the NPU's ACL context (HIXL.md 1.2): a thread that
calls the engine must `torch.npu.set_device(dev)` first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

from pdserve_worker.transfer import hixl_api

XXH3_64 = "xxh3_64"  # the pushed-KV digest of host memory (transfer/digest.py)
FLETCHER64 = "fletcher64"  # the pushed-KV digest of pools that may lie on a device (transfer/device_digest.py)


class TransferEngine(Protocol):
    """The methods of the HIXL binding's `hixl.Hixl` (HIXL.md 2.1) that pdserve calls.

    Every call returns an integer status (or a tuple starting with one) and never raises. The
    descriptors are the `api` module's (`MemDesc`, `TransferOpDesc`, `NotifyDesc`)."""

    def initialize(self, local_engine: str, options: dict[str, str] = ..., /) -> int: ...

    def finalize(self) -> None: ...

    def register_mem(self, mem_desc: Any, mem_type: int, /) -> tuple[int, int]: ...

    def deregister_mem(self, handle: int, /) -> int: ...

    def connect(self, remote_engine: str, timeout_in_millis: int = ..., /) -> int: ...

    def disconnect(self, remote_engine: str, timeout_in_millis: int = ..., /) -> int: ...

    def transfer_async(self, remote_engine: str, op: int, op_descs: Sequence[Any], /) -> tuple[int, int]: ...

    def get_transfer_status(self, req_id: int, /) -> tuple[int, int]: ...

    def send_notify(self, remote_engine: str, notify: Any, timeout_in_millis: int = ..., /) -> int: ...

    def get_notifies(self) -> tuple[int, list[Any]]: ...


class BlockingWaits(Protocol):
    """Waits that sleep in the engine instead of polling it (the host engine's)."""

    def wait_notifies(self, timeout_s: float, /) -> tuple[int, list[Any]]:
        """Like `get_notifies`, but sleeps up to `timeout_s` until one arrives (TIMEOUT if none)."""
        ...

    def wait_transfer(self, req_id: int, timeout_s: float, /) -> int:
        """Sleeps up to `timeout_s` until request `req_id` is no longer WAITING."""
        ...


class HostExtensions(Protocol):
    """The host engine's own calls: shareable memory, write leases, refusal counts."""

    def malloc_mem(self, size: int, mem_type: int = ..., /) -> tuple[int, int]: ...

    def free_mem(self, addr: int, /) -> int: ...

    def lease_write(self, addr: int, length: int, /) -> tuple[int, int]: ...

    def revoke_write(self, lease_id: int, /) -> int: ...

    def security_stats(self) -> dict[str, int]: ...


class BackendUnavailable(RuntimeError):
    """A backend's factory could not make its engine here (HIXL without CANN, say)."""


class TransferError(RuntimeError):
    """A transfer-engine call returned a status other than the ones the caller accepts."""

    def __init__(self, what: str, status: int) -> None:
        super().__init__(f"{what}: {hixl_api.status_name(status)}")
        self.status = status


@dataclass
class TransferBackend:
    """A transfer engine, the vocabulary (types, enums, codes) that goes with it, and what more
    than HIXL it can do (None where it cannot)."""

    name: str  # the registry's name for it (registry.BACKENDS)
    engine: TransferEngine
    api: ModuleType
    blocking: BlockingWaits | None = None
    host: HostExtensions | None = None
    # The digest its memory allows on pushed KV (transfer/digest.py): XXH3_64 over host memory,
    # FLETCHER64 where pools may lie on a device (HIXL); a worker whose settings turn digests
    # off sets None.
    digest: str | None = None

    def check(self, status: int, what: str, *accept: int) -> None:
        """Raise TransferError unless `status` is SUCCESS or one of `accept`."""
        if status != self.api.SUCCESS and status not in accept:
            raise TransferError(what, status)

    def ensure_connected(self, remote_engine: str, timeout_ms: int) -> None:
        status = self.engine.connect(remote_engine, timeout_ms)
        self.check(status, f"connect to {remote_engine}", self.api.ALREADY_CONNECTED)
