"""Every native kernel on every ISA path it has (#56 item 1). The library is built for the widest
vectors torch uses here (inductor's pick); on an AVX512 CPU that leaves the AVX2 build untested
(the fp32 prefill attention and dense kernels exist only there, and the decode attention keeps
half as many vectors in registers). torch and inductor both take `ATEN_CPU_CAPABILITY=avx2`, so
the kernel tests run again in a process forced to it: a second library, built once per cache.
The AVX512 paths cannot be forced on an AVX2 CPU: there this test skips, saying so."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve_worker.model.layers import native

pytestmark = pytest.mark.slow

KERNEL_TESTS = [
    "tests/unit/test_prefill_attention_fp32.py",
    "tests/unit/test_dense_kernel.py",
    "tests/unit/test_native_ops.py",
    "tests/unit/test_quant_kernel.py",
]
ROOT = Path(__file__).resolve().parents[2]


def test_the_kernels_pass_their_tests_on_the_avx2_build_too():
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX512":
        pytest.skip(f"torch runs {capability} here: the AVX2 build is the default one (the other tests ran it)")
    if not native.available():
        pytest.skip("the native kernels do not build here: the model runs torch's ops, which the other tests cover")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *KERNEL_TESTS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    tail = out.stdout[-3000:]
    assert out.returncode == 0, tail
    passed = int(re.search(r"(\d+) passed", out.stdout).group(1))  # type: ignore[union-attr]
    assert passed >= 200, tail
    # The AVX2-only kernel ran, not skipped: its skip reason names the AVX2 build.
    assert "built for AVX2 CPUs" not in out.stdout, tail
