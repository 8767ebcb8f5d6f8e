#!/usr/bin/env bash
# The test command of the README: set up (idempotent), then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Linters first (a minute cold, seconds with their caches; pinned in the dev extra): a failure
# here needs no suite run.
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
# pytest exits 5 when no test ran: that stays a failure here on purpose. Two workers (xdist),
# each taking whole modules (--dist loadfile: a module's shared deployment starts once);
# PDSERVE_TEST_WORKERS=0 runs in this process alone.
exec .venv/bin/python -m pytest -q -n "${PDSERVE_TEST_WORKERS:-2}" --dist loadfile "$@"
