"""How many threads torch's CPU ops use, per thread of a serving process.

A serving process has one thread that runs the model (the generation loop, or the prefill's
compute thread) and an event loop on the main thread that must stay quick. torch parallelizes
its CPU ops with OpenMP (libgomp), which keeps one pool of worker threads per thread that ever
ran a parallel op. When the pools' threads outnumber the cores, libgomp stops letting its idle
workers spin between parallel regions ("throttled" spin), and every parallel op of the model
thread then pays a sleep and a wake-up (measured: benchmarks/README.md, "Model measurements
behind the module docstrings").

So the main thread runs torch single-threaded (it only allocates and copies at start-up: a
parallel zero-fill there would leave a pool behind), every other thread gets `threads`, and
one-off work on other threads runs on threads that end with it (util/fresh_thread.py).
"""

from __future__ import annotations

import threading

import torch


def serve_with(threads: int) -> None:
    """Call on the main thread before any torch work: torch ops of the main thread stay on it
    (no OpenMP pool), those of every thread started later use `threads`."""
    if threads < 1:
        raise ValueError(f"torch threads must be positive, got {threads}")
    torch.set_num_threads(1)
    torch.get_num_threads()  # the main thread's per-thread setting is fixed from here (ATen's lazy init)
    # The process-wide default for other threads, set from a thread of its own so that the main
    # thread's own setting (OpenMP's per-thread nthreads) stays 1.
    setter = threading.Thread(target=torch.set_num_threads, args=(threads,), name="torch-threads")
    setter.start()
    setter.join()
