#!/usr/bin/env bash
# Chaos and soak: crates/tests/tests/chaos.rs for SECONDS (180 by default; 1800 for a soak)
# with the fault schedule of SEED (from the clock by default; the run prints it). Three
# coordinator peers and two shard groups of the demo model under mixed load, while leaders,
# followers and shards are killed or stopped, a peer is cut off the network (as root) and
# a peer's disk stalls. The ledger is printed and written to $TESSERA_CHAOS_LEDGER
# (target/chaos-ledger.json by default).
#
# The disk stalls need a coordinator built with the feature `failpoints`: this script
# builds one (only the coordinator crate compiles again), sets it aside as
# <target>/chaos/tessera-coordinator-failpoints and passes it to the test in
# TESSERA_CHAOS_COORDINATOR. `cargo test --workspace` (CI) runs the test without it, and
# the disk stalls are skipped there, each said so.
#
# Usage: scripts/chaos.sh [SECONDS] [SEED]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

seconds="${1:-${TESSERA_CHAOS_SECONDS:-180}}"
seed="${2:-${TESSERA_CHAOS_SEED:-$(date +%s)}}"
target="${CARGO_TARGET_DIR:-target}"
[[ "$target" = /* ]] || target="$PWD/$target"
bins=(--profile test -p tessera-cli -p tessera-coordinator -p tessera-shard)

scripts/get-demo-model.sh
export TESSERA_REQUIRE_DEMO_MODEL=1
echo "== a coordinator with failpoints (${SECONDS}s)"
cargo build --locked "${bins[@]}" --features tessera-coordinator/failpoints
mkdir -p "$target/chaos"
cp "$target/debug/tessera-coordinator" "$target/chaos/tessera-coordinator-failpoints"
echo "== the binaries as they ship (${SECONDS}s)"
cargo build --locked "${bins[@]}"
echo "== chaos for ${seconds}s, seed ${seed} (${SECONDS}s)"
TESSERA_CHAOS_COORDINATOR="$target/chaos/tessera-coordinator-failpoints" \
TESSERA_CHAOS_SECONDS="$seconds" TESSERA_CHAOS_SEED="$seed" \
    cargo test --locked -p tessera-tests --test chaos -- --nocapture
echo "== done (${SECONDS}s)"
