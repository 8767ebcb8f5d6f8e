"""A decode's prefix cache: the whole KV blocks of ended requests, kept for later prompts that
start the same way (the next turn of a conversation), as vLLM keeps a decode's blocks and
SGLang's decode keeps a radix cache (pure logic; kv/blocks.py's lock guards it).

When a committed reservation ends, each whole block of the tokens whose KV it holds (its
prompt, then what it generated but the last token) stays findable by the prefill's hash chain
(kv/prefix_cache.py `block_hashes` over `scoped_salt(salt, scope)`), so a block is found only
by a prompt of the same model, dtype, block size and scope (tenant and `cache_salt`): one
tenant never finds another's. A later reservation whose prompt starts with them takes them
read-only (`BlockTable.reserve`), and only the rest is pushed or computed. At least one prompt
position is always left to compute (its logits draw the first token).

Each kept block holds one reference of the BlockTable's refcount. Kept blocks never refuse a
request: a reservation short of free blocks evicts the least recently used entries first, tail
blocks of a chain before its head (a match touches a chain from its end), so what stays is a
findable prefix. What is stored and evicted goes to a `BlockEventLog` (kv/block_events.py),
which routers follow to send a conversation back to the decode that holds it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve_worker.kv.prefix_cache import block_hashes, scoped_salt

if TYPE_CHECKING:
    from pdserve_worker.kv.block_events import BlockEventLog


@dataclass(frozen=True)
class Hit:
    """The longest cached prefix of a prompt: its blocks, and the tokens they hold."""

    blocks: tuple[int, ...] = ()
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class _Entry:
    block: int
    token_ids: tuple[int, ...]


class DecodePrefixCache:
    def __init__(self, salt: bytes, block_tokens: int, events: BlockEventLog | None = None) -> None:
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be positive, got {block_tokens}")
        self.salt, self.block_tokens, self.events = salt, block_tokens, events
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self.hit_blocks = 0  # blocks found by reservations (a metric)

    def __len__(self) -> int:
        return len(self._entries)

    def hashes(self, token_ids: Sequence[int], scope: str) -> list[bytes]:
        return block_hashes(token_ids, self.block_tokens, scoped_salt(self.salt, scope))

    def match(self, prompt_ids: Sequence[int], scope: str) -> Hit:
        """The cached blocks `prompt_ids` starts with, leaving its last position uncached."""
        limit = (len(prompt_ids) - 1) // self.block_tokens
        found: list[tuple[bytes, _Entry]] = []
        for h in self.hashes(prompt_ids[: limit * self.block_tokens], scope):
            entry = self._entries.get(h)
            if entry is None:
                break
            found.append((h, entry))
        for h, _ in reversed(found):  # the head ends most recently used: the tail goes first
            self._entries.move_to_end(h)
        self.hit_blocks += len(found)
        return Hit(tuple(e.block for _, e in found), tuple(t for _, e in found for t in e.token_ids))

    def keep(self, token_ids: Sequence[int], scope: str, blocks: Sequence[int]) -> list[int]:
        """An ended request's `blocks` hold the KV of `token_ids`: keep each whole block (taking
        over its reference). Returns the blocks whose references the caller still gives back
        (a partial last block, and blocks whose prefix is cached already under another block)."""
        hashes = self.hashes(token_ids, scope)[: len(blocks)]
        stored: list[bytes] = []
        back: list[int] = []
        for i, (h, block) in enumerate(zip(hashes, blocks, strict=False)):
            entry = self._entries.get(h)
            if entry is None:
                tokens = tuple(token_ids[i * self.block_tokens : (i + 1) * self.block_tokens])
                self._entries[h] = _Entry(block, tokens)
                stored.append(h)
            else:
                back.append(block)
        for h in reversed(hashes):  # the head ends most recently used: the tail goes first
            self._entries.move_to_end(h)
        back.extend(blocks[len(hashes) :])
        if stored and self.events is not None:
            self.events.record(True, False, stored)
        return back

    def evict(self, room: int, only_cache_holds: Callable[[int], bool]) -> list[int]:
        """Drop least recently used entries whose block only the cache holds until `room` blocks
        would be free (one a reservation also reads would free nothing: it stays). Returns the
        dropped entries' blocks, whose references the caller gives back."""
        dropped = [h for h, e in self._entries.items() if only_cache_holds(e.block)][: max(room, 0)]
        return self._drop(dropped)

    def clear(self) -> list[int]:
        return self._drop(list(self._entries))

    def _drop(self, hashes: list[bytes]) -> list[int]:
        blocks = [self._entries.pop(h).block for h in hashes]
        if hashes and self.events is not None:
            self.events.record(False, False, hashes)
        return blocks

    def blocks(self) -> list[int]:
        return [e.block for e in self._entries.values()]

    def held(self) -> list[tuple[bool, bytes]]:
        """(disk, hash) of every entry: a BlockEventLog's snapshot."""
        return [(False, h) for h in self._entries]
