from pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "num_prompt_tokens", "max_tokens", "lease_ms", "share_from", "keep_for_copies", "prompt_token_ids", "cache_scope")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    SHARE_FROM_FIELD_NUMBER: _ClassVar[int]
    KEEP_FOR_COPIES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    lease_ms: int
    share_from: SlotRef
    keep_for_copies: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_scope: str
    def __init__(self, request_id: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., lease_ms: _Optional[int] = ..., share_from: _Optional[_Union[SlotRef, _Mapping]] = ..., keep_for_copies: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., cache_scope: _Optional[str] = ...) -> None: ...

class SlotRef(_message.Message):
    __slots__ = ("slot", "generation")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    slot: int
    generation: int
    def __init__(self, slot: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class Grant(_message.Message):
    __slots__ = ("slot", "generation", "engine_id", "base_addr", "kv_layout", "lease_deadline_unix_ms", "worker_id", "request_id", "group_grants", "nonce", "blocks", "shared_blocks")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_ADDR_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LEASE_DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_GRANTS_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SHARED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    slot: int
    generation: int
    engine_id: str
    base_addr: int
    kv_layout: _common_pb2.KVLayout
    lease_deadline_unix_ms: int
    worker_id: str
    request_id: str
    group_grants: _containers.RepeatedCompositeFieldContainer[Grant]
    nonce: bytes
    blocks: _containers.RepeatedScalarFieldContainer[int]
    shared_blocks: int
    def __init__(self, slot: _Optional[int] = ..., generation: _Optional[int] = ..., engine_id: _Optional[str] = ..., base_addr: _Optional[int] = ..., kv_layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., lease_deadline_unix_ms: _Optional[int] = ..., worker_id: _Optional[str] = ..., request_id: _Optional[str] = ..., group_grants: _Optional[_Iterable[_Union[Grant, _Mapping]]] = ..., nonce: _Optional[bytes] = ..., blocks: _Optional[_Iterable[int]] = ..., shared_blocks: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "slot", "generation", "prompt_token_ids", "sampling", "readiness_timeout_ms", "num_generated", "migrated", "local_prefill")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    READINESS_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_FIELD_NUMBER: _ClassVar[int]
    MIGRATED_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    slot: int
    generation: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    readiness_timeout_ms: int
    num_generated: int
    migrated: bool
    local_prefill: bool
    def __init__(self, request_id: _Optional[str] = ..., slot: _Optional[int] = ..., generation: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., readiness_timeout_ms: _Optional[int] = ..., num_generated: _Optional[int] = ..., migrated: _Optional[bool] = ..., local_prefill: _Optional[bool] = ...) -> None: ...

class TokenEvent(_message.Message):
    __slots__ = ("index", "token_id", "text", "finish_reason", "stop", "kv_bytes_received", "kv_pushed", "ready_wait_s", "num_prompt_tokens", "handover", "logprobs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    KV_PUSHED_FIELD_NUMBER: _ClassVar[int]
    READY_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_id: int
    text: str
    finish_reason: FinishReason
    stop: str
    kv_bytes_received: int
    kv_pushed: bool
    ready_wait_s: float
    num_prompt_tokens: int
    handover: Handover
    logprobs: _common_pb2.TokenLogprobs
    def __init__(self, index: _Optional[int] = ..., token_id: _Optional[int] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stop: _Optional[str] = ..., kv_bytes_received: _Optional[int] = ..., kv_pushed: _Optional[bool] = ..., ready_wait_s: _Optional[float] = ..., num_prompt_tokens: _Optional[int] = ..., handover: _Optional[_Union[Handover, _Mapping]] = ..., logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ...) -> None: ...

class Handover(_message.Message):
    __slots__ = ("num_generated", "seed", "kv_tokens")
    NUM_GENERATED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_generated: int
    seed: int
    kv_tokens: int
    def __init__(self, num_generated: _Optional[int] = ..., seed: _Optional[int] = ..., kv_tokens: _Optional[int] = ...) -> None: ...

class MigrateRequest(_message.Message):
    __slots__ = ("request_id", "slot", "generation", "targets")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    slot: int
    generation: int
    targets: _containers.RepeatedCompositeFieldContainer[Grant]
    def __init__(self, request_id: _Optional[str] = ..., slot: _Optional[int] = ..., generation: _Optional[int] = ..., targets: _Optional[_Iterable[_Union[Grant, _Mapping]]] = ...) -> None: ...

class MigrateReply(_message.Message):
    __slots__ = ("num_tokens", "kv_bytes", "push_seconds")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    PUSH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    kv_bytes: int
    push_seconds: float
    def __init__(self, num_tokens: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., push_seconds: _Optional[float] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id", "slot", "generation", "push_settled")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PUSH_SETTLED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    slot: int
    generation: int
    push_settled: bool
    def __init__(self, request_id: _Optional[str] = ..., slot: _Optional[int] = ..., generation: _Optional[int] = ..., push_settled: _Optional[bool] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DecodeStatus(_message.Message):
    __slots__ = ("worker_id", "slots_total", "slots_used", "slots_free", "active_requests", "draining", "notifies_dropped", "transfer_refusals", "kv_tokens_used", "kv_tokens_total")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SLOTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SLOTS_USED_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FREE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    NOTIFIES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_REFUSALS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    slots_total: int
    slots_used: int
    slots_free: int
    active_requests: int
    draining: bool
    notifies_dropped: int
    transfer_refusals: int
    kv_tokens_used: int
    kv_tokens_total: int
    def __init__(self, worker_id: _Optional[str] = ..., slots_total: _Optional[int] = ..., slots_used: _Optional[int] = ..., slots_free: _Optional[int] = ..., active_requests: _Optional[int] = ..., draining: _Optional[bool] = ..., notifies_dropped: _Optional[int] = ..., transfer_refusals: _Optional[int] = ..., kv_tokens_used: _Optional[int] = ..., kv_tokens_total: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "targets", "num_generated", "cache_scope")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_FIELD_NUMBER: _ClassVar[int]
    CACHE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    targets: _containers.RepeatedCompositeFieldContainer[Grant]
    num_generated: int
    cache_scope: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., targets: _Optional[_Iterable[_Union[Grant, _Mapping]]] = ..., num_generated: _Optional[int] = ..., cache_scope: _Optional[str] = ...) -> None: ...

class PrefillReply(_message.Message):
    __slots__ = ("first_token", "num_tokens", "kv_bytes", "push_seconds", "prefill_seconds", "cached_tokens", "prompt_logprobs")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    PUSH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    num_tokens: int
    kv_bytes: int
    push_seconds: float
    prefill_seconds: float
    cached_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, first_token: _Optional[int] = ..., num_tokens: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., push_seconds: _Optional[float] = ..., prefill_seconds: _Optional[float] = ..., cached_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class BlockEventsRequest(_message.Message):
    __slots__ = ("epoch", "after_seq")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    after_seq: int
    def __init__(self, epoch: _Optional[str] = ..., after_seq: _Optional[int] = ...) -> None: ...

class BlockEventRun(_message.Message):
    __slots__ = ("stored", "disk", "block_hashes")
    STORED_FIELD_NUMBER: _ClassVar[int]
    DISK_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    stored: bool
    disk: bool
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, stored: _Optional[bool] = ..., disk: _Optional[bool] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class BlockEventsReply(_message.Message):
    __slots__ = ("epoch", "last_seq", "reset", "runs", "salt", "block_tokens", "enabled")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    SALT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    last_seq: int
    reset: bool
    runs: _containers.RepeatedCompositeFieldContainer[BlockEventRun]
    salt: bytes
    block_tokens: int
    enabled: bool
    def __init__(self, epoch: _Optional[str] = ..., last_seq: _Optional[int] = ..., reset: _Optional[bool] = ..., runs: _Optional[_Iterable[_Union[BlockEventRun, _Mapping]]] = ..., salt: _Optional[bytes] = ..., block_tokens: _Optional[int] = ..., enabled: _Optional[bool] = ...) -> None: ...

class CancelPrefillRequest(_message.Message):
    __slots__ = ("request_id", "slot", "generation")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    slot: int
    generation: int
    def __init__(self, request_id: _Optional[str] = ..., slot: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class CancelPrefillReply(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...
