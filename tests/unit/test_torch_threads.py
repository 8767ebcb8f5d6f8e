"""One OpenMP pool per serving process: the main thread runs torch single-threaded, other
threads get the process's thread count, and one-off work on a fresh thread takes its pool with
it (serving/torch_threads.py and util/fresh_thread.py say why: libgomp throttles every pool once
their threads outnumber the cores). Each check runs in a child process: the settings are
process-wide."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from pdserve_worker.util.fresh_thread import run_in_fresh_thread

CHILD = textwrap.dedent(
    """
    import asyncio, os, threading, time
    import torch
    from pdserve_worker.serving.torch_threads import serve_with
    from pdserve_worker.util.fresh_thread import run_in_fresh_thread

    def threads():
        return len(os.listdir("/proc/self/task"))

    def extra(before):
        # Threads that outlive their work, once exiting ones are gone (a loaded machine takes a
        # moment to reap them; a leaked OpenMP pool stays for good).
        for _ in range(100):
            if threads() <= before:
                return 0
            time.sleep(0.02)
        return threads() - before

    serve_with(2)
    print("main", torch.get_num_threads())
    seen = []
    t = threading.Thread(target=lambda: seen.append(torch.get_num_threads())); t.start(); t.join()
    print("other", seen[0])
    before = threads()
    torch.zeros(64_000_000).add_(1)  # parallel ops on the main thread: no pool may be left behind
    print("main_pool", extra(before))

    def work():
        torch.zeros(64_000_000).add_(1)
        return torch.get_num_threads()

    async def main():
        await asyncio.to_thread(int)  # the default executor's thread, which the join uses, started
        before = threads()
        used = await run_in_fresh_thread(work)
        return used, extra(before)

    print("fresh", *asyncio.run(main()))
    """
)


def test_the_main_thread_keeps_no_pool_and_a_fresh_thread_takes_its_own_with_it():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, check=True)
    lines = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())
    assert lines["main"] == "1"
    assert lines["other"] == "2"
    assert lines["main_pool"] == "0"  # no OpenMP worker started for the main thread
    used, left = lines["fresh"].split()
    assert used == "2"  # the fresh thread ran parallel
    assert left == "0"  # and neither it nor its pool's workers outlived it


def test_serve_with_refuses_no_threads():
    from pdserve_worker.serving.torch_threads import serve_with

    with pytest.raises(ValueError, match="positive, got 0"):
        serve_with(0)


@pytest.mark.asyncio
async def test_run_in_fresh_thread_returns_and_raises_what_the_function_does():
    import threading

    main = threading.get_ident()
    assert await run_in_fresh_thread(lambda a, b: (a + b, threading.get_ident() != main), 2, 3) == (5, True)

    def boom() -> None:
        raise KeyError("no such model")

    with pytest.raises(KeyError, match="no such model"):
        await run_in_fresh_thread(boom)
