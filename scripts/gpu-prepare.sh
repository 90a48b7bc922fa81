#!/usr/bin/env bash
# Builds, on this machine, what scripts/gpu-check.sh runs on a GPU machine that has no
# Rust toolchain and no network: the release test binary of the CUDA kernels, stripped,
# in .gpu/ (ignored by git; carry it along with the working tree), and a one-rank NCCL
# group's test.
# Usage: scripts/gpu-prepare.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p .gpu
# The test binaries of the kernels (each against its CPU twin) and of a one-rank NCCL group.
build() {
    local package="$1" test="$2"
    cargo test --release --locked -p "$package" --test "$test" --no-run --message-format=json \
        | python3 -c 'import json, sys
name = sys.argv[1]
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("target", {}).get("name") == name and m.get("executable"):
        print(m["executable"])' "$test"
}
cp "$(build tessera-kernels gpu)" .gpu/kernels-gpu
cp "$(build tessera-comm nccl_gpu)" .gpu/nccl-gpu
strip .gpu/kernels-gpu .gpu/nccl-gpu
ls -la .gpu/
