"""A decode's prefix cache: the whole KV blocks of ended requests, kept for later prompts that
start the same way (a conversation's next turn), as vLLM's decode keeps blocks and SGLang's a
radix cache. Pure logic with its own lock (taken inside kv/blocks.py's, never around it).

Each whole block of the tokens whose KV an ended request held (its prompt; with
`decode_prefix_answers` what it drew too, but the last) is named by the prefill's hash chain (kv/prefix_cache.py `block_hashes` over
`scoped_salt(salt, scope)`): found only by a prompt of the same model, dtype, block size and
scope (tenant, `cache_salt`). A reservation takes the longest cached prefix read-only
(`BlockTable.reserve` with a `CachedPrompt`), always leaving the prompt's last position to
compute (its logits draw the first token). A kept block holds one BlockTable reference; kept
blocks never refuse a request: least recently used first out, a chain's tail before its head
(a match touches a chain from its end), so what stays is a findable prefix. Stores and
evictions go to a `BlockEventLog`, which routers follow (router/kv_index.py).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve_worker.kv.prefix_cache import block_hashes, scoped_salt

if TYPE_CHECKING:
    from pdserve_worker.kv.block_events import BlockEventLog


@dataclass(frozen=True)
class CachedPrompt:
    """A reservation's prompt and cache scope: share what the prefix cache holds of it."""

    token_ids: tuple[int, ...]
    scope: str


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
        self._lock = threading.Lock()  # (a snapshot for the events reads it from another thread)
        self.hit_blocks = 0  # blocks found by reservations (a metric)

    def __len__(self) -> int:
        return len(self._entries)

    def hashes(self, token_ids: Sequence[int], scope: str) -> list[bytes]:
        return block_hashes(token_ids, self.block_tokens, scoped_salt(self.salt, scope))

    def extend(self, names: Sequence[bytes], token_ids: Sequence[int], scope: str) -> tuple[bytes, ...]:
        """The names of `token_ids`' whole blocks, given `names` of its first ones: only the rest
        is hashed (the chain goes on from the last name known)."""
        n = min(len(names), len(token_ids) // self.block_tokens)
        parent = names[n - 1] if n else scoped_salt(self.salt, scope)
        return tuple(names[:n]) + tuple(block_hashes(token_ids[n * self.block_tokens :], self.block_tokens, parent))

    def match(self, hashes: Sequence[bytes]) -> Hit:
        """The cached blocks of the longest run of `hashes` from the first (a prompt's whole blocks
        but the one holding its last position, whose logits must be computed)."""
        found: list[tuple[bytes, _Entry]] = []
        with self._lock:
            for h in hashes:
                entry = self._entries.get(h)
                if entry is None:
                    break
                found.append((h, entry))
            for h, _ in reversed(found):  # the head ends most recently used: the tail goes first
                self._entries.move_to_end(h)
            self.hit_blocks += len(found)
        return Hit(tuple(e.block for _, e in found), tuple(t for _, e in found for t in e.token_ids))

    def keep(self, names: Sequence[bytes], token_ids: Sequence[int], blocks: Sequence[int]) -> list[int]:
        """An ended request's `blocks` hold the KV of `token_ids`, whose whole blocks are `names`
        (`hashes` in its scope): keep each whole block (taking over its reference). Returns the
        blocks whose references the caller still gives back (a partial last block, and blocks
        whose prefix is cached already under another block)."""
        hashes = list(names[: len(blocks)])
        stored: list[bytes] = []
        back = list(blocks[len(hashes) :])
        with self._lock:
            for i, (h, block) in enumerate(zip(hashes, blocks, strict=False)):
                if h in self._entries:
                    back.append(block)
                    continue
                self._entries[h] = _Entry(block, tuple(token_ids[i * self.block_tokens : (i + 1) * self.block_tokens]))
                stored.append(h)
            for h in reversed(hashes):  # the head ends most recently used: the tail goes first
                self._entries.move_to_end(h)
            if stored and self.events is not None:
                self.events.record(True, False, stored)
        return back

    def evict(self, room: int, only_cache_holds: Callable[[int], bool]) -> list[int]:
        """Drop least recently used entries whose block only the cache holds until `room` blocks
        would be free (one a reservation also reads would free nothing: it stays). Returns the
        dropped entries' blocks, whose references the caller gives back."""
        with self._lock:
            return self._drop([h for h, e in self._entries.items() if only_cache_holds(e.block)][: max(room, 0)])

    def _drop(self, hashes: list[bytes]) -> list[int]:
        blocks = [self._entries.pop(h).block for h in hashes]
        if hashes and self.events is not None:
            self.events.record(False, False, hashes)
        return blocks

    def blocks(self) -> list[int]:
        with self._lock:
            return [e.block for e in self._entries.values()]

    def held(self) -> list[tuple[bool, bytes]]:
        """(disk, hash) of every entry: a BlockEventLog's snapshot."""
        with self._lock:
            return [(False, h) for h in self._entries]
