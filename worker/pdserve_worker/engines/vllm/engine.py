"""The `vllm` entry of the engine registry: vLLM's own engine behind pdserve's PD plane.

vLLM runs in an environment of its own (`.venv-vllm` from `bash scripts/setup.sh --engine vllm`,
`/opt/vllm` in the image: `$PDSERVE_VLLM_PYTHON`) with pdserve's KV connector loaded into it
(connector.py). What is built: the connector, pushing one-sided layer by layer into the decode's
vLLM blocks (tests/vllm). What is not: the pdserve worker that fronts a vLLM server, whose Reserve
is the connector's grant sink (docs/engines.md). So `pdserve local --engine vllm` and a worker
started with it are refused here, by name and before anything starts, instead of failing later.
"""

from __future__ import annotations

import os
from pathlib import Path

from pdserve_worker.engines.base import Engine, EngineError, EngineLoad

PYTHON_ENV = "PDSERVE_VLLM_PYTHON"
NOT_BUILT = (
    "engine 'vllm': pdserve's router cannot drive a vLLM server yet (the worker that fronts it, "
    "whose Reserve hands vLLM's blocks to the connector, is not built: docs/engines.md); the KV "
    "connector itself runs inside vLLM servers you start (tests/vllm/test_vllm_pd.py shows how)"
)


def vllm_python() -> Path:
    """The interpreter of vLLM's environment: $PDSERVE_VLLM_PYTHON, else the checkout's .venv-vllm."""
    configured = os.environ.get(PYTHON_ENV)
    if configured:
        return Path(configured)
    return Path(__file__).resolve().parents[4] / ".venv-vllm" / "bin" / "python"


class VllmEngine:
    capabilities: frozenset[str] = frozenset()

    @classmethod
    def check_installed(cls) -> None:
        """ModuleNotFoundError (the registry's set-up hint) without vLLM's environment; else the
        refusal of what is not built yet."""
        if not vllm_python().exists():
            raise ModuleNotFoundError(f"no vLLM environment at {vllm_python()}", name="vllm")
        raise EngineError(NOT_BUILT)

    @classmethod
    def load(cls, request: EngineLoad) -> Engine:
        cls.check_installed()
        raise EngineError(NOT_BUILT)  # (check_installed always raises; kept for the reader)
