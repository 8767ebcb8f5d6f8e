"""Attention through block tables: the one place the model reads and writes a block-paged KV pool.

Plain torch (no paged kernel is wired in): a token's K/V row in the flat per-layer pool is
`table[j // B] * B + j % B` (kv/paged.py), new K/V are written by index, and a row's keys are
gathered into `[rows, key_len, kv_heads, head_dim]` (padded with row 0 and masked) for one
attention call per layer (the native causal kernel where `native.prefill_serves`, else SDPA).
A prompt computed from position 0 attends over its own fresh K/V (no gather).

A decode step (one token per row) attends each row over exactly its own keys, never padded to
the batch's longest row: all rows in one call of the native kernel, or each row in its own SDPA
call. SDPA's last bits depend on the key length, and on the quantized route those bits become
other tokens, so a seeded request's text would depend on its neighbours (issue #17). Row by row
it does not (tests/unit/test_batch_invariance.py). On an NPU torch_npu's paged attention
operator belongs here (the same per-layer `[num_blocks, block_size, kv_heads, head_dim]` cache).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve_worker.kv.paged import PagedKVCache, rows_of
from pdserve_worker.model.layers import native
from pdserve_worker.model.layers.native import DecodeRows


@dataclass(frozen=True)
class PagedSegment:
    """Tokens [start, stop) of the packed row (or batch row `row`), written from `position` of a
    handle: `gather` its key rows (None: attend over its own fresh K/V, causal), `mask`."""

    start: int
    stop: int
    position: int
    gather: torch.Tensor | None  # [key_len] flat pool rows
    mask: torch.Tensor | None  # [1, 1, n, key_len] bool, None when plainly causal


@dataclass(frozen=True)
class PagedPlan:
    """What every layer of one call shares when the pool is paged."""

    positions: torch.Tensor  # [B, T] (packed: [total])
    cos: torch.Tensor
    sin: torch.Tensor
    tokens: int
    write_rows: torch.Tensor  # [B * T] (packed: [total]) flat pool rows the new K/V go to
    packed: bool
    segments: tuple[PagedSegment, ...] = ()  # packed: one per prompt
    gather: torch.Tensor | None = None  # batch: [B, key_len] flat rows (padding rows masked)
    mask: torch.Tensor | None = None  # batch: [B, 1, T, key_len]
    rows: tuple[torch.Tensor, ...] = ()  # decode (T == 1): each row's own flat key rows, unpadded
    kernel: DecodeRows | None = None  # decode (T == 1) through the native kernel, when it serves
    causal_self: bool = False  # batch of one row from position 0: attend over its own K/V


def _check(cache: PagedKVCache, slot: int, start: int, n: int) -> Sequence[int]:
    table = cache.table(slot)
    capacity = len(table) * cache.block_tokens
    if start < 0 or start + n > capacity:
        raise IndexError(
            f"positions {start}..{start + n - 1} outside handle {slot}'s {capacity} tokens ({len(table)} blocks)"
        )
    return table


def batch_plan(
    cache: PagedKVCache,
    slots: Sequence[int],
    positions: Sequence[int],
    tokens: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: torch.Tensor,
) -> PagedPlan:
    """Rows of `tokens` tokens each, row b written at `positions[b]`.. of handle `slots[b]`."""
    if len(set(slots)) != len(slots):
        raise ValueError(f"a KV handle appears twice in one batch: {list(slots)}")
    bt, device = cache.block_tokens, cache.device
    tables = [_check(cache, s, p, tokens) for s, p in zip(slots, positions)]
    write = torch.cat([rows_of(t, bt, p, p + tokens) for t, p in zip(tables, positions)]).to(device)
    if len(slots) == 1 and positions[0] == 0:
        return PagedPlan(pos, cos, sin, tokens, write, packed=False, causal_self=True)
    if tokens == 1:
        kernel = native.rows_for(tables, [p + 1 for p in positions], cache.layout.head_dim, device, bt)
        if kernel is not None:
            return PagedPlan(pos, cos, sin, tokens, write, packed=False, kernel=kernel)
        rows = tuple(rows_of(t, bt, 0, p + 1).to(device) for t, p in zip(tables, positions))
        return PagedPlan(pos, cos, sin, tokens, write, packed=False, rows=rows)
    key_len = max(p + tokens for p in positions)
    gather = torch.zeros((len(slots), key_len), dtype=torch.long)
    for b, (t, p) in enumerate(zip(tables, positions)):
        gather[b, : p + tokens] = rows_of(t, bt, 0, p + tokens)
    key_pos = torch.arange(key_len)
    query_pos = torch.as_tensor(list(positions))[:, None] + torch.arange(tokens)[None]
    mask = (key_pos[None, None, :] <= query_pos[:, :, None])[:, None]
    return PagedPlan(pos, cos, sin, tokens, write, packed=False, gather=gather.to(device), mask=mask.to(device))


def packed_plan(
    cache: PagedKVCache,
    slots: Sequence[int],
    starts: Sequence[int],
    lengths: Sequence[int],
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: torch.Tensor,
) -> PagedPlan:
    """Prompts packed in one row: prompt i's `lengths[i]` tokens at `starts[i]`.. of `slots[i]`."""
    if len(set(slots)) != len(slots):
        raise ValueError(f"a KV handle appears twice in one batch: {list(slots)}")
    bt, device = cache.block_tokens, cache.device
    writes, segments, offset = [], [], 0
    for slot, start, n in zip(slots, starts, lengths):
        table = _check(cache, slot, start, n)
        writes.append(rows_of(table, bt, start, start + n))
        gather = mask = None
        if start:
            gather = rows_of(table, bt, 0, start + n).to(device)
            key_pos = torch.arange(start + n)
            mask = (key_pos[None, :] <= (start + torch.arange(n))[:, None])[None, None].to(device)
        segments.append(PagedSegment(offset, offset + n, start, gather, mask))
        offset += n
    return PagedPlan(pos, cos, sin, offset, torch.cat(writes).to(device), packed=True, segments=tuple(segments))


def write_and_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    plan: PagedPlan,
) -> torch.Tensor:
    """Write k/v `[B, T, kv_heads, head_dim]` to their pool rows, then attention of q `[B, T,
    heads, head_dim]` over each row's keys; returns `[B, T, heads * head_dim]`."""
    batch, tokens = q.shape[0], q.shape[1]
    heads, kv_heads, head_dim = q.shape[2], k.shape[2], k.shape[3]
    keys[plan.write_rows] = k.reshape(-1, kv_heads, head_dim)
    values[plan.write_rows] = v.reshape(-1, kv_heads, head_dim)
    gqa = heads != kv_heads
    if plan.packed:
        outs = []
        for seg in plan.segments:
            n = seg.stop - seg.start
            if seg.gather is None:
                kr, vr = k[:, seg.start : seg.stop], v[:, seg.start : seg.stop]
            else:
                kr, vr = keys[seg.gather][None], values[seg.gather][None]
            if native.prefill_serves(q[0], kr[0], vr[0]):  # seg.mask is the same causal rule
                outs.append(native.causal_attention(q[0, seg.start : seg.stop], kr[0], vr[0])[None])
                continue
            out = F.scaled_dot_product_attention(
                q[:, seg.start : seg.stop].transpose(1, 2),
                kr.transpose(1, 2),
                vr.transpose(1, 2),
                attn_mask=seg.mask,
                is_causal=seg.mask is None,
                enable_gqa=gqa,
            )
            outs.append(out.transpose(1, 2).reshape(1, n, heads * head_dim))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    if plan.causal_self and native.prefill_serves(q[0], k[0], v[0]):
        return torch.stack([native.causal_attention(q[b], k[b], v[b]) for b in range(batch)])
    if plan.causal_self:
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=gqa
        )
        return out.transpose(1, 2).reshape(batch, tokens, heads * head_dim)
    if plan.kernel is not None:
        return plan.kernel.attend(q, keys, values)
    if plan.rows:
        # One call per row over its own keys (batch invariance, above); [1, kv_heads, group,
        # head_dim]: the group plays the query-length role (see slot_attention._attend_runs).
        qr = q.reshape(batch, 1, kv_heads, heads // kv_heads, head_dim)
        outs = [
            F.scaled_dot_product_attention(qr[b], keys[r][None].transpose(1, 2), values[r][None].transpose(1, 2))
            for b, r in enumerate(plan.rows)
        ]
        return torch.cat(outs).reshape(batch, 1, heads * head_dim)
    kr = keys[plan.gather].transpose(1, 2)  # [B, kv_heads, key_len, head_dim]
    vr = values[plan.gather].transpose(1, 2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), kr, vr, attn_mask=plan.mask, enable_gqa=gqa)
    return out.transpose(1, 2).reshape(batch, tokens, heads * head_dim)
