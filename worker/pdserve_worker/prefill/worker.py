"""The prefill role (being cut: the pass moves to prefill/pass_run.py, the worker comes back here)."""

from pdserve_worker.prefill.pass_run import *  # noqa: F403
from pdserve_worker.prefill.pass_run import _Job, _keep_prompt_states  # noqa: F401
