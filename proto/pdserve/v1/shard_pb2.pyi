from pdserve.v1 import common_pb2 as _common_pb2
from pdserve.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeShardRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShardInfo(_message.Message):
    __slots__ = ("worker_id", "engine_id", "base_addr", "kv_layout", "member_index")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_ADDR_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MEMBER_INDEX_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    engine_id: str
    base_addr: int
    kv_layout: _common_pb2.KVLayout
    member_index: int
    def __init__(self, worker_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., base_addr: _Optional[int] = ..., kv_layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., member_index: _Optional[int] = ...) -> None: ...

class HiddenState(_message.Message):
    __slots__ = ("slots", "positions", "shape", "dtype", "data")
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    slots: _containers.RepeatedScalarFieldContainer[int]
    positions: _containers.RepeatedScalarFieldContainer[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    data: bytes
    def __init__(self, slots: _Optional[_Iterable[int]] = ..., positions: _Optional[_Iterable[int]] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class WaitReadyRequest(_message.Message):
    __slots__ = ("slot", "generation", "timeout_ms")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    slot: int
    generation: int
    timeout_ms: int
    def __init__(self, slot: _Optional[int] = ..., generation: _Optional[int] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class WaitReadyReply(_message.Message):
    __slots__ = ("num_tokens", "first_token")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    first_token: int
    def __init__(self, num_tokens: _Optional[int] = ..., first_token: _Optional[int] = ...) -> None: ...

class PushHandoffRequest(_message.Message):
    __slots__ = ("slot", "generation", "nonce", "num_tokens", "targets", "timeout_ms")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    slot: int
    generation: int
    nonce: str
    num_tokens: int
    targets: _containers.RepeatedCompositeFieldContainer[_worker_pb2.Grant]
    timeout_ms: int
    def __init__(self, slot: _Optional[int] = ..., generation: _Optional[int] = ..., nonce: _Optional[str] = ..., num_tokens: _Optional[int] = ..., targets: _Optional[_Iterable[_Union[_worker_pb2.Grant, _Mapping]]] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class PushHandoffReply(_message.Message):
    __slots__ = ("bytes", "puts")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PUTS_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    puts: int
    def __init__(self, bytes: _Optional[int] = ..., puts: _Optional[int] = ...) -> None: ...
