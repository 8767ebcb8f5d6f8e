from pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_PREFILL: _ClassVar[Role]
    ROLE_DECODE: _ClassVar[Role]
    ROLE_ROUTER: _ClassVar[Role]

class MemberState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMBER_STATE_UNSPECIFIED: _ClassVar[MemberState]
    MEMBER_STATE_ACTIVE: _ClassVar[MemberState]
    MEMBER_STATE_DRAINING: _ClassVar[MemberState]
ROLE_UNSPECIFIED: Role
ROLE_PREFILL: Role
ROLE_DECODE: Role
ROLE_ROUTER: Role
MEMBER_STATE_UNSPECIFIED: MemberState
MEMBER_STATE_ACTIVE: MemberState
MEMBER_STATE_DRAINING: MemberState

class Capacity(_message.Message):
    __slots__ = ("slots_total", "slots_free", "local_prefill", "prefill_chunk_tokens")
    SLOTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FREE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    slots_total: int
    slots_free: int
    local_prefill: bool
    prefill_chunk_tokens: int
    def __init__(self, slots_total: _Optional[int] = ..., slots_free: _Optional[int] = ..., local_prefill: _Optional[bool] = ..., prefill_chunk_tokens: _Optional[int] = ...) -> None: ...

class LatencyHistogram(_message.Message):
    __slots__ = ("bounds", "counts", "count")
    BOUNDS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    bounds: _containers.RepeatedScalarFieldContainer[float]
    counts: _containers.RepeatedScalarFieldContainer[int]
    count: int
    def __init__(self, bounds: _Optional[_Iterable[float]] = ..., counts: _Optional[_Iterable[int]] = ..., count: _Optional[int] = ...) -> None: ...

class RouterLoad(_message.Message):
    __slots__ = ("requests_total", "prompt_tokens_total", "output_tokens_total", "ttft", "tpot")
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TTFT_FIELD_NUMBER: _ClassVar[int]
    TPOT_FIELD_NUMBER: _ClassVar[int]
    requests_total: int
    prompt_tokens_total: int
    output_tokens_total: int
    ttft: LatencyHistogram
    tpot: LatencyHistogram
    def __init__(self, requests_total: _Optional[int] = ..., prompt_tokens_total: _Optional[int] = ..., output_tokens_total: _Optional[int] = ..., ttft: _Optional[_Union[LatencyHistogram, _Mapping]] = ..., tpot: _Optional[_Union[LatencyHistogram, _Mapping]] = ...) -> None: ...

class Load(_message.Message):
    __slots__ = ("slots_used", "slots_free", "active_requests", "router", "kv_tokens_used", "kv_tokens_total", "migrated", "migration_fallbacks", "prefill_tokens_per_s", "step_seconds")
    SLOTS_USED_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FREE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ROUTER_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MIGRATED_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    slots_used: int
    slots_free: int
    active_requests: int
    router: RouterLoad
    kv_tokens_used: int
    kv_tokens_total: int
    migrated: int
    migration_fallbacks: int
    prefill_tokens_per_s: float
    step_seconds: float
    def __init__(self, slots_used: _Optional[int] = ..., slots_free: _Optional[int] = ..., active_requests: _Optional[int] = ..., router: _Optional[_Union[RouterLoad, _Mapping]] = ..., kv_tokens_used: _Optional[int] = ..., kv_tokens_total: _Optional[int] = ..., migrated: _Optional[int] = ..., migration_fallbacks: _Optional[int] = ..., prefill_tokens_per_s: _Optional[float] = ..., step_seconds: _Optional[float] = ...) -> None: ...

class MemberInfo(_message.Message):
    __slots__ = ("worker_id", "role", "grpc_endpoint", "engine_id", "regions", "kv_layout", "revision", "capacity", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    GRPC_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: Role
    grpc_endpoint: str
    engine_id: str
    regions: _containers.RepeatedCompositeFieldContainer[_common_pb2.MemoryRegion]
    kv_layout: _common_pb2.KVLayout
    revision: str
    capacity: Capacity
    labels: _containers.ScalarMap[str, str]
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., grpc_endpoint: _Optional[str] = ..., engine_id: _Optional[str] = ..., regions: _Optional[_Iterable[_Union[_common_pb2.MemoryRegion, _Mapping]]] = ..., kv_layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., revision: _Optional[str] = ..., capacity: _Optional[_Union[Capacity, _Mapping]] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class Member(_message.Message):
    __slots__ = ("info", "state", "load", "registered_unix_ms")
    INFO_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    info: MemberInfo
    state: MemberState
    load: Load
    registered_unix_ms: int
    def __init__(self, info: _Optional[_Union[MemberInfo, _Mapping]] = ..., state: _Optional[_Union[MemberState, str]] = ..., load: _Optional[_Union[Load, _Mapping]] = ..., registered_unix_ms: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("service_key", "member", "draining", "replaces_lease_id")
    SERVICE_KEY_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    REPLACES_LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    service_key: str
    member: MemberInfo
    draining: bool
    replaces_lease_id: str
    def __init__(self, service_key: _Optional[str] = ..., member: _Optional[_Union[MemberInfo, _Mapping]] = ..., draining: _Optional[bool] = ..., replaces_lease_id: _Optional[str] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("lease_id", "ttl_ms", "broker_id")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    ttl_ms: int
    broker_id: str
    def __init__(self, lease_id: _Optional[str] = ..., ttl_ms: _Optional[int] = ..., broker_id: _Optional[str] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("service_key", "lease_id", "load")
    SERVICE_KEY_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    service_key: str
    lease_id: str
    load: Load
    def __init__(self, service_key: _Optional[str] = ..., lease_id: _Optional[str] = ..., load: _Optional[_Union[Load, _Mapping]] = ...) -> None: ...

class KeepAliveReply(_message.Message):
    __slots__ = ("ttl_ms", "broker_id", "draining")
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    ttl_ms: int
    broker_id: str
    draining: bool
    def __init__(self, ttl_ms: _Optional[int] = ..., broker_id: _Optional[str] = ..., draining: _Optional[bool] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("service_key", "roles")
    SERVICE_KEY_FIELD_NUMBER: _ClassVar[int]
    ROLES_FIELD_NUMBER: _ClassVar[int]
    service_key: str
    roles: _containers.RepeatedScalarFieldContainer[Role]
    def __init__(self, service_key: _Optional[str] = ..., roles: _Optional[_Iterable[_Union[Role, str]]] = ...) -> None: ...

class WatchEvent(_message.Message):
    __slots__ = ("type", "member", "revision")
    class Type(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        TYPE_UNSPECIFIED: _ClassVar[WatchEvent.Type]
        ADDED: _ClassVar[WatchEvent.Type]
        UPDATED: _ClassVar[WatchEvent.Type]
        DRAINING: _ClassVar[WatchEvent.Type]
        REMOVED: _ClassVar[WatchEvent.Type]
        SYNCED: _ClassVar[WatchEvent.Type]
    TYPE_UNSPECIFIED: WatchEvent.Type
    ADDED: WatchEvent.Type
    UPDATED: WatchEvent.Type
    DRAINING: WatchEvent.Type
    REMOVED: WatchEvent.Type
    SYNCED: WatchEvent.Type
    TYPE_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    type: WatchEvent.Type
    member: Member
    revision: int
    def __init__(self, type: _Optional[_Union[WatchEvent.Type, str]] = ..., member: _Optional[_Union[Member, _Mapping]] = ..., revision: _Optional[int] = ...) -> None: ...

class SetDrainingRequest(_message.Message):
    __slots__ = ("service_key", "lease_id", "worker_id", "draining")
    SERVICE_KEY_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    service_key: str
    lease_id: str
    worker_id: str
    draining: bool
    def __init__(self, service_key: _Optional[str] = ..., lease_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., draining: _Optional[bool] = ...) -> None: ...

class SetDrainingReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("service_key", "lease_id")
    SERVICE_KEY_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    service_key: str
    lease_id: str
    def __init__(self, service_key: _Optional[str] = ..., lease_id: _Optional[str] = ...) -> None: ...

class DeregisterReply(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: bool
    def __init__(self, removed: _Optional[bool] = ...) -> None: ...

class ListMembersRequest(_message.Message):
    __slots__ = ("service_key", "roles")
    SERVICE_KEY_FIELD_NUMBER: _ClassVar[int]
    ROLES_FIELD_NUMBER: _ClassVar[int]
    service_key: str
    roles: _containers.RepeatedScalarFieldContainer[Role]
    def __init__(self, service_key: _Optional[str] = ..., roles: _Optional[_Iterable[_Union[Role, str]]] = ...) -> None: ...

class ListMembersReply(_message.Message):
    __slots__ = ("members", "revision")
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    members: _containers.RepeatedCompositeFieldContainer[Member]
    revision: int
    def __init__(self, members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ..., revision: _Optional[int] = ...) -> None: ...
