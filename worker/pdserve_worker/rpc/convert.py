"""Proto messages <-> the Python boundary types shared by every role (KVLayout, SamplingParams).

Kept next to the protos' users rather than in each role so that the router, prefill and
decode convert the same way: a field added to the proto is added here once.
"""

from __future__ import annotations

from pdserve.v1 import common_pb2
from pdserve_worker.kv.layout import KVLayout
from pdserve_worker.model.sampling_params import SamplingParams

_SAMPLING_SCALARS: tuple[str, ...] = ("max_tokens", "temperature", "top_k", "top_p", "seed", "ignore_eos")


def layout_to_proto(layout: KVLayout) -> common_pb2.KVLayout:
    return common_pb2.KVLayout(
        num_slots=layout.num_slots,
        num_layers=layout.num_layers,
        max_len=layout.max_len,
        kv_heads=layout.kv_heads,
        head_dim=layout.head_dim,
        dtype=layout.dtype,
        first_layer=layout.first_layer,
    )


def layout_from_proto(msg: common_pb2.KVLayout) -> KVLayout:
    """The layout a peer sent; ValueError names the field when it is not a valid pool geometry."""
    return KVLayout(
        num_slots=msg.num_slots,
        num_layers=msg.num_layers,
        max_len=msg.max_len,
        kv_heads=msg.kv_heads,
        head_dim=msg.head_dim,
        dtype=msg.dtype,
        first_layer=msg.first_layer,
    )


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
    )
    if params.seed is not None:
        msg.seed = params.seed
    return msg


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Unset optional fields take SamplingParams' defaults; pydantic's ValidationError names a bad one."""
    fields: dict[str, object] = {name: getattr(msg, name) for name in _SAMPLING_SCALARS if msg.HasField(name)}
    fields["stop"] = tuple(msg.stop)
    fields["stop_token_ids"] = tuple(msg.stop_token_ids)
    return SamplingParams(**fields)
