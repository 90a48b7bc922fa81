#!/usr/bin/env bash
# The checks that need a GPU, in one run with no network (issue 6). Run
# scripts/gpu-prepare.sh first where Rust is installed; this runs its binaries from .gpu/
# (or builds them here when cargo is present).
#
# Done so far: each CUDA kernel against its CPU twin, with the tolerances written in
# crates/kernels/tests/gpu.rs, and a one-rank NCCL group (crates/comm/tests/nccl_gpu.rs).
# Not yet (the model does not run on CUDA yet): SmolLM2 on cuda:0 against the CPU path,
# tp = 2 on one GPU, decode tokens/s.
# Usage: scripts/gpu-check.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export TESSERA_REQUIRE_GPU=1
export TESSERA_CACHE_DIR="${TESSERA_CACHE_DIR:-/tmp/tessera-gpu-check}"
# NVRTC and the driver from the CUDA installation, when they are not on the path already.
for dir in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [[ -d "$dir" ]] && export LD_LIBRARY_PATH="${dir}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
done
# cudarc opens libnccl.so and libnvrtc.so (or .so.12): link them where only other
# versioned names exist (CUDA 13 images ship libnccl.so.2 and libnvrtc.so.13).
links=/tmp/tessera-libs
mkdir -p "$links"
for lib in nccl nvrtc; do
    if ! ldconfig -p | grep -q "lib${lib}\.so "; then
        found="$(find /usr/local /usr/lib /opt -name "lib${lib}.so.*" -not -name "*builtins*" 2>/dev/null | sort | head -1)"
        [[ -n "$found" ]] && ln -sf "$found" "$links/lib${lib}.so"
    fi
done
export LD_LIBRARY_PATH="${links}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "== the device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
echo "== each kernel against its CPU twin"
if [[ -x .gpu/kernels-gpu ]]; then
    .gpu/kernels-gpu --test-threads=1 --nocapture
else
    cargo test --release --offline -p tessera-kernels --test gpu -- --test-threads=1 --nocapture
fi
echo "== a one-rank NCCL group"
if [[ -x .gpu/nccl-gpu ]]; then
    .gpu/nccl-gpu --nocapture
else
    cargo test --release --offline -p tessera-comm --test nccl_gpu -- --nocapture
fi
echo "== not yet: SmolLM2 on cuda:0, tp = 2 on one GPU, decode tokens/s (docs/cuda.md)"
