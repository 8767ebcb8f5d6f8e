"""Child processes that must not outlive the process that started them."""

from __future__ import annotations

import ctypes
import signal


def die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies (Linux's PR_SET_PDEATHSIG), so no
    child outlives its starter (a `pdserve local` worker, a tensor-parallel instance's rank)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
