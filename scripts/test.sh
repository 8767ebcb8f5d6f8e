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
# Two phases. First every test but the `timing` ones on two pytest-xdist workers, whole modules
# each (--dist loadfile: a module's shared deployment starts once; many tests wait on processes
# and sockets, so two cores serve two modules at once). Then the `timing` tests (they assert
# latency bounds) alone in this process, on a machine nobody else loads.
# PDSERVE_TEST_WORKERS=0 runs the first phase in this process too.
# pytest exits 5 when no test ran: that stays a failure unless the other phase ran tests (a
# selection given as arguments may hold tests of one phase only).
set +e
.venv/bin/python -m pytest -q -n "${PDSERVE_TEST_WORKERS:-2}" --dist loadfile -m "not timing" "$@"
parallel=$?
.venv/bin/python -m pytest -q -m timing "$@"
alone=$?
set -e
for rc in "$parallel" "$alone"; do
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then exit "$rc"; fi
done
if [ "$parallel" -eq 5 ] && [ "$alone" -eq 5 ]; then exit 5; fi
exit 0
