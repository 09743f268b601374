#!/usr/bin/env bash
# Here (with pip and PyPI): download, as wheels for the GPU machine's Python 3.12 on x86-64, every package
# in apps/gpu/wheels.txt into .whl/ (ignored by git), and copy the benchmark's torchtitan tokenizer from
# ../shared beside it. apps/gpu/run.sh installs them on the GPU machine.
#   apps/gpu/fetch_wheels.sh            then carry `.whl` to the GPU machine
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=.whl
mkdir -p "$DEST"
PLATFORMS=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    PLATFORMS+=(--platform "${tag}_x86_64")
done
grep -oE '^[A-Za-z0-9_.-]+==[^ ]+' apps/gpu/wheels.txt | while read -r pin; do
    if ls "$DEST"/"$(echo "${pin%%==*}" | tr - _)"-"${pin##*==}"-*.whl >/dev/null 2>&1; then
        continue  # already here
    fi
    echo "fetching $pin"
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${PLATFORMS[@]}" -d "$DEST" "$pin"
done
ASSETS=../shared/anchor-assets/torchtitan-test-tokenizer
if [ -d "$ASSETS" ]; then
    mkdir -p "$DEST/assets" && cp -r "$ASSETS" "$DEST/assets/"
else
    echo "note: $ASSETS not found; bench/gpu_throughput.py runs torchtitan only with --torchtitan-tokenizer" >&2
fi
du -sh "$DEST"
