"""Attention over a slot pool (kv/cache.py): each request owns one slot of max_len tokens.

The counterpart of paged_attention.py for the slot pool: a plan per call (positions, rotary
angles, runs of consecutive slots), then per layer the K/V write and attention. Batched rows
read the KV of consecutive slots as one strided view of the pool with a length mask instead
of gathering it (a gather costs more than the attention itself); a decode step runs each row
alone over exactly its own keys (batch invariance: model/layers/paged_attention.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve_worker.kv.cache import KVCache
from pdserve_worker.model.layers import native
from pdserve_worker.model.layers.native import DecodeRows


@dataclass(frozen=True)
class SlotRun:
    """Rows [row_start, row_stop) of a batch whose slots are consecutive from `slot_start`."""

    row_start: int
    row_stop: int
    slot_start: int
    key_len: int  # keys to read per slot: max(position + T) over the run's rows
    mask: torch.Tensor | None  # [rows, 1, T, key_len] bool (True = attend), None when plainly causal/full


@dataclass(frozen=True)
class SlotSegment:
    """Tokens [start, stop) of a packed row: one prompt, written at `position`.. of `slot`."""

    start: int
    stop: int
    slot: int
    position: int
    mask: torch.Tensor | None  # [1, 1, n, position + n] bool, None when plainly causal (position 0)


@dataclass(frozen=True)
class SlotPlan:
    """What every layer of one call shares: positions, rotary angles, slot runs.

    A packed plan (`segments` set) holds several prompts in one row `[1, total, hidden]`:
    `slots` and `positions` are then per token `[total]`, and attention runs per segment."""

    slots: torch.Tensor  # [B] long (packed: [total])
    positions: torch.Tensor  # [B, T] long (packed: [total])
    first: tuple[int, int]  # (slot, start position) of row 0, as Python ints (no device sync per layer)
    cos: torch.Tensor  # [B, T, 1, head_dim]
    sin: torch.Tensor
    runs: tuple[SlotRun, ...]
    tokens: int  # T
    segments: tuple[SlotSegment, ...] = ()
    kernel: DecodeRows | None = None  # a decode step (T == 1) through the native kernel, when it serves


def check_batch(cache: KVCache, slots: Sequence[int], positions: Sequence[int], tokens: int) -> None:
    """Each row's slot once, inside the pool, and its `tokens` positions inside the slot."""
    if len(set(slots)) != len(slots):
        raise ValueError(f"a slot appears twice in one batch: {list(slots)}")
    layout = cache.layout
    for slot, pos in zip(slots, positions):
        if not 0 <= slot < layout.num_slots:
            raise IndexError(f"slot {slot} outside pool of {layout.num_slots} slots")
        if pos < 0 or pos + tokens > layout.max_len:
            raise IndexError(f"positions {pos}..{pos + tokens - 1} outside the slot's max_len {layout.max_len}")


def batch_plan(
    cache: KVCache,
    slots: Sequence[int],
    positions: Sequence[int],
    tokens: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: torch.Tensor,
) -> SlotPlan:
    """Rows of `tokens` tokens each, row b written at `positions[b]`.. of slot `slots[b]`
    (checked by `check_batch`); `pos` `[B, T]` on the model's device."""
    device = pos.device
    kernel = None
    if tokens == 1:  # a slot is one block of max_len tokens
        kernel = native.rows_for([[s] for s in slots], [p + 1 for p in positions], cache.layout.head_dim, device)
    return SlotPlan(
        slots=torch.tensor(list(slots), dtype=torch.long, device=device),
        positions=pos,
        first=(int(slots[0]), int(positions[0])),
        cos=cos,
        sin=sin,
        runs=() if kernel is not None else runs(list(slots), list(positions), tokens, device),
        tokens=tokens,
        kernel=kernel,
    )


def packed_plan(
    cache: KVCache,
    slots: list[int],
    starts: list[int],
    lengths: list[int],
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: torch.Tensor,
) -> SlotPlan:
    """Prompts packed in one row: prompt i's `lengths[i]` tokens at `starts[i]`.. of `slots[i]`
    (checked by `check_batch` per prompt); `pos` `[total]` on the model's device."""
    device = pos.device
    segments, offset = [], 0
    for slot, start, n in zip(slots, starts, lengths):
        mask = None
        if start:
            key_pos = torch.arange(start + n)
            mask = (key_pos[None, :] <= (start + torch.arange(n))[:, None])[None, None].to(device)
        segments.append(SlotSegment(offset, offset + n, slot, start, mask))
        offset += n
    token_slots = torch.cat([torch.full((n,), slot, dtype=torch.long) for slot, n in zip(slots, lengths)])
    return SlotPlan(
        slots=token_slots.to(device),
        positions=pos,
        first=(slots[0], starts[0]),
        cos=cos,
        sin=sin,
        runs=(),
        tokens=offset,
        segments=tuple(segments),
    )


def check_packed(cache: KVCache, slots: list[int], starts: list[int], lengths: list[int]) -> None:
    """Each prompt's slot once, inside the pool, and its positions inside the slot."""
    if len(set(slots)) != len(slots):
        raise ValueError(f"a slot appears twice in one batch: {slots}")
    layout = cache.layout
    for slot, start, n in zip(slots, starts, lengths):
        if not 0 <= slot < layout.num_slots:
            raise IndexError(f"slot {slot} outside pool of {layout.num_slots} slots")
        if start < 0 or start + n > layout.max_len:
            raise IndexError(f"positions {start}..{start + n - 1} outside the slot's max_len {layout.max_len}")


def runs(slots: list[int], positions: list[int], tokens: int, device: torch.device) -> tuple[SlotRun, ...]:
    """Split the batch into maximal runs of rows whose slots are consecutive.

    One SDPA call per run reads the run's KV as a strided view of the pool (no copy).
    Keys past a row's own length inside that view are masked out. A decode step (one token
    per row) runs each row alone over exactly its own keys instead: padding a row to its
    neighbours' length changes the last bits of its attention, which the quantized route's
    bf16 activations turn into other tokens (batch invariance: model/layers/paged_attention.py).
    """
    found: list[SlotRun] = []
    start = 0
    for b in range(1, len(slots) + 1):
        if b < len(slots) and slots[b] == slots[b - 1] + 1 and tokens > 1:
            continue
        rows = range(start, b)
        ends = [positions[r] + tokens for r in rows]
        key_len = max(ends)
        plain = len(rows) == 1 and (tokens == 1 or positions[start] == 0)
        mask = None
        if not plain:
            key_pos = torch.arange(key_len)
            query_pos = torch.tensor([positions[r] for r in rows])[:, None] + torch.arange(tokens)[None]
            mask = (key_pos[None, None, :] <= query_pos[:, :, None])[:, None].to(device)
        found.append(SlotRun(start, b, slots[start], key_len, mask))
        start = b
    return tuple(found)


def write_and_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan: SlotPlan
) -> torch.Tensor:
    """Write k/v `[B, T, kv_heads, head_dim]` into the slots of one layer's `keys`/`values`
    `[slot, token, kv_head, head_dim]`, then attention of q `[B, T, heads, head_dim]` over each
    row's slot; returns `[B, T, heads * head_dim]`."""
    batch, tokens = k.shape[0], k.shape[1]
    if plan.segments:
        keys[plan.slots, plan.positions] = k[0]
        values[plan.slots, plan.positions] = v[0]
    elif batch == 1:
        s, p = plan.first
        keys[s, p : p + tokens] = k[0]
        values[s, p : p + tokens] = v[0]
    else:
        keys[plan.slots[:, None], plan.positions] = k
        values[plan.slots[:, None], plan.positions] = v
    if plan.kernel is not None:  # [slot, token, kv_head, head_dim]: a slot is one block
        return plan.kernel.attend(q, keys, values)
    if plan.segments:
        return _attend_segments(q, keys, values, plan)
    return _attend_runs(q, keys, values, plan)


def _attend_segments(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan: SlotPlan) -> torch.Tensor:
    """Packed prompts: each attends over its own slot."""
    heads, kv_heads, head_dim = q.shape[2], keys.shape[2], keys.shape[3]
    outs = []
    for seg in plan.segments:
        n, end = seg.stop - seg.start, seg.position + seg.stop - seg.start
        if native.prefill_serves(q[0], keys[seg.slot], values[seg.slot]):  # seg.mask is its rule
            attn = native.causal_attention(q[0, seg.start : seg.stop], keys[seg.slot, :end], values[seg.slot, :end])
            outs.append(attn[None])
            continue
        kr = keys[seg.slot : seg.slot + 1, :end].transpose(1, 2)
        vr = values[seg.slot : seg.slot + 1, :end].transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q[:, seg.start : seg.stop].transpose(1, 2),
            kr,
            vr,
            attn_mask=seg.mask,
            is_causal=seg.mask is None,
            enable_gqa=heads != kv_heads,
        )
        outs.append(out.transpose(1, 2).reshape(1, n, heads * head_dim))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def _attend_runs(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan: SlotPlan) -> torch.Tensor:
    """Rows by runs of consecutive slots, one attention call per run."""
    heads, kv_heads, head_dim = q.shape[2], keys.shape[2], keys.shape[3]
    tokens = q.shape[1]
    outs = []
    for run in plan.runs:
        n = run.row_stop - run.row_start
        q_run = q[run.row_start : run.row_stop]
        kr = keys[run.slot_start : run.slot_start + n, : run.key_len].transpose(1, 2)
        vr = values[run.slot_start : run.slot_start + n, : run.key_len].transpose(1, 2)
        if tokens == 1:
            # [rows, kv_heads, group, head_dim]: the group plays the query-length role.
            qr = q_run.reshape(n, kv_heads, heads // kv_heads, head_dim)
            outs.append(F.scaled_dot_product_attention(qr, kr, vr, attn_mask=run.mask).reshape(n, 1, heads * head_dim))
        elif native.prefill_serves(q[0], keys[0], values[0]):  # run.mask is the same causal rule
            ends = (plan.positions[run.row_start : run.row_stop, -1] + 1).tolist()
            rows = zip(range(run.slot_start, run.slot_start + n), ends, strict=True)
            attn = [
                native.causal_attention(q_run[i], keys[slot, :end], values[slot, :end])
                for i, (slot, end) in enumerate(rows)
            ]
            outs.append(torch.stack(attn))
        else:
            out = F.scaled_dot_product_attention(
                q_run.transpose(1, 2),
                kr,
                vr,
                attn_mask=run.mask,
                is_causal=run.mask is None,
                enable_gqa=heads != kv_heads,
            )
            outs.append(out.transpose(1, 2).reshape(n, tokens, heads * head_dim))
    return outs[0] if len(outs) == 1 else torch.cat(outs)
