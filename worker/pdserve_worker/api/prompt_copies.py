"""n copies of one prompt (n > 1): the first prefills it, the others follow it (issue #31).

Each copy is a request of its own (api/fan_out.py). On a backend whose prefills cache prefixes
(`Backend.shares_prompt_prefill`), the first copy of each prompt goes alone until its first
token (the prompt's blocks are then in its prefill's cache); the others start after it, told to
use the same prefill, and prefill only what is not in whole cached blocks. The KV is pushed once
too: the first copy's Reserve says how many copies follow, and each later copy asks the first
copy's decode first, naming that reservation (`share_from`), to be granted its whole prompt
blocks read-only (kv/blocks.py). The decode step is not shared: each copy is its own row.

A copy's group travels in a context variable set by the task that serves it, so the request
path needs no new argument: `wait_for_first` before a follower takes its admission ticket,
`first_done` when the first copy has its first token or has ended (however),
`note_prefill`/`preferred_prefill` in the PD backend's choice.
"""

from __future__ import annotations

import asyncio
from contextvars import ContextVar
from dataclasses import dataclass, field


@dataclass
class Copies:
    """The copies of one prompt."""

    later: int = 0  # copies after the first
    first_token: asyncio.Event = field(default_factory=asyncio.Event)
    prefill: str | None = None  # the prefill the first copy ran on
    decode: tuple[str, int, int] | None = None  # the first copy's reservation: (decode, slot, generation)


_CURRENT: ContextVar[tuple[Copies, bool] | None] = ContextVar("pdserve_prompt_copies", default=None)


def enter(copies: Copies, first: bool) -> None:
    """This task serves a copy of `copies` (the first when `first`)."""
    _CURRENT.set((copies, first))


async def wait_for_first() -> None:
    """A follower: until the first copy has its first token (or ended)."""
    copies = _group(first=False)
    if copies is not None:
        await copies.first_token.wait()


def first_done() -> None:
    """The first copy has its first token, or will never have it: let the others go."""
    copies = _group(first=True)
    if copies is not None:
        copies.first_token.set()


def note_prefill(worker_id: str) -> None:
    """The first copy's prefill (the others are sent to it)."""
    copies = _group(first=True)
    if copies is not None:
        copies.prefill = worker_id


def preferred_prefill() -> str | None:
    """For a follower: the prefill that holds its prompt, if the first copy named one."""
    copies = _group(first=False)
    return None if copies is None else copies.prefill


def note_decode(worker_id: str, slot: int, generation: int) -> None:
    """The first copy's reservation (the others share its prompt's blocks there)."""
    copies = _group(first=True)
    if copies is not None:
        copies.decode = (worker_id, slot, generation)


def later_copies() -> int:
    """For the first copy: how many copies will follow it (its decode keeps the prompt's blocks
    for them); 0 for any other request."""
    copies = _group(first=True)
    return 0 if copies is None else copies.later


def shared_decode() -> tuple[str, int, int] | None:
    """For a follower: the decode and reservation holding its prompt's KV, if the first copy
    named one (the decode checks that it is still there, and that the prompts match)."""
    copies = _group(first=False)
    return None if copies is None else copies.decode


def _group(*, first: bool) -> Copies | None:
    """This task's copies when it serves the first copy (`first`) or a later one; else None."""
    current = _CURRENT.get()
    return current[0] if current is not None and current[1] == first else None
