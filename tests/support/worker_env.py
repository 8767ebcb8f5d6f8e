"""Read a pod's environment as its worker would: `WorkerSettings`, the one parser of the
variables the operator renders (pdserve_common.pod_env names them)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from unittest import mock

from pdserve_worker.serving.settings import WorkerSettings


def worker_settings(environ: Mapping[str, str]) -> WorkerSettings:
    """The settings a worker started with exactly `environ` would have (no flags)."""
    with mock.patch.dict(os.environ, dict(environ), clear=True):
        return WorkerSettings()
