#!/bin/sh
# The `pdserve` the worker image puts first on PATH (the operator starts pods with command
# `pdserve`, which bypasses any ENTRYPOINT). On an Ascend image it loads CANN's environment
# (library paths, the hixl Python binding) before Python starts; elsewhere it only execs.
set -e
ascend_env=${PDSERVE_ASCEND_ENV:-/usr/local/Ascend/ascend-toolkit/set_env.sh}
if [ -f "$ascend_env" ]; then
  # shellcheck disable=SC1090
  . "$ascend_env"
fi
exec python3 -m pdserve_worker.cli.main "$@"
