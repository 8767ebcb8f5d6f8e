"""n copies of one prompt (n > 1): the first prefills it, the others follow it (issue #31).

Each copy is a request of its own (api/fan_out.py), so n copies started at once computed the
prompt n times. vLLM serves n > 1 the same way and gets the prompt computed once from its
prefix cache; so does pdserve now, on a backend whose prefills cache prefixes: the first copy
of each prompt goes alone until its first token (its prefill has run, the prompt's blocks are
in that prefill's cache), then the other copies start, told to use the same prefill — the
router's prefix routing could otherwise send them elsewhere, as what each prefill holds is
reported every 0.25 s (router/kv_index.py). The other copies then prefill only what is not in
whole cached blocks. What it costs: the other copies' first token comes after the first copy's
(they would otherwise compute the whole prompt at the same time, on the same machines).

A copy's group travels in a context variable set by the task that serves it, so the request
path needs no new argument: `wait_for_first` before a follower takes its admission ticket (it
holds no place in the queue while it waits), `first_done` when the first copy has its first
token or has ended (however), `note_prefill`/`preferred_prefill` in the PD backend's choice.
"""

from __future__ import annotations

import asyncio
from contextvars import ContextVar
from dataclasses import dataclass, field


@dataclass
class Copies:
    """The copies of one prompt."""

    first_token: asyncio.Event = field(default_factory=asyncio.Event)
    prefill: str | None = None  # the prefill the first copy ran on


_CURRENT: ContextVar[tuple[Copies, bool] | None] = ContextVar("pdserve_prompt_copies", default=None)


def enter(copies: Copies, first: bool) -> None:
    """This task serves a copy of `copies` (the first when `first`)."""
    _CURRENT.set((copies, first))


async def wait_for_first() -> None:
    """A follower: until the first copy has its first token (or ended)."""
    current = _CURRENT.get()
    if current is not None and not current[1]:
        await current[0].first_token.wait()


def first_done() -> None:
    """The first copy has its first token, or will never have it: let the others go."""
    current = _CURRENT.get()
    if current is not None and current[1]:
        current[0].first_token.set()


def note_prefill(worker_id: str) -> None:
    """The first copy's prefill (the others are sent to it)."""
    current = _CURRENT.get()
    if current is not None and current[1]:
        current[0].prefill = worker_id


def preferred_prefill() -> str | None:
    """For a follower: the prefill that holds its prompt, if the first copy named one."""
    current = _CURRENT.get()
    return current[0].prefill if current is not None and not current[1] else None
