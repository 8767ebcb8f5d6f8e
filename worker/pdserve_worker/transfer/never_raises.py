"""The HIXL binding's contract for an engine of ours: status codes, never exceptions.

Both engines that stand in for `hixl.Hixl` (the host engine, host/engine.py, and the two-sided
baseline, two_sided.py) wrap every public call in `never_raises(failed, log)`: a bug becomes
`failed()` (a FAILED status, fresh each time, of the wrapped call's return type) plus a log
line with the traceback, on the engine's own logger.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar, cast

from pdserve_common.logs import kv

F = TypeVar("F", bound=Callable[..., Any])


def never_raises(failed: Callable[[], Any], log: logging.Logger) -> Callable[[F], F]:
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except Exception as exc:
                log.exception(kv(event="engine_call_failed", call=fn.__name__, error=repr(exc)))
                return failed()

        return cast(F, inner)

    return wrap
