"""A worker's imports leave torch's compiler stack out: importing torch._dynamo (as
llguidance.torch does, through a module-level torch.compile) doubled every worker's start
(4.9 -> 2.3 s of imports on a 2-vCPU machine). Nothing serving needs it."""

from __future__ import annotations

import subprocess
import sys

from support.local_run import cli_env

WORKER_MODULES = (
    "pdserve_worker.process.worker_main",
    "pdserve_worker.process.roles",
    "pdserve_worker.decode.worker",
    "pdserve_worker.prefill.worker",
    "pdserve_worker.colocated.backend",
    "pdserve_worker.model.loading.loader",
)


def test_a_worker_does_not_import_torchs_compiler():
    code = f"import sys, {', '.join(WORKER_MODULES)}; print(sorted(m for m in sys.modules if m.startswith(('torch._dynamo', 'torch._inductor'))))"
    out = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
