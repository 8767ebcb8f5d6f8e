"""Proto <-> Python boundary types: round trips, defaults of unset fields, validation."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from pdserve.v1 import broker_pb2, common_pb2
from pdserve_common.kv_layout import DTYPE_SIZES, KVLayout, layout_from_proto, layout_to_proto
from pdserve_common.membership import (
    EventType,
    Load,
    Member,
    MemberEvent,
    MemberInfo,
    MemoryRegion,
    MemType,
    Role,
    event_from_proto,
    event_to_proto,
    member_from_proto,
    member_info_from_proto,
    member_info_to_proto,
    member_to_proto,
)
from pdserve_worker.model.sampling.params import SamplingParams
from pdserve_worker.rpc.convert import sampling_from_proto, sampling_to_proto

layouts = st.builds(
    KVLayout,
    num_slots=st.integers(1, 4096),
    num_layers=st.integers(1, 128),
    max_len=st.integers(1, 1 << 20),
    kv_heads=st.integers(1, 64),
    head_dim=st.integers(1, 512),
    dtype=st.sampled_from(sorted(DTYPE_SIZES)),
    first_layer=st.integers(0, 127),
)


@given(layouts)
def test_layout_round_trip(layout: KVLayout) -> None:
    back = layout_from_proto(common_pb2.KVLayout.FromString(layout_to_proto(layout).SerializeToString()))
    assert back == layout


def test_layout_from_an_empty_message_names_the_field() -> None:
    with pytest.raises(ValueError, match="num_slots"):
        layout_from_proto(common_pb2.KVLayout())


sampling = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 10_000),
    temperature=st.floats(0.0, 100.0),
    top_k=st.integers(0, 1000),
    top_p=st.floats(0.0, 1.0, exclude_min=True),
    seed=st.none() | st.integers(-(2**63), 2**63 - 1),
    stop=st.lists(st.text(min_size=1, max_size=5), max_size=3).map(tuple),  # empty stop strings are refused
    stop_token_ids=st.lists(st.integers(0, 2**31 - 1), max_size=3).map(tuple),
    ignore_eos=st.booleans(),
    include_stop_str_in_output=st.booleans(),
    skip_special_tokens=st.booleans(),
)


@given(sampling)
def test_sampling_round_trip(params: SamplingParams) -> None:
    wire = common_pb2.SamplingParams.FromString(sampling_to_proto(params).SerializeToString())
    assert sampling_from_proto(wire) == params


def test_unset_sampling_fields_take_the_defaults_not_zero() -> None:
    params = sampling_from_proto(common_pb2.SamplingParams(max_tokens=5))
    assert params == SamplingParams(max_tokens=5)
    assert params.temperature == 1.0 and params.top_p == 1.0 and params.seed is None


def test_invalid_sampling_is_refused_with_the_field_name() -> None:
    with pytest.raises(ValidationError, match="top_p"):
        sampling_from_proto(common_pb2.SamplingParams(top_p=2.0))


def sharded_decode() -> MemberInfo:
    layout = KVLayout(num_slots=8, num_layers=15, max_len=512, kv_heads=3, head_dim=64, first_layer=15)
    return MemberInfo(
        worker_id="decode-1",
        role=Role.DECODE,
        grpc_endpoint="10.1.2.3:7000",
        engine_id="10.1.2.3:7100",
        regions=(MemoryRegion(0x7F0000000000, layout.total_bytes, MemType.DEVICE),),
        kv_layout=layout,
        revision="abc123",
        slots_total=8,
        slots_free=6,
        labels={"node": "n1"},
    )


def test_member_round_trip_with_layer_range_and_regions() -> None:
    member = Member(info=sharded_decode(), draining=True, load=Load(2, 6, 2), registered_unix_ms=123)
    wire = broker_pb2.Member.FromString(member_to_proto(member).SerializeToString())
    assert wire.info.regions[0].mem_type == common_pb2.MEM_TYPE_DEVICE
    assert wire.state == broker_pb2.MEMBER_STATE_DRAINING
    assert member_from_proto(wire) == member


def test_event_round_trip() -> None:
    event = MemberEvent(EventType.DRAINING, Member(info=sharded_decode(), draining=True), revision=7)
    assert event_from_proto(event_to_proto(event)) == event
    synced = MemberEvent(EventType.SYNCED, None, revision=9)
    assert event_from_proto(event_to_proto(synced)) == synced
    with pytest.raises(ValueError, match="carries no member"):
        event_from_proto(broker_pb2.WatchEvent(type=broker_pb2.WatchEvent.ADDED))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda m: m.ClearField("kv_layout"), "needs a kv_layout"),
        (lambda m: m.ClearField("regions"), "needs the regions"),
        (lambda m: setattr(m.capacity, "slots_total", 9), "slots_total 9 != kv_layout.num_slots 8"),
        (lambda m: setattr(m, "engine_id", "nohost"), "engine_id must be ip:port"),
        (lambda m: setattr(m, "role", broker_pb2.ROLE_UNSPECIFIED), "role must be one of"),
        (lambda m: setattr(m.regions[0], "mem_type", common_pb2.MEM_TYPE_UNSPECIFIED), "mem_type"),
        (lambda m: setattr(m, "worker_id", ""), "worker_id"),
    ],
)
def test_invalid_members_name_the_field(mutate, message: str) -> None:
    msg = member_info_to_proto(sharded_decode())
    mutate(msg)
    with pytest.raises(ValueError, match=message):
        member_info_from_proto(msg)


def test_a_router_needs_no_engine_or_layout() -> None:
    info = MemberInfo(worker_id="router-0", role=Role.ROUTER)
    assert member_info_from_proto(member_info_to_proto(info)) == info


# ---- grants and finish reasons (worker.proto) -----------------------------------------------------


def test_a_grant_crosses_the_wire_and_comes_back_the_same() -> None:
    from pdserve.v1 import worker_pb2
    from pdserve_worker.kv.slots import SlotTable
    from pdserve_worker.rpc.convert import grant_from_proto, grant_to_proto, push_targets_from_proto

    layout = KVLayout(num_slots=4, num_layers=6, max_len=64, kv_heads=2, head_dim=8, first_layer=3)
    grant = SlotTable(layout, engine_id="10.0.0.7:50052", base_addr=0x7F0000).reserve("r7", 30)
    msg = grant_to_proto(grant, worker_id="decode-1", lease_deadline_unix_ms=123)
    assert (msg.worker_id, msg.lease_deadline_unix_ms, len(msg.nonce)) == ("decode-1", 123, 16)
    assert grant_from_proto(worker_pb2.Grant.FromString(msg.SerializeToString())) == grant
    request = worker_pb2.PrefillRequest(request_id="r7", targets=[msg, msg])
    assert push_targets_from_proto(request) == [grant, grant]
    with pytest.raises(ValueError, match="targets is empty"):
        push_targets_from_proto(worker_pb2.PrefillRequest(request_id="r7"))
    forged = worker_pb2.Grant()
    forged.CopyFrom(msg)
    forged.nonce = b""
    with pytest.raises(ValueError, match=r"targets\[1\] lacks its reservation's nonce"):
        push_targets_from_proto(worker_pb2.PrefillRequest(request_id="r7", targets=[msg, forged]))
    forged.CopyFrom(msg)
    forged.base_addr = 0
    with pytest.raises(ValueError, match="lacks engine_id or base_addr"):
        grant_from_proto(forged)


def test_every_finish_reason_has_one_proto_value_and_back() -> None:
    from pdserve.v1 import worker_pb2
    from pdserve_worker.model.sampling.params import FinishReason
    from pdserve_worker.rpc.convert import finish_reason_from_proto, finish_reason_to_proto

    values = {finish_reason_to_proto(r) for r in FinishReason}
    assert len(values) == len(FinishReason) and worker_pb2.FINISH_REASON_UNSPECIFIED not in values
    assert all(finish_reason_from_proto(finish_reason_to_proto(r)) is r for r in FinishReason)
    assert finish_reason_from_proto(worker_pb2.FINISH_REASON_UNSPECIFIED) is None
    with pytest.raises(ValueError, match="unknown finish_reason 99"):
        finish_reason_from_proto(99)
