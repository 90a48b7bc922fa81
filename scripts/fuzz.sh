#!/usr/bin/env bash
# Runs every fuzz target of the wire format and of the collectives' decoders
# (crates/comm/fuzz) for SECONDS each (default 30). Needs a nightly toolchain and cargo-fuzz; when either is missing, says
# what to install and exits 2 (it installs nothing itself).
#
#   scripts/fuzz.sh [SECONDS]
#
# Findings land in crates/comm/fuzz/artifacts/<target>/; replay one with
#   cd crates/comm/fuzz && cargo +nightly fuzz run <target> artifacts/<target>/<file>
set -euo pipefail

seconds="${1:-30}"
if ! [[ "$seconds" =~ ^[0-9]+$ ]] || [ "$seconds" -eq 0 ]; then
    echo "usage: $0 [SECONDS]   (SECONDS: a positive whole number, default 30)" >&2
    exit 64
fi

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
fuzz_dir="$root/crates/comm/fuzz"

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

cd "$fuzz_dir"
targets=(decode_shard_msg decode_coordinator_msg read_frame tcp_hello tcp_frame_header shm_header)
for target in "${targets[@]}"; do
    echo "fuzz.sh: $target for ${seconds}s"
    # -rss_limit_mb: a frame is at most 16 MiB, so a run that needs more than this is a
    # finding (an allocation sized by the input), not a slow input.
    cargo +nightly fuzz run "$target" -- \
        -max_total_time="$seconds" -rss_limit_mb=1024 -max_len=65536
done
echo "fuzz.sh: ${#targets[@]} targets ran ${seconds}s each without a finding"
