"""Proto messages <-> the domain types of the worker roles: one module, so that the router,
prefill and decode convert the same way and a field added to a proto is added here once.

SamplingParams, the grant of a slot (`kv.slots.Grant`), the finish reason, and a
layer-sharded group's hidden state. The vocabulary the operator shares converts in
`pdserve_common` (`kv_layout`: KVLayout; `membership`: members and their events). Torch is
imported only by the hidden-state converters (the router, which uses the others, holds no torch).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pdserve.v1 import common_pb2, shard_pb2, worker_pb2
from pdserve_common.kv_layout import layout_from_proto, layout_to_proto
from pdserve_worker.kv.block_events import EventBatch, runs
from pdserve_worker.kv.slots import NONCE_BYTES, Grant
from pdserve_worker.model.sampling.params import (
    LOGPROB_FLOOR,
    MAX_LOGPROBS,
    FinishReason,
    SamplingParams,
    TokenLogprobs,
    is_logprob,
    is_token_id,
)

if TYPE_CHECKING:
    import torch

_SAMPLING_SCALARS: tuple[str, ...] = (
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "seed",
    "ignore_eos",
    "logprobs",
    "prompt_logprobs",
    "grammar",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "min_p",
    "include_stop_str_in_output",
    "skip_special_tokens",
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
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        logit_bias_ids=[t for t, _ in params.logit_bias],
        logit_bias_values=[b for _, b in params.logit_bias],
        min_tokens=params.min_tokens,
        min_p=params.min_p,
        include_stop_str_in_output=params.include_stop_str_in_output,
        skip_special_tokens=params.skip_special_tokens,
        bad_word_ids=[t for word in params.bad_words for t in word],
        bad_word_lengths=[len(word) for word in params.bad_words],
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        msg.prompt_logprobs = params.prompt_logprobs
    if params.grammar is not None:
        msg.grammar = params.grammar
    return msg


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Unset optional fields take SamplingParams' defaults; pydantic's ValidationError names a bad one."""
    fields: dict[str, object] = {name: getattr(msg, name) for name in _SAMPLING_SCALARS if msg.HasField(name)}
    fields["stop"] = tuple(msg.stop)
    fields["stop_token_ids"] = tuple(msg.stop_token_ids)
    if len(msg.logit_bias_ids) != len(msg.logit_bias_values):
        raise ValueError(
            f"logit_bias_ids ({len(msg.logit_bias_ids)}) and logit_bias_values ({len(msg.logit_bias_values)}) differ in length"
        )
    fields["logit_bias"] = tuple(zip(msg.logit_bias_ids, msg.logit_bias_values, strict=True))
    fields["bad_words"] = _bad_words_from_proto(msg)
    return SamplingParams(**fields)


def _bad_words_from_proto(msg: common_pb2.SamplingParams) -> tuple[tuple[int, ...], ...]:
    ids, lengths = list(msg.bad_word_ids), list(msg.bad_word_lengths)
    if sum(lengths) != len(ids):
        raise ValueError(f"bad_word_lengths sum to {sum(lengths)}, bad_word_ids holds {len(ids)}")
    words, at = [], 0
    for n in lengths:
        words.append(tuple(ids[at : at + n]))
        at += n
    return tuple(words)


def logprobs_to_proto(logprobs: TokenLogprobs) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(
        logprob=logprobs.logprob,
        top_ids=[i for i, _ in logprobs.top],
        top_logprobs=[v for _, v in logprobs.top],
        rank=logprobs.rank,
    )


def logprobs_from_proto(msg: common_pb2.TokenLogprobs, max_top: int = MAX_LOGPROBS) -> TokenLogprobs:
    """The decode's logprobs of a token, refused (ValueError) if they cannot be what it computed."""
    if len(msg.top_ids) != len(msg.top_logprobs) or len(msg.top_ids) > max_top:
        raise ValueError(
            f"logprobs carry {len(msg.top_ids)} ids and {len(msg.top_logprobs)} values (at most {max_top} alternatives)"
        )
    values = [msg.logprob, *msg.top_logprobs]
    if not all(map(is_logprob, values)):
        raise ValueError(f"logprobs outside [{LOGPROB_FLOOR}, 0]: {values[:4]}")
    if not all(map(is_token_id, msg.top_ids)):
        raise ValueError(f"logprobs name negative token ids: {list(msg.top_ids)[:4]}")
    return TokenLogprobs(msg.logprob, tuple(zip(msg.top_ids, msg.top_logprobs, strict=True)), msg.rank)


# ---- grants (worker.proto Grant) ----------------------------------------------------------------


def grant_to_proto(grant: Grant, *, worker_id: str, lease_deadline_unix_ms: int) -> worker_pb2.Grant:
    return worker_pb2.Grant(
        slot=grant.slot,
        generation=grant.generation,
        engine_id=grant.engine_id,
        base_addr=grant.base_addr,
        kv_layout=layout_to_proto(grant.layout),
        lease_deadline_unix_ms=lease_deadline_unix_ms,
        worker_id=worker_id,
        request_id=grant.request_id,
        nonce=bytes.fromhex(grant.nonce),
        blocks=list(grant.blocks),
        shared_blocks=grant.shared,
    )


def grant_from_proto(msg: worker_pb2.Grant, request_id: str = "", what: str = "grant") -> Grant:
    """A peer's grant as a push target; ValueError (naming `what`) when it cannot be pushed into."""
    if not msg.engine_id or not msg.base_addr:
        raise ValueError(f"{what} lacks engine_id or base_addr: {msg.engine_id!r} {msg.base_addr:#x}")
    if len(msg.nonce) != NONCE_BYTES:
        raise ValueError(
            f"{what} lacks its reservation's nonce ({len(msg.nonce)} bytes, need {NONCE_BYTES}): "
            "pass the decode's Reserve answer unchanged"
        )
    layout = layout_from_proto(msg.kv_layout)
    blocks = tuple(msg.blocks)
    if layout.paged:
        # A paged grant is only pushable with its block list, every block inside the pool, and
        # room in it for the request's whole prompt (the push checks the token count).
        if not blocks or len(blocks) * layout.block_tokens > layout.max_len + layout.block_tokens:
            raise ValueError(
                f"{what}: a paged grant needs 1..{-(-layout.max_len // layout.block_tokens)} blocks, got {len(blocks)}"
            )
        bad = [b for b in blocks if b >= layout.num_blocks]
        if bad or len(set(blocks)) != len(blocks):
            raise ValueError(
                f"{what}: blocks must be distinct and below num_blocks {layout.num_blocks}, got {bad or 'repeats'}"
            )
        if msg.shared_blocks > len(blocks):
            raise ValueError(f"{what}: shared_blocks {msg.shared_blocks} > its {len(blocks)} blocks")
    elif blocks:
        raise ValueError(f"{what}: blocks given for a slot pool (block_tokens 0)")
    return Grant(
        request_id=msg.request_id or request_id,
        slot=msg.slot,
        generation=msg.generation,
        engine_id=msg.engine_id,
        base_addr=msg.base_addr,
        layout=layout,
        nonce=msg.nonce.hex(),
        blocks=blocks,
        shared=msg.shared_blocks,
    )


def push_targets_from_proto(request: worker_pb2.PrefillRequest) -> list[Grant]:
    """A Prefill's targets; ValueError names one that is not usable, or says there is none."""
    targets = [grant_from_proto(g, request.request_id, f"targets[{i}]") for i, g in enumerate(request.targets)]
    if not targets:
        raise ValueError("targets is empty: a prefill needs at least one granted decode slot")
    return targets


# ---- finish reasons (worker.proto FinishReason) ---------------------------------------------------

_FINISH_TO_PROTO: dict[FinishReason, int] = {
    FinishReason.STOP: worker_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: worker_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: worker_pb2.FINISH_REASON_ABORT,
}
_FINISH_FROM_PROTO: dict[int, FinishReason] = {v: k for k, v in _FINISH_TO_PROTO.items()}


def finish_reason_to_proto(reason: FinishReason) -> int:
    return _FINISH_TO_PROTO[reason]


def finish_reason_from_proto(value: int) -> FinishReason | None:
    """None for FINISH_REASON_UNSPECIFIED (more events follow); ValueError for a value this
    version does not know."""
    if value == worker_pb2.FINISH_REASON_UNSPECIFIED:
        return None
    try:
        return _FINISH_FROM_PROTO[value]
    except KeyError:
        raise ValueError(f"unknown finish_reason {value}") from None


# ---- a layer-sharded group's hidden state (shard.proto HiddenState) ---------------------------------


def hidden_to_proto(hidden: torch.Tensor, slots: Sequence[int], positions: Sequence[int]) -> shard_pb2.HiddenState:
    """Raw bytes in the model's dtype: the group's members load the same model revision."""
    import torch

    from pdserve_worker.kv.cache import dtype_name

    flat = hidden.detach().to("cpu").contiguous().view(-1)
    return shard_pb2.HiddenState(
        slots=list(slots),
        positions=list(positions),
        shape=list(hidden.shape),
        dtype=dtype_name(hidden.dtype),
        data=flat.view(torch.uint8).numpy().tobytes(),
    )


def hidden_from_proto(message: shard_pb2.HiddenState, device: torch.device | str = "cpu") -> torch.Tensor:
    import torch

    from pdserve_worker.kv.cache import torch_dtype

    dtype = torch_dtype(message.dtype)
    shape = tuple(message.shape)
    expected = dtype.itemsize * int(torch.Size(shape).numel())
    if len(message.data) != expected:
        raise ValueError(
            f"hidden state of shape {shape} {message.dtype} needs {expected} bytes, got {len(message.data)}"
        )
    # bytearray: frombuffer wants a writable buffer, and the tensor must own its memory.
    return torch.frombuffer(bytearray(message.data), dtype=dtype).view(shape).to(device)


def block_events_to_proto(batch: EventBatch, salt: bytes, block_tokens: int) -> worker_pb2.BlockEventsReply:
    """A prefix cache's events (a prefill's or a decode's) as BlockEvents answers them."""
    return worker_pb2.BlockEventsReply(
        epoch=batch.epoch,
        last_seq=batch.last_seq,
        reset=batch.reset,
        runs=[
            worker_pb2.BlockEventRun(stored=stored, disk=disk, block_hashes=hashes)
            for stored, disk, hashes in runs(batch.events)
        ],
        salt=salt,
        block_tokens=block_tokens,
        enabled=True,
    )
