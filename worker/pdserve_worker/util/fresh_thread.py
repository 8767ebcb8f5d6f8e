"""One-off blocking work (loading a model, converting a GGUF) on a thread that ends with it.

Why not `asyncio.to_thread`: its executor's threads live on, and a thread that ran torch's
parallel CPU ops keeps an OpenMP (libgomp) thread pool alive with it. libgomp counts the threads
of every pool, and once they outnumber the cores it stops letting idle workers spin between
parallel regions (its "throttled" spin): from then on every parallel op of the thread that
serves the model pays a sleep and a wake-up (a third slower at batch 1: benchmarks/README.md,
"Model measurements behind the module docstrings"). A thread that exits takes its pool with it, so each process keeps one
pool: its serving thread's (the generation loop's or the prefill's compute thread).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


async def run_in_fresh_thread(fn: Callable[..., T], *args: object, name: str = "pdserve-once") -> T:
    """`fn(*args)` on a new thread, awaited without blocking the event loop; the thread has exited
    (and taken any OpenMP pool it made with it) by the time this returns. A cancelled caller does
    not wait for it (the thread ends on its own)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if done.done():  # the awaiting task was cancelled meanwhile
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)  # type: ignore[arg-type]

    def target() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the awaiting task, which re-raises it
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    result = await done
    await asyncio.to_thread(thread.join)  # (joining an ending thread runs no torch)
    return result
