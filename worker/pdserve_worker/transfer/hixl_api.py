"""The surface of the HIXL Python binding (`hixl`), as this project's own types.

Real HIXL ships only inside CANN (HIXL.md 2.1), so code that must run everywhere cannot import
its types. This module mirrors them name for name and value for value: data classes with the
same constructor arguments and attributes, enums with the same members and values (C++ enum
order), and the same status codes and option keys. The host engine (`host.engine.Hixl`)
takes and returns these; where the real module is present, `registry.create_engine` hands out
the real module instead, and code written against `backend.api.X` works with either.

Nothing here does I/O; it is the vocabulary only.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

# ---- status codes (hixl_types.h; identical in adxl_types.h and the binding) -------------------
SUCCESS = 0
PARAM_INVALID = 103900
TIMEOUT = 103901
NOT_CONNECTED = 103902
ALREADY_CONNECTED = 103903
NOTIFY_FAILED = 103904  # reserved by HIXL, never returned today
UNSUPPORTED = 103905
RESOURCE_EXHAUSTED = 203900
FAILED = 503900

STATUS_NAMES: dict[int, str] = {
    SUCCESS: "SUCCESS",
    PARAM_INVALID: "PARAM_INVALID",
    TIMEOUT: "TIMEOUT",
    NOT_CONNECTED: "NOT_CONNECTED",
    ALREADY_CONNECTED: "ALREADY_CONNECTED",
    NOTIFY_FAILED: "NOTIFY_FAILED",
    UNSUPPORTED: "UNSUPPORTED",
    RESOURCE_EXHAUSTED: "RESOURCE_EXHAUSTED",
    FAILED: "FAILED",
}


def status_name(status: int) -> str:
    """`PARAM_INVALID(103900)`: how every log line and error of this project names a status."""
    return f"{STATUS_NAMES.get(int(status), 'UNKNOWN')}({int(status)})"


# ---- option keys of `initialize` (hixl.h) --------------------------------------------------------
OPTION_ENABLE_USE_FABRIC_MEM = "EnableUseFabricMem"
OPTION_BUFFER_POOL = "BufferPool"
OPTION_RDMA_TRAFFIC_CLASS = "RdmaTrafficClass"
OPTION_RDMA_SERVICE_LEVEL = "RdmaServiceLevel"
OPTION_GLOBAL_RESOURCE_CONFIG = "GlobalResourceConfig"
OPTION_AUTO_CONNECT = "AutoConnect"
OPTION_LOCAL_COMM_RES = "LocalCommRes"

FEATURE_NOT_SUPPORTED = 0
FEATURE_SUPPORTED = 1

UINT32_MAX = 2**32 - 1
# Each of a notify's name and message is at most this many characters (ctrl_msg.h).
MAX_NOTIFY_FIELD = 1024


class MemType(IntEnum):
    MEM_DEVICE = 0
    MEM_HOST = 1


class TransferOp(IntEnum):
    READ = 0  # remote -> local
    WRITE = 1  # local -> remote


class TransferStatus(IntEnum):
    WAITING = 0
    COMPLETED = 1
    TIMEOUT = 2  # declared by HIXL, "not supported yet"; never produced here either
    FAILED = 3


class AsyncConnectStatus(IntEnum):
    NOT_CONNECT = 0
    CONNECT_PENDING = 1
    CONNECTING = 2
    CONNECTED = 3
    CONNECT_FAILED = 4
    DISCONNECT_PENDING = 5
    DISCONNECTING = 6


class FeatureType(IntEnum):
    AUTO_CONNECT = 0
    CLIENT_SERVER_COMM = 1


# The binding exports enum values at module level too (py::enum_::export_values).
MEM_DEVICE, MEM_HOST = MemType.MEM_DEVICE, MemType.MEM_HOST
READ, WRITE = TransferOp.READ, TransferOp.WRITE
AUTO_CONNECT, CLIENT_SERVER_COMM = FeatureType.AUTO_CONNECT, FeatureType.CLIENT_SERVER_COMM


# ---- data classes ------------------------------------------------------------------------------
# Mutable like the binding's def_readwrite attributes; slots keep them as small as the C structs.
@dataclass(slots=True)
class MemDesc:
    addr: int
    len: int
    local_only: bool = False  # the binding's extra field: never advertised to peers


@dataclass(slots=True)
class TransferOpDesc:
    local_addr: int
    remote_addr: int
    len: int


@dataclass(slots=True)
class NotifyDesc:
    name: str
    notify_msg: str


@dataclass(slots=True)
class TransferArgs:
    user_data: int = 0  # echoed back by get_all_transfer_status


@dataclass(slots=True)
class GetTransferStatusArgs:
    max_query_count: int = UINT32_MAX
    skip_waiting: bool = False


@dataclass(slots=True)
class TransferResult:
    req: int = 0
    user_data: int = 0
    status: TransferStatus = TransferStatus.WAITING
