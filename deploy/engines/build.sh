#!/usr/bin/env bash
# Build the test-only engines env (.run/engines) from the hash-pinned requirements. Fails loudly.
set -euo pipefail
PYTHON=${PYTHON:-.venv/bin/python}
DEST=${ENGINES_DIR:-.run/engines}
HERE=$(cd "$(dirname "$0")" && pwd)
if [[ -f "$DEST/.installed" && "$DEST/.installed" -nt "$HERE/requirements.txt" ]]; then
    exit 0
fi
echo "building the engines env in $DEST (vLLM + SGLang wheels, no torch; about 400 MB, once)"
rm -rf "$DEST.tmp"
"$PYTHON" -m pip install -q --disable-pip-version-check --no-deps --require-hashes --only-binary=:all: \
    --target "$DEST.tmp" -r "$HERE/requirements.txt"
rm -rf "$DEST"
mv "$DEST.tmp" "$DEST"
touch "$DEST/.installed"
