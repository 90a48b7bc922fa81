#!/usr/bin/env bash
# Runs every fuzz target for SECONDS each (default 30): the wire format's and the
# collectives' decoders (crates/comm/fuzz), then the coordinator peers' Raft stream and
# snapshot decoders (crates/coordinator/fuzz). Needs a nightly toolchain and cargo-fuzz;
# when either is missing, says what to install and exits 2 (it installs nothing itself).
#
#   scripts/fuzz.sh [SECONDS]
#   TESSERA_FUZZ_SETS=comm scripts/fuzz.sh 15     # one set only
#
# Findings land in crates/<crate>/fuzz/artifacts/<target>/ (copy each one fixed into
# crates/<crate>/fuzz/seeds/<target>/, so every later run replays it); replay one with
#   cd crates/<crate>/fuzz && cargo +nightly fuzz run <target> artifacts/<target>/<file>
set -euo pipefail

seconds="${1:-30}"
if ! [[ "$seconds" =~ ^[0-9]+$ ]] || [ "$seconds" -eq 0 ]; then
    echo "usage: $0 [SECONDS]   (SECONDS: a positive whole number, default 30)" >&2
    exit 64
fi

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

missing=()
if ! cargo +nightly --version >/dev/null 2>&1; then
    missing+=("a nightly toolchain:  rustup toolchain install nightly")
fi
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    missing+=("cargo-fuzz:           cargo install cargo-fuzz --locked")
fi
if [ "${#missing[@]}" -gt 0 ]; then
    echo "fuzz.sh: cannot fuzz; install:" >&2
    for item in "${missing[@]}"; do
        echo "  - $item" >&2
    done
    exit 2
fi

# The wire format's and collectives' decoders, then the coordinator peers' (Raft messages
# off a peer's stream, replicated-state snapshots). TESSERA_FUZZ_SETS picks the sets
# (default "comm coordinator").
run_set() {
    local dir="$1"
    shift
    cd "$dir"
    for target in "$@"; do
        echo "fuzz.sh: $target for ${seconds}s"
        # -rss_limit_mb: a frame is at most 16 MiB, so a run that needs more than this is a
        # finding (an allocation sized by the input), not a slow input.
        # seeds/<target> (committed) holds inputs that once found a bug; they run first.
        mkdir -p "corpus/$target"
        local seeds=()
        [[ -d "seeds/$target" ]] && seeds=("seeds/$target")
        cargo +nightly fuzz run "$target" "corpus/$target" "${seeds[@]}" -- \
            -max_total_time="$seconds" -rss_limit_mb=1024 -max_len=65536
        count=$((count + 1))
    done
}
count=0
for set in ${TESSERA_FUZZ_SETS:-comm coordinator}; do
    case "$set" in
        comm) run_set "$root/crates/comm/fuzz" decode_shard_msg decode_coordinator_msg \
            read_frame tcp_hello tcp_frame_header shm_header ;;
        coordinator) run_set "$root/crates/coordinator/fuzz" raft_stream snapshot_restore ;;
        *) echo "fuzz.sh: unknown set '$set' (known: comm, coordinator)" >&2; exit 64 ;;
    esac
done
echo "fuzz.sh: $count targets ran ${seconds}s each without a finding"
