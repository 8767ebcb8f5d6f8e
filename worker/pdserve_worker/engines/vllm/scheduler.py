"""Scheduler side of pdserve's vLLM connector, one class per role; plain Python (no vLLM import),
driven by connector.py with vLLM's request and scheduler-output objects.

- `DecodeScheduler`: a request whose kv_transfer_params carry `pdserve_reserve` has its prompt
  loaded externally and asynchronously (`get_num_new_matched_tokens`), so vLLM allocates its
  blocks and parks it in WAITING_FOR_REMOTE_KVS; `update_state_after_alloc` turns them into a
  `Reservation` (block ids, a fresh nonce) for the worker side, which leases and announces
  them. The worker's `finished_recving` (KV in place, failed over, or an abort's quarantine
  over) ends the reservation; vLLM itself holds an aborted waiter's blocks until then.
- `PrefillScheduler`: a request whose kv_transfer_params carry `pdserve_grant` is pushed into
  that grant: each step's `PushOrder` names the blocks computed in the step (its own block
  ids, followed step by step as chunked prefill allocates them) and the decode's blocks they
  go to; the last one is final. An abort before the last sends a failed notify instead.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve_common.logs import kv
from pdserve_worker.engines.vllm.decode_worker import Reservation
from pdserve_worker.engines.vllm.grant import GRANT_PARAM, RESERVE_PARAM, VllmGrant
from pdserve_worker.engines.vllm.prefill_worker import PushOrder

log = logging.getLogger(__name__)


def _params(request: Any) -> dict[str, Any]:
    params = getattr(request, "kv_transfer_params", None)
    return params if isinstance(params, dict) else {}


def _blocks_of(blocks: Any) -> list[int]:
    """Group 0's block ids of vLLM's `KVCacheBlocks` (one attention group is all this connector moves)."""
    groups = blocks.get_block_ids()
    if len(groups) != 1:
        raise ValueError(f"pdserve's vLLM connector moves one KV cache group, the model has {len(groups)}")
    return list(groups[0])


@dataclass
class DecodeStep:
    """The decode scheduler's metadata for one step."""

    new: list[Reservation] = field(default_factory=list)
    ended: list[str] = field(default_factory=list)


class DecodeScheduler:
    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._reserved: set[str] = set()  # granted, not yet reported received by the worker
        self._granted: set[str] = set()  # granted once while alive: a failed load recomputes, never re-reserves
        self._step = DecodeStep()

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        if not _params(request).get(RESERVE_PARAM) or request.request_id in self._granted:
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens <= 0 or not _params(request).get(RESERVE_PARAM) or request.request_id in self._granted:
            return
        num_tokens = len(request.prompt_token_ids)
        first_block = (num_tokens - num_external_tokens) // self.block_tokens
        last_block = -(-num_tokens // self.block_tokens)
        ids = _blocks_of(blocks)[first_block:last_block]
        if len(ids) != last_block - first_block:
            raise ValueError(f"request {request.request_id}: {len(ids)} blocks for blocks {first_block}..{last_block}")
        self._reserved.add(request.request_id)
        self._granted.add(request.request_id)
        tag = str(_params(request)[RESERVE_PARAM])[:256]
        nonce = secrets.token_hex(16)
        self._step.new.append(Reservation(request.request_id, nonce, num_tokens, first_block, tuple(ids), tag))

    def build_connector_meta(self) -> DecodeStep:
        step, self._step = self._step, DecodeStep()
        return step

    def request_finished(self, request: Any) -> tuple[bool, None]:
        """An abort while the KV is still due: the worker revokes and quarantines (vLLM keeps
        the blocks of a WAITING_FOR_REMOTE_KVS request until the worker reports it)."""
        if request.request_id in self._reserved:
            self._step.ended.append(request.request_id)
        self._granted.discard(request.request_id)
        return False, None

    def update_connector_output(self, finished_recving: Sequence[str]) -> None:
        self._reserved.difference_update(finished_recving)

    def has_pending_push_work(self) -> bool:
        return bool(self._reserved)


@dataclass
class _Prefilling:
    grant: VllmGrant | None
    blocks: list[int]
    pushed_until: int  # tokens before this are in the decode already (or were pushed)
    error: str = ""


class PrefillScheduler:
    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._requests: dict[str, _Prefilling] = {}
        self._cancelled: list[PushOrder] = []

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        raw = _params(request).get(GRANT_PARAM)
        if raw is None or request.request_id in self._requests:
            return
        try:
            grant = VllmGrant.from_wire(raw)
            if grant.num_tokens != len(request.prompt_token_ids):
                raise ValueError(
                    f"grant is for {grant.num_tokens} tokens, the prompt has {len(request.prompt_token_ids)}"
                )
            if grant.geometry is None or grant.geometry.block_tokens != self.block_tokens:
                raise ValueError(f"grant's block size differs from this engine's {self.block_tokens}")
        except ValueError as exc:
            log.warning(kv(event="vllm_grant_refused", request=request.request_id, error=exc))
            return  # (no valid grant: nothing to notify; the decode times out and recomputes)
        self._requests[request.request_id] = _Prefilling(grant, [], grant.first_block * self.block_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> list[PushOrder]:
        orders, self._cancelled = self._cancelled, []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None:
                state.blocks = _blocks_of_ids(new.block_ids)
                orders.append(self._order(new.req_id, state, new.num_computed_tokens + scheduled[new.req_id]))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            added = cached.new_block_ids[i]
            if added is not None:
                fresh = _blocks_of_ids(added)
                state.blocks = fresh if req_id in cached.resumed_req_ids else state.blocks + fresh
            orders.append(self._order(req_id, state, cached.num_computed_tokens[i] + scheduled[req_id]))
        return orders

    def _order(self, req_id: str, state: _Prefilling, end: int) -> PushOrder:
        grant = state.grant
        assert grant is not None
        end = min(end, grant.num_tokens)
        bt = self.block_tokens
        first, stop = state.pushed_until // bt, -(-end // bt)
        final = end >= grant.num_tokens
        src = tuple(state.blocks[first:stop])
        dst = grant.block_ids[first - grant.first_block : stop - grant.first_block]
        error = "" if len(src) == len(dst) == stop - first else f"{len(src)} own blocks for {stop - first} to push"
        state.pushed_until = end if final else end // bt * bt  # a partial block goes again next step
        if final or error:
            del self._requests[req_id]
        return PushOrder(grant, src, tuple(dst), final, error)

    def request_finished(self, request: Any) -> tuple[bool, None]:
        """Finished before its last push (aborted): its decode hears so (a failed notify)."""
        state = self._requests.pop(request.request_id, None)
        if state is not None and state.grant is not None:
            self._cancelled.append(PushOrder(state.grant, (), (), True, "the prefill request ended early"))
        return False, None

    def has_pending_push_work(self) -> bool:
        return bool(self._cancelled)


def _blocks_of_ids(groups: Sequence[Sequence[int]]) -> list[int]:
    if len(groups) != 1:
        raise ValueError(f"pdserve's vLLM connector moves one KV cache group, the model has {len(groups)}")
    return list(groups[0])
