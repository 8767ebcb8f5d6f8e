"""Who is in a service: the member types the broker keeps and watchers see, and their protos.

Frozen dataclasses rather than the proto messages themselves because they are compared,
hashed into views and validated once at the boundary (`MemberInfo.validate`), after which
the rest of the code can trust them.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from pdserve.v1 import broker_pb2, common_pb2
from pdserve_common.kv_layout import KVLayout, layout_from_proto, layout_to_proto

# Initial metadata of a Watch stream: the broker's incarnation id, sent before any event so
# that a watcher knows the stream is up even while the snapshot is still empty.
BROKER_ID_HEADER = "pdserve-broker-id"


class Role(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    ROUTER = "router"


class MemType(enum.StrEnum):
    """hixl MemType: the kind of memory a region is (device HBM or host DRAM)."""

    DEVICE = "device"
    HOST = "host"


_ROLE_TO_PROTO: dict[Role, broker_pb2.Role] = {
    Role.PREFILL: broker_pb2.ROLE_PREFILL,
    Role.DECODE: broker_pb2.ROLE_DECODE,
    Role.ROUTER: broker_pb2.ROLE_ROUTER,
}
_ROLE_FROM_PROTO: dict[int, Role] = {v: k for k, v in _ROLE_TO_PROTO.items()}
_MEM_TO_PROTO: dict[MemType, common_pb2.MemType] = {
    MemType.DEVICE: common_pb2.MEM_TYPE_DEVICE,
    MemType.HOST: common_pb2.MEM_TYPE_HOST,
}
_MEM_FROM_PROTO: dict[int, MemType] = {v: k for k, v in _MEM_TO_PROTO.items()}


def role_to_proto(role: Role | str) -> broker_pb2.Role:
    return _ROLE_TO_PROTO[Role(role)]


def role_from_proto(value: int) -> Role:
    try:
        return _ROLE_FROM_PROTO[value]
    except KeyError:
        raise ValueError(f"role must be one of {[r.value for r in Role]}, got proto value {value}") from None


@dataclass(frozen=True)
class MemoryRegion:
    """A region registered with the transfer engine: a raw address in the registering process."""

    addr: int
    length: int
    mem_type: MemType = MemType.HOST

    def validate(self) -> None:
        if self.addr <= 0:
            raise ValueError(f"region addr must be > 0, got {self.addr}")
        if self.length <= 0:
            raise ValueError(f"region length must be > 0, got {self.length} (addr {self.addr:#x})")


MAX_HISTOGRAM_BUCKETS = 64


@dataclass(frozen=True)
class Histogram:
    """A cumulative latency histogram: `counts[i]` observations were <= `bounds[i]` seconds."""

    bounds: tuple[float, ...] = ()
    counts: tuple[int, ...] = ()
    count: int = 0


@dataclass(frozen=True)
class RouterLoad:
    """A router's traffic since it started: what the operator's autoscaler plans from."""

    requests_total: int = 0
    prompt_tokens_total: int = 0
    output_tokens_total: int = 0
    ttft: Histogram | None = None
    tpot: Histogram | None = None


@dataclass(frozen=True)
class Load:
    """What a worker reports with each keepalive."""

    slots_used: int = 0
    slots_free: int = 0
    active_requests: int = 0
    router: RouterLoad | None = None  # routers only
    kv_tokens_used: int = 0  # decode: KV tokens in use / in all (0/0: not reported)
    kv_tokens_total: int = 0
    migrated: int = 0  # decode: requests handed over with their KV since it started (docs/migration.md)
    migration_fallbacks: int = 0  # decode: handed-over requests the router resumed instead
    # The worker's recent costs (router/disaggregation.py fits its choice to them; 0: not measured):
    prefill_tokens_per_s: float = 0.0  # prompt tokens per second of its prefill compute
    step_seconds: float = 0.0  # decode: seconds per decode step


@dataclass(frozen=True)
class MemberInfo:
    """What a worker tells the broker about itself (see broker.proto MemberInfo)."""

    worker_id: str
    role: Role
    grpc_endpoint: str = ""
    engine_id: str = ""
    regions: tuple[MemoryRegion, ...] = ()
    kv_layout: KVLayout | None = None
    revision: str = ""
    slots_total: int = 0
    slots_free: int = 0
    labels: Mapping[str, str] = field(default_factory=dict, hash=False)
    # Decode: computes a prompt's KV itself when asked (GenerateRequest.local_prefill), at most
    # `prefill_chunk_tokens` positions per step.
    local_prefill: bool = False
    prefill_chunk_tokens: int = 0

    def validate(self) -> None:
        """Raise ValueError naming the first field that peers could not use."""
        if not self.worker_id:
            raise ValueError("worker_id must not be empty")
        if not isinstance(self.role, Role):
            raise ValueError(f"role must be a Role, got {self.role!r}")
        if self.grpc_endpoint and not _is_host_port(self.grpc_endpoint):
            raise ValueError(f"grpc_endpoint must be host:port, got {self.grpc_endpoint!r}")
        if self.engine_id and not _is_host_port(self.engine_id):
            raise ValueError(f"engine_id must be ip:port, got {self.engine_id!r}")
        for region in self.regions:
            region.validate()
        if self.role is Role.DECODE:
            self._validate_decode()
        elif self.role is Role.PREFILL and not self.grpc_endpoint:
            raise ValueError(f"a prefill member needs a grpc_endpoint (worker {self.worker_id})")

    def _validate_decode(self) -> None:
        who = f"decode worker {self.worker_id}"
        if not self.grpc_endpoint:
            raise ValueError(f"{who} needs a grpc_endpoint")
        if not self.engine_id:
            raise ValueError(f"{who} needs an engine_id (its transfer engine ip:port)")
        if self.kv_layout is None:
            raise ValueError(f"{who} needs a kv_layout")
        if not self.regions:
            raise ValueError(f"{who} needs the regions of its registered KV pool")
        if self.slots_total != self.kv_layout.num_slots:
            raise ValueError(f"{who}: slots_total {self.slots_total} != kv_layout.num_slots {self.kv_layout.num_slots}")
        if not 0 <= self.slots_free <= self.slots_total:
            raise ValueError(f"{who}: slots_free must be in 0..{self.slots_total}, got {self.slots_free}")
        if self.local_prefill and self.prefill_chunk_tokens < 1:
            raise ValueError(f"{who}: a local prefill needs prefill_chunk_tokens >= 1, got {self.prefill_chunk_tokens}")


@dataclass(frozen=True)
class Member:
    """A member as the broker sees it: what it registered, its state and its last reported load."""

    info: MemberInfo
    draining: bool = False
    load: Load = Load()
    registered_unix_ms: int = 0
    # When the broker last received this load (its own monotonic clock; 0: never, or a watcher's
    # copy: not on the wire). A router's counters are as of this moment, not of whoever reads
    # them later: the planner divides their increase by these times (operator's autoscale/autoscaler.py).
    load_at: float = field(default=0.0, compare=False)

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def role(self) -> Role:
        return self.info.role


class EventType(enum.StrEnum):
    """What happened to a member (broker.proto WatchEvent.Type)."""

    ADDED = "added"
    UPDATED = "updated"
    DRAINING = "draining"
    REMOVED = "removed"
    SYNCED = "synced"  # the snapshot of a new watch is complete (no member)


@dataclass(frozen=True)
class MemberEvent:
    type: EventType
    member: Member | None
    revision: int = 0


def change_type(old: Member | None, new: Member) -> EventType | None:
    """The event that turns `old` into `new` for a watcher; None when nothing changed."""
    if old is None:
        return EventType.ADDED
    if old == new:
        return None
    if new.draining and not old.draining:
        return EventType.DRAINING
    return EventType.UPDATED


_EVENT_TO_PROTO: dict[EventType, broker_pb2.WatchEvent.Type] = {
    EventType.ADDED: broker_pb2.WatchEvent.ADDED,
    EventType.UPDATED: broker_pb2.WatchEvent.UPDATED,
    EventType.DRAINING: broker_pb2.WatchEvent.DRAINING,
    EventType.REMOVED: broker_pb2.WatchEvent.REMOVED,
    EventType.SYNCED: broker_pb2.WatchEvent.SYNCED,
}
_EVENT_FROM_PROTO: dict[int, EventType] = {v: k for k, v in _EVENT_TO_PROTO.items()}


def _is_host_port(text: str) -> bool:
    host, sep, port = text.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


def load_to_proto(load: Load) -> broker_pb2.Load:
    msg = broker_pb2.Load(
        slots_used=load.slots_used,
        slots_free=load.slots_free,
        active_requests=load.active_requests,
        kv_tokens_used=load.kv_tokens_used,
        kv_tokens_total=load.kv_tokens_total,
        migrated=load.migrated,
        migration_fallbacks=load.migration_fallbacks,
        prefill_tokens_per_s=load.prefill_tokens_per_s,
        step_seconds=load.step_seconds,
    )
    if load.router is not None:
        r = load.router
        msg.router.CopyFrom(
            broker_pb2.RouterLoad(
                requests_total=r.requests_total,
                prompt_tokens_total=r.prompt_tokens_total,
                output_tokens_total=r.output_tokens_total,
            )
        )
        for name in ("ttft", "tpot"):
            hist = getattr(r, name)
            if hist is not None:
                getattr(msg.router, name).CopyFrom(
                    broker_pb2.LatencyHistogram(bounds=hist.bounds, counts=hist.counts, count=hist.count)
                )
    return msg


def _histogram_from_proto(msg: broker_pb2.LatencyHistogram) -> Histogram | None:
    """None for a histogram that is malformed or too long: the report is dropped, not trusted."""
    bounds, counts = tuple(msg.bounds), tuple(msg.counts)
    if not bounds or len(bounds) > MAX_HISTOGRAM_BUCKETS or len(bounds) != len(counts):
        return None
    if any(a >= b for a, b in zip(bounds, bounds[1:])) or any(
        a > b for a, b in zip((*counts, msg.count), (*counts[1:], msg.count))
    ):
        return None
    return Histogram(bounds, counts, msg.count)


def _cost(value: float) -> float:
    """A reported cost as the router may use it: a positive finite number, else 0 (not measured)."""
    return value if math.isfinite(value) and value > 0 else 0.0


def load_from_proto(msg: broker_pb2.Load) -> Load:
    router = None
    if msg.HasField("router"):
        r = msg.router
        router = RouterLoad(
            requests_total=r.requests_total,
            prompt_tokens_total=r.prompt_tokens_total,
            output_tokens_total=r.output_tokens_total,
            ttft=_histogram_from_proto(r.ttft) if r.HasField("ttft") else None,
            tpot=_histogram_from_proto(r.tpot) if r.HasField("tpot") else None,
        )
    return Load(
        slots_used=msg.slots_used,
        slots_free=msg.slots_free,
        active_requests=msg.active_requests,
        router=router,
        kv_tokens_used=msg.kv_tokens_used,
        kv_tokens_total=msg.kv_tokens_total,
        migrated=msg.migrated,
        migration_fallbacks=msg.migration_fallbacks,
        prefill_tokens_per_s=_cost(msg.prefill_tokens_per_s),
        step_seconds=_cost(msg.step_seconds),
    )


def member_info_to_proto(info: MemberInfo) -> broker_pb2.MemberInfo:
    msg = broker_pb2.MemberInfo(
        worker_id=info.worker_id,
        role=role_to_proto(info.role),
        grpc_endpoint=info.grpc_endpoint,
        engine_id=info.engine_id,
        regions=[
            common_pb2.MemoryRegion(addr=r.addr, len=r.length, mem_type=_MEM_TO_PROTO[r.mem_type]) for r in info.regions
        ],
        revision=info.revision,
        capacity=broker_pb2.Capacity(
            slots_total=info.slots_total,
            slots_free=info.slots_free,
            local_prefill=info.local_prefill,
            prefill_chunk_tokens=info.prefill_chunk_tokens,
        ),
        labels=dict(info.labels),
    )
    if info.kv_layout is not None:
        msg.kv_layout.CopyFrom(layout_to_proto(info.kv_layout))
    return msg


def member_info_from_proto(msg: broker_pb2.MemberInfo) -> MemberInfo:
    """Decode and validate; ValueError names the offending field."""
    regions = []
    for r in msg.regions:
        if r.mem_type not in _MEM_FROM_PROTO:
            raise ValueError(f"region {r.addr:#x} has no valid mem_type (got proto value {r.mem_type})")
        regions.append(MemoryRegion(addr=r.addr, length=r.len, mem_type=_MEM_FROM_PROTO[r.mem_type]))
    info = MemberInfo(
        worker_id=msg.worker_id,
        role=role_from_proto(msg.role),
        grpc_endpoint=msg.grpc_endpoint,
        engine_id=msg.engine_id,
        regions=tuple(regions),
        kv_layout=layout_from_proto(msg.kv_layout) if msg.HasField("kv_layout") else None,
        revision=msg.revision,
        slots_total=msg.capacity.slots_total,
        slots_free=msg.capacity.slots_free,
        labels=dict(msg.labels),
        local_prefill=msg.capacity.local_prefill,
        prefill_chunk_tokens=msg.capacity.prefill_chunk_tokens,
    )
    info.validate()
    return info


def member_to_proto(member: Member) -> broker_pb2.Member:
    return broker_pb2.Member(
        info=member_info_to_proto(member.info),
        state=broker_pb2.MEMBER_STATE_DRAINING if member.draining else broker_pb2.MEMBER_STATE_ACTIVE,
        load=load_to_proto(member.load),
        registered_unix_ms=member.registered_unix_ms,
    )


def member_from_proto(msg: broker_pb2.Member) -> Member:
    return Member(
        info=member_info_from_proto(msg.info),
        draining=msg.state == broker_pb2.MEMBER_STATE_DRAINING,
        load=load_from_proto(msg.load),
        registered_unix_ms=msg.registered_unix_ms,
    )


def event_to_proto(event: MemberEvent) -> broker_pb2.WatchEvent:
    msg = broker_pb2.WatchEvent(type=_EVENT_TO_PROTO[event.type], revision=event.revision)
    if event.member is not None:
        msg.member.CopyFrom(member_to_proto(event.member))
    return msg


def event_from_proto(msg: broker_pb2.WatchEvent) -> MemberEvent:
    """ValueError for an unknown type or a member that does not validate."""
    try:
        kind = _EVENT_FROM_PROTO[msg.type]
    except KeyError:
        raise ValueError(f"unknown watch event type {msg.type}") from None
    member = member_from_proto(msg.member) if msg.HasField("member") else None
    if member is None and kind is not EventType.SYNCED:
        raise ValueError(f"watch event {kind} carries no member")
    return MemberEvent(type=kind, member=member, revision=msg.revision)
