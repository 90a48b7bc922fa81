#!/usr/bin/env bash
# Builds, on this machine, what scripts/gpu-check.sh runs on a GPU machine that has no
# Rust toolchain and no network, stripped, in .gpu/ (ignored by git; carry it along with
# the working tree): the release test binaries of the CUDA kernels, of the model on the
# device and of a one-rank NCCL group, and the decode-throughput benchmark.
# Usage: scripts/gpu-prepare.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p .gpu
# The test binaries of the kernels (each against its CPU twin) and of a one-rank NCCL group.
build() {
    local package="$1" test="$2" kind="${3:-test}"
    cargo "$kind" --release --locked -p "$package" "--$kind" "$test" --no-run --message-format=json \
        | python3 -c 'import json, sys
name = sys.argv[1]
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("target", {}).get("name") == name and m.get("executable"):
        print(m["executable"])' "$test"
}
cp "$(build tessera-kernels gpu)" .gpu/kernels-gpu
cp "$(build tessera-comm nccl_gpu)" .gpu/nccl-gpu
cp "$(build tessera-model cuda_model)" .gpu/model-gpu
cp "$(build tessera-model cuda_decode bench)" .gpu/cuda-decode
strip .gpu/kernels-gpu .gpu/nccl-gpu .gpu/model-gpu .gpu/cuda-decode
ls -la .gpu/
