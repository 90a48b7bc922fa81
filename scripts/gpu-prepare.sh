#!/usr/bin/env bash
# Builds, on this machine, what scripts/gpu-check.sh runs on a GPU machine that has no
# Rust toolchain and no network: the release test binary of the CUDA kernels, stripped,
# in .gpu/ (ignored by git; carry it along with the working tree).
# Usage: scripts/gpu-prepare.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p .gpu
bin="$(cargo test --release --locked -p tessera-kernels --test gpu --no-run --message-format=json \
    | python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("target", {}).get("name") == "gpu" and m.get("executable"):
        print(m["executable"])')"
cp "$bin" .gpu/kernels-gpu
strip .gpu/kernels-gpu
ls -la .gpu/
