#!/usr/bin/env bash
# lm-evaluation-harness for benchmarks/lm_eval_check.py, into the project's .venv (it needs the
# same torch and transformers): never a test or CI dependency. lm-eval's table printer pulls
# typepy[datetime], which pins python-dateutil<3 and so downgrades the python-dateutil>=3 that
# kubernetes (the operator) requires: it is put back afterwards (typepy works with it).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pip install -q "lm-eval[api]==0.4.13"
.venv/bin/python -m pip install -q "python-dateutil>=3"
.venv/bin/python -c "import lm_eval, kubernetes, dateutil; print('setup_lm_eval: ok lm-eval', lm_eval.__version__, 'python-dateutil', dateutil.__version__)"
