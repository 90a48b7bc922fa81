#!/usr/bin/env bash
# The checks that need a GPU, in one run with no network (issue 6). Run
# scripts/gpu-prepare.sh first where Rust is installed; this runs its binaries from .gpu/
# (or builds them here when cargo is present).
#
# It runs: each CUDA kernel against its CPU twin (tolerances in crates/kernels/tests/gpu.rs);
# the model on cuda:0 against the CPU path on every fixture, SmolLM2 greedy when models/
# holds it, and tp = 2 with two ranks on one GPU through the CPU collective
# (crates/model/tests/cuda_model.rs); a one-rank NCCL group (crates/comm/tests/nccl_gpu.rs);
# a cluster whose shard runs on cuda:0, against a CPU shard (crates/tests/tests/cuda_cluster.rs),
# once sampling on the device (TESSERA_DEVICE_SAMPLING=1, not yet the default) and once on
# the host (TESSERA_DEVICE_SAMPLING=0, the default until this check has passed on a GPU);
# decode tokens/s and host µs per step at batch 1, 8, 64 and 256, eager and graphed, each
# sampling on the host and on the device, with the fraction of the card's memory bandwidth
# and of a 1 GiB device copy measured in the same process, and prefill tokens/s of 1k- and
# 4k-token prompts (crates/model/benches/cuda_decode.rs; once, fused and grouped, for the
# same shape with FP8 projections too); the bf16 GEMV's and cuBLAS's GB/s per projection
# next to a device copy's (crates/kernels/benches/cuda_gemv.rs).
# The kernel tests check both paged-attention kernels; the model, cluster and decode checks
# run once per kernel of TESSERA_ATTENTION:
#   | TESSERA_ATTENTION | kernel                                              | default |
#   | legacy            | attention.cu: a block per (query head, query, 256)  | yes     |
#   | grouped           | attention_grouped.cu: a block per (KV head, query)  | no      |
#   | flash             | prefill: attention_flash.cu, a block per (query     | no      |
#   |                   | head, 64 queries), tensor cores; decode: grouped    |         |
# (legacy stays the default until grouped has passed here; docs/cuda.md). To stay within
# the device time, flash is not in the loop: the kernel test compares it with its twin,
# and the model test and the decode bench (for its prefill figures) run once with it
# after the loop (fused path).
# Each of those runs once per launch sequence of TESSERA_FUSED (crates/model/src/launch_plan.rs):
#   | TESSERA_FUSED | a decode layer's launches                                    | default |
#   | 0             | legacy: separate q/k/v GEMMs, RoPE, KV write, round_bf16s    | yes     |
#   | 1             | fused: q|k|v GEMM, norms and SiLU·mul writing bf16, RoPE +   | no      |
#   |               | bias + KV write in one kernel (inside the grouped attention  |         |
#   |               | at decode): 8 a layer unsplit                                |         |
# (0 stays the default until 1 has passed here; the model test also compares the two
# paths directly, crates/model/tests/cuda_model/fused.rs).
# The small batches' bf16 projections, TESSERA_GEMV (crates/kernels/cuda/gemv.cu):
#   | TESSERA_GEMV | bf16 projections of batches of at most 8 tokens           | default |
#   | 0            | cuBLAS GEMMs                                              | yes     |
#   | 1            | the bf16 GEMV, one launch per GEMM it replaces            | no      |
# (0 stays the default until 1 has passed here.) To stay within the device time, it is not
# another dimension of the loop: the kernel test compares the GEMV with its twin and
# cuBLAS, its micro-benchmark reports GB/s per projection against a device copy's, every
# run of the model test compares it with cuBLAS in the whole model
# (crates/model/tests/cuda_model/gemv.rs) and every decode bench times batches 1 and 8
# both ways; the model test runs once more with TESSERA_GEMV=1 (fused, grouped).
# Last, serving (the defaults of every switch above): scripts/gpu/make_random_llama.py
# makes a random bf16 model of Llama-3.2-1B's shape with transformers (seconds, no
# download), and scripts/gpu/serving.sh starts `tessera up` with one shard on cuda:0
# serving it and runs `tessera bench` at concurrency 1, 16 and 64 (prompts of 128 random
# token ids, 128 output tokens, max(8, 2 × concurrency) requests, at most 20 s a level),
# writing DIR/serving/bench-c<N>.json and the cluster's logs, then stops the cluster as
# Ctrl-C does (about a minute and a half in all).
# Everything it prints goes to DIR/gpu-check.log too; at the end (also after a failure)
# scripts/gpu-report.py prints one summary table (each step's test counts, the graphed
# decode throughput of every variant, the GEMV's share of the copy bandwidth, and output
# tokens/s, TTFT p50/p99 and ITL p50 per serving concurrency) and writes the same figures
# to DIR/gpu-check.json. DIR is the argument, else $OUT (the device tool's folder that
# comes back), else gpu-check-out.
# Usage: scripts/gpu-check.sh [DIR]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out_dir="${1:-${OUT:-gpu-check-out}}"
if [[ -z "${TESSERA_GPU_CHECK_INNER:-}" ]]; then
    mkdir -p "$out_dir"
    set +e
    TESSERA_GPU_CHECK_INNER=1 "$0" "$out_dir" 2>&1 | tee "$out_dir/gpu-check.log"
    status="${PIPESTATUS[0]}"
    echo "== summary (gpu-check.sh exited $status; $out_dir/gpu-check.json)"
    python3 scripts/gpu-report.py "$out_dir/gpu-check.log" --json "$out_dir/gpu-check.json" \
        --serving "$out_dir/serving"
    exit "$status"
fi
export TESSERA_REQUIRE_GPU=1
export TESSERA_CACHE_DIR="${TESSERA_CACHE_DIR:-/tmp/tessera-gpu-check}"
export TESSERA_REPO_ROOT="$PWD"
# NVRTC and the driver from the CUDA installation, when they are not on the path already.
for dir in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [[ -d "$dir" ]] && export LD_LIBRARY_PATH="${dir}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
done
# cudarc opens libnccl.so and libnvrtc.so (or .so.12): link them where only other
# versioned names exist (CUDA 13 images ship libnccl.so.2 and libnvrtc.so.13).
links=/tmp/tessera-libs
mkdir -p "$links"
for lib in nccl nvrtc cublas; do
    if ! ldconfig -p | grep -q "lib${lib}\.so "; then
        found="$(find /usr/local /usr/lib /opt -name "lib${lib}.so.*" -not -name "*builtins*" 2>/dev/null | sort | head -1)"
        [[ -n "$found" ]] && ln -sf "$found" "$links/lib${lib}.so"
    fi
done
export LD_LIBRARY_PATH="${links}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "== the device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
# Runs the prepared binary .gpu/$1 with the arguments after --, or builds and runs the
# same with cargo (the arguments before --) where it was not prepared.
run() {
    local name="$1"; shift
    local cargo_args=() bin_args=()
    while [[ $# -gt 0 && "$1" != "--" ]]; do cargo_args+=("$1"); shift; done
    [[ $# -gt 0 ]] && shift
    bin_args=("$@")
    if [[ -x ".gpu/$name" ]]; then
        ".gpu/$name" "${bin_args[@]}"
    else
        cargo "${cargo_args[@]}" -- "${bin_args[@]}"
    fi
}
echo "== each kernel against its CPU twin"
run kernels-gpu test --release --offline -p tessera-kernels --features cuda --test gpu -- --test-threads=1 --nocapture
echo "== the bf16 GEMV against cuBLAS: GB/s per projection, next to a device copy's"
run cuda-gemv bench --offline -p tessera-kernels --features cuda --bench cuda_gemv --
echo "== a one-rank NCCL group"
run nccl-gpu test --release --offline -p tessera-comm --features nccl --test nccl_gpu -- --nocapture
if [[ -f .gpu/bin.tar.gz ]]; then
    # gpu-prepare.sh packs the coordinator, shard and tessera binaries (.gpu's size).
    tar -xzf .gpu/bin.tar.gz -C "$links"
    export TESSERA_BIN_DIR="$links/bin"
elif [[ -d .gpu/bin ]]; then
    export TESSERA_BIN_DIR="$PWD/.gpu/bin"
else
    cargo build --release --offline -p tessera-coordinator -p tessera-shard -p tessera-cli
fi
for fused in 0 1; do
    export TESSERA_FUSED="$fused"
    if [[ "$fused" == 0 ]]; then paths="TESSERA_FUSED=0 (legacy launches, the default)"; else paths="TESSERA_FUSED=1 (fused launches, not the default)"; fi
    for attention in legacy grouped; do
        export TESSERA_ATTENTION="$attention"
        if [[ "$attention" == legacy ]]; then kernel="TESSERA_ATTENTION=legacy (the default)"; else kernel="TESSERA_ATTENTION=grouped (not the default)"; fi
        echo "== $paths, $kernel: the model on cuda:0 against the CPU (fixtures, SmolLM2 if present, tp = 2 on one GPU)"
        run model-gpu test --release --offline -p tessera-model --features cuda --test cuda_model -- --test-threads=1 --nocapture
        echo "== $paths, $kernel: a cluster with a shard on cuda:0, sampling on the host (TESSERA_DEVICE_SAMPLING=0, the default)"
        TESSERA_DEVICE_SAMPLING=0 run cluster-gpu test --release --offline -p tessera-tests --test cuda_cluster -- --nocapture
        echo "== $paths, $kernel: the same, sampling on the device (TESSERA_DEVICE_SAMPLING=1)"
        TESSERA_DEVICE_SAMPLING=1 run cluster-gpu test --release --offline -p tessera-tests --test cuda_cluster -- --nocapture
        # The FP8 model (its projections through the FP8 matvec) once, beside bf16 on the
        # path meant to become the default (issue 18: FP8 decode tok/s against bf16).
        fp8=0
        [[ "$fused" == 1 && "$attention" == grouped ]] && fp8=1
        echo "== $paths, $kernel: decode throughput, sampling on the host and on the device (FP8 model too: TESSERA_BENCH_FP8=$fp8)"
        TESSERA_BENCH_FP8="$fp8" run cuda-decode bench --offline -p tessera-model --features cuda --bench cuda_decode --
    done
done
echo "== TESSERA_GEMV=1 (not the default), TESSERA_FUSED=1, TESSERA_ATTENTION=grouped: the model on cuda:0 against the CPU"
TESSERA_GEMV=1 TESSERA_FUSED=1 TESSERA_ATTENTION=grouped \
    run model-gpu test --release --offline -p tessera-model --features cuda --test cuda_model -- --test-threads=1 --nocapture
echo "== TESSERA_ATTENTION=flash (not the default), TESSERA_FUSED=1: the model on cuda:0 against the CPU"
TESSERA_FUSED=1 TESSERA_ATTENTION=flash \
    run model-gpu test --release --offline -p tessera-model --features cuda --test cuda_model -- --test-threads=1 --nocapture
echo "== TESSERA_ATTENTION=flash (not the default), TESSERA_FUSED=1: decode and prefill throughput"
TESSERA_FUSED=1 TESSERA_ATTENTION=flash TESSERA_BENCH_FP8=0 \
    run cuda-decode bench --offline -p tessera-model --features cuda --bench cuda_decode --
unset TESSERA_ATTENTION TESSERA_FUSED
echo "== serving: tessera up with a shard on cuda:0 (a random Llama-3.2-1B-shaped model), tessera bench at concurrency 1, 16, 64"
model_dir="$(mktemp -d /tmp/tessera-random-llama.XXXXXX)"
python3 scripts/gpu/make_random_llama.py "$model_dir"
serving_status=0
scripts/gpu/serving.sh cuda:0 "$model_dir" "$out_dir/serving" || serving_status=$?
rm -rf "$model_dir"
exit "$serving_status"
