#!/usr/bin/env bash
# On the GPU machine (its own Python and torch, no package index): install the wheels that
# apps/gpu/fetch_wheels.sh left in .whl/ into a target folder, put Titan's packages/*/src on the path,
# and run the command given, from the repository root.
#   apps/gpu/run.sh python -m pytest -m gpu tests/gpu -q
#   apps/gpu/run.sh python -m titan_train.cli --job.config_file apps/configs/debug_model.toml
set -euo pipefail
cd "$(dirname "$0")/../.."
SITE=${TITAN_GPU_SITE:-/tmp/titan-site}
if [ ! -f "$SITE/.installed" ]; then
    ls .whl/*.whl >/dev/null 2>&1 || { echo "no wheels in .whl/: run apps/gpu/fetch_wheels.sh here and carry .whl" >&2; exit 2; }
    python3 -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
    touch "$SITE/.installed"
fi
SRC=$(printf '%s:' "$PWD"/packages/*/src)
export PYTHONPATH="$SRC$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:$PATH"
exec "$@"
