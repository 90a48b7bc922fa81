#!/usr/bin/env bash
# The test suite: formatting, lints, and every test of the workspace (unit, golden against
# HuggingFace transformers fixtures, tokenizer, end-to-end CLI on the demo model).
# Usage: scripts/test.sh   (fetches the demo model first if it is missing)
# TESSERA_FUZZ_SECONDS=N also runs every wire-decoder fuzz target for N seconds
# (needs a nightly toolchain and cargo-fuzz; CI does not set it: see .ci/run).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

scripts/get-demo-model.sh
export TESSERA_REQUIRE_DEMO_MODEL=1
# NVRTC from the `nvidia-cuda-nvrtc-cu12` wheel, when installed, for the CUDA kernels'
# compile test (crates/kernels/tests/nvrtc.rs; it skips without NVRTC outside CI).
if NVRTC_LIB="$(python3 -c 'import nvidia.cuda_nvrtc as m, os; print(os.path.join(list(m.__path__)[0], "lib"))' 2>/dev/null)"; then
    export LD_LIBRARY_PATH="${NVRTC_LIB}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
# ptxas from the `nvidia-cuda-nvcc-cu12` wheel, when installed: the same test assembles the
# PTX for sm_80 and sm_90 and checks each kernel's registers fit its launch.
if PTXAS="$(python3 -c 'import nvidia.cuda_nvcc as m, os; print(os.path.join(list(m.__path__)[0], "bin", "ptxas"))' 2>/dev/null)" \
    && [[ -x "$PTXAS" ]]; then
    export TESSERA_PTXAS="${TESSERA_PTXAS:-$PTXAS}"
fi

echo "== cargo fmt --check"
cargo fmt --all --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "== the coordinator links no GPU crate"
# The coordinator never runs a kernel: with the cargo features as they are, cudarc is not
# in its dependency graph at all (cargo tree then says the spec matched no package).
if tree="$(cargo tree --locked -p tessera-coordinator -i cudarc 2>&1)"; then
    echo "error: tessera-coordinator depends on cudarc:" >&2
    echo "$tree" >&2
    exit 1
elif ! grep -q "did not match any packages" <<<"$tree"; then
    echo "error: cargo tree failed: $tree" >&2
    exit 1
fi
echo "== cargo clippy: the shard without its cuda feature (${SECONDS}s)"
cargo clippy -p tessera-shard --no-default-features --all-targets --locked -- -D warnings
echo "== cargo test (${SECONDS}s)"
# One build for the whole workspace: cargo unifies features across it, so here the
# coordinator links a CUDA-enabled model crate; the tree check above holds its own graph.
cargo test --workspace --locked
echo "== scripts/gpu-report.py, which summarises a GPU run's log (${SECONDS}s)"
python3 scripts/gpu-report.py --self-test
echo "== the deployment files under deploy/ (${SECONDS}s)"
# Dockerfiles, systemd units and Kubernetes manifests, linted and validated; the
# topologies of the Kubernetes examples checked by the tessera binary cargo test built.
scripts/check-deploy.sh
echo "== the Raft core's failpoints (feature failpoints) (${SECONDS}s)"
# Built with the whole workspace selected, so that the dependencies keep the features the
# test build above gave them: selecting the coordinator alone rebuilt some of them (about
# 4 minutes on a 2-core machine, against about 1 for this).
cargo test --locked --workspace --lib --features tessera-coordinator/failpoints failpoint
if [[ -n "${TESSERA_FUZZ_SECONDS:-}" ]]; then
    echo "== fuzz the wire decoders (${TESSERA_FUZZ_SECONDS}s per target)"
    scripts/fuzz.sh "$TESSERA_FUZZ_SECONDS"
fi
echo "== done (${SECONDS}s)"
