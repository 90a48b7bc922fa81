#!/usr/bin/env bash
# Builds, on this machine, what scripts/gpu-check.sh runs on a GPU machine that has no
# Rust toolchain and no network, stripped, in .gpu/ (ignored by git; carry it along with
# the working tree): the release test binaries of the CUDA kernels, of the model on the
# device, of a one-rank NCCL group and of a cluster with a cuda shard (with the
# coordinator and shard binaries it starts), the decode-throughput benchmark, the
# GEMV-against-cuBLAS micro-benchmark, and the `tessera` command for the serving step
# (scripts/gpu/serving.sh: `tessera up`, `tessera bench`).
# The device machine takes at most 64 MiB of files along, with the tree: the sizes are
# listed at the end.
# Usage: scripts/gpu-prepare.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p .gpu
# The test binaries of the kernels (each against its CPU twin) and of a one-rank NCCL group.
# The GPU targets exist only with their package's feature (cuda, or nccl for comm).
build() {
    local package="$1" features="$2" test="$3" kind="${4:-test}"
    local profile=(--release)
    [[ "$kind" == bench ]] && profile=()  # benches build in release already
    cargo "$kind" "${profile[@]}" --locked -p "$package" --features "$features" "--$kind" "$test" \
        --no-run --message-format=json \
        | python3 -c 'import json, sys
name = sys.argv[1]
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("target", {}).get("name") == name and m.get("executable"):
        print(m["executable"])' "$test"
}
cp "$(build tessera-kernels cuda gpu)" .gpu/kernels-gpu
cp "$(build tessera-comm nccl nccl_gpu)" .gpu/nccl-gpu
cp "$(build tessera-model cuda cuda_model)" .gpu/model-gpu
cp "$(build tessera-model cuda cuda_decode bench)" .gpu/cuda-decode
cp "$(build tessera-kernels cuda cuda_gemv bench)" .gpu/cuda-gemv
cp "$(build tessera-tests "" cuda_cluster)" .gpu/cluster-gpu
# The binaries the cluster test starts, and the launcher and load generator of the serving
# step, from the target directory cargo uses (CARGO_TARGET_DIR or the config may move it).
cargo build --release --locked -p tessera-coordinator -p tessera-shard -p tessera-cli
release="$(cargo metadata --format-version 1 --no-deps --locked \
    | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')/release"
mkdir -p .gpu/bin
cp "$release/tessera-coordinator" "$release/tessera-shard" "$release/tessera" .gpu/bin/
strip .gpu/kernels-gpu .gpu/nccl-gpu .gpu/model-gpu .gpu/cuda-decode .gpu/cuda-gemv .gpu/cluster-gpu .gpu/bin/*
ls -la .gpu/bin/
# The three binaries are 36 MB, 14 MB compressed: with them whole, .gpu (51 MB) and the
# tree (17 MB) would pass the 64 MiB. gpu-check.sh unpacks them into /tmp.
tar -czf .gpu/bin.tar.gz -C .gpu bin
rm -rf .gpu/bin
ls -la .gpu/
du -sh .gpu
