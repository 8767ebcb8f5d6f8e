"""`kill -USR1 <pid>` prints every thread's Python stack to the process's stderr (its log).

A worker that does not stop, or stops answering, is otherwise a black box: `pdserve local`
sends this signal to a child that outlived its stop timeout before it kills it, so the log
says where it was waiting. faulthandler (the standard library's) writes from its C handler,
so it works while the interpreter's main thread is stuck in a lock or a native call.
"""

from __future__ import annotations

import faulthandler
import signal
import subprocess
import sys
from typing import Any

STACK_SIGNAL = signal.SIGUSR1


def install() -> None:
    """Print every thread's stack on STACK_SIGNAL (no-op where the platform lacks it)."""
    if sys.platform == "win32" or sys.stderr is None:
        return
    try:
        sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # (io.UnsupportedOperation is both of the last two)
        return  # stderr replaced by an in-process caller (a test's capture): nowhere to write from C
    faulthandler.register(STACK_SIGNAL, file=sys.stderr, all_threads=True, chain=False)


def dump_stacks_then_kill(proc: subprocess.Popen[Any], settle_s: float = 1.0) -> None:
    """A child that outlived its stop timeout: ask for its stacks (`install` in the child), give
    it `settle_s` to write them, then SIGKILL it and reap it. By PID, this child only."""
    if proc.poll() is None:
        try:
            proc.send_signal(STACK_SIGNAL)
            proc.wait(settle_s)  # (a child that did install the handler keeps running)
        except subprocess.TimeoutExpired:
            pass
    proc.kill()
    proc.wait()
