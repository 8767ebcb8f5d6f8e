"""The one way the tests start a `pdserve local` deployment: `local_deployment(...)`.

It writes the command line from keywords, so a test names only what its deployment needs:
`local_deployment(log_dir, model, decode=1, slots=2, max_len=128, env={...})`. Defaults are
the command's own (1 prefill, 2 decodes) plus what every test wants: float32 weights and a
free router port (`port=0`). A keyword `some_flag=value` becomes `--some-flag value`; `True`
becomes the bare flag; `None` leaves the flag out (the command's default). `env` becomes one
`--env NAME=VALUE` each. The pytest fixture `local_deployments` (tests/conftest.py) starts
deployments with it for a test and stops each at the test's end.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from support.local_run import LocalRun


def local_args(
    model: str | Path | None,
    *,
    prefill: int | None = 1,
    decode: int | None = 2,
    dtype: str | None = "float32",
    port: int | None = 0,
    env: Mapping[str, object] | None = None,
    **options: Any,
) -> list[str]:
    """The arguments of `pdserve local` (after `--log-dir`) for these keywords."""
    if options.get("colocated") and (prefill, decode) != (1, 2):
        raise ValueError(f"a colocated deployment has no prefill/decode counts; got {prefill=} {decode=}")
    shape = {} if options.get("colocated") else {"prefill": prefill, "decode": decode}
    args: list[str] = []
    for name, value in {"model": model, "dtype": dtype, **shape, **options, "port": port}.items():
        if value is None or value is False:
            continue
        flag = "--" + name.replace("_", "-")
        args += [flag] if value is True else [flag, str(value)]
    for key, value in (env or {}).items():
        args += ["--env", f"{key}={value}"]
    return args


def local_deployment(log_dir: Path, model: str | Path | None, *, timeout_s: float = 240.0, **keywords: Any) -> LocalRun:
    """Start `pdserve local` with `local_args(model, **keywords)`, logging into `log_dir`; it
    returns once the router is ready. The caller stops it (`stop()` or `stop_cleanly()`)."""
    return LocalRun.start(log_dir, *local_args(model, **keywords), timeout_s=timeout_s)
