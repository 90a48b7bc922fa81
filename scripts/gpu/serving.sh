#!/usr/bin/env bash
# Serving, measured end to end: `tessera up` with one coordinator and one shard on DEVICE
# serving the model in MODEL_DIR (a HuggingFace directory; scripts/gpu/make_random_llama.py
# makes one without a download), then `tessera bench` at each concurrency of
# TESSERA_SERVING_CONCURRENCY (default "1 16 64"): prompts of 128 random token ids (the
# model needs no tokenizer), 128 output tokens, streamed, max(8, 2 × concurrency) measured
# requests after 2 warmup requests, sending for at most 20 s a level. Each level's report
# goes to OUT_DIR/bench-c<N>.json (scripts/gpu-report.py reads them), the cluster's logs to
# OUT_DIR/logs/. The cluster is stopped as Ctrl-C stops it (SIGTERM: the coordinator
# drains, then the shard stops), and no process of it may be left.
# scripts/gpu-check.sh runs it with cuda:0 on Llama-3.2-1B's shape; on a machine without a
# GPU, `cpu` and a `--tiny` model check the same steps.
# Binaries: $TESSERA_BIN_DIR (tessera, tessera-coordinator, tessera-shard), else
# ${CARGO_TARGET_DIR:-target}/release.
# Usage: scripts/gpu/serving.sh DEVICE MODEL_DIR OUT_DIR
set -euo pipefail
if [[ $# -ne 3 ]]; then
    echo "usage: $0 DEVICE MODEL_DIR OUT_DIR" >&2
    exit 2
fi
device="$1"
model_dir="$(cd "$2" && pwd)"
out_dir="$3"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
bin_dir="${TESSERA_BIN_DIR:-${CARGO_TARGET_DIR:-target}/release}"
bin_dir="$(cd "$bin_dir" && pwd)"
for bin in tessera tessera-coordinator tessera-shard; do
    [[ -x "$bin_dir/$bin" ]] || { echo "serving: no $bin_dir/$bin (scripts/gpu-prepare.sh, or cargo build --release)" >&2; exit 1; }
done
levels="${TESSERA_SERVING_CONCURRENCY:-1 16 64}"
# Ports of the GPU machine's own cluster, away from the defaults (7000, 7101, 8000) that
# a cluster of another checkout on a shared machine takes.
quic=127.0.0.1:17400 shard_port=17401 http=127.0.0.1:18400
if [[ "$device" == cpu ]]; then
    threads="$(nproc)" kv_memory=256MiB
else
    # 64 sequences of 256 tokens of Llama-3.2-1B's KV (32 KiB a token) take 512 MiB.
    threads=4 kv_memory=4GiB
fi
vocab="$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["vocab_size"])' "$model_dir/config.json")"
mkdir -p "$out_dir/logs"
run_dir="$(mktemp -d /tmp/tessera-serving.XXXXXX)"
cat > "$run_dir/topology.toml" <<EOF
# Written by scripts/gpu/serving.sh: one coordinator, one shard on $device.
[[coordinator]]
id = 1
host = "local"
quic = "$quic"
http = "$http"
data_dir = "coordinator-1"

[[host]]
name = "local"
address = "127.0.0.1"

[[model]]
name = "random-llama"
path = "$model_dir"
dtype = "auto"

[[group]]
name = "serving"
model = "random-llama"
tp = 1

[[group.shard]]
rank = 0
host = "local"
device = "$device"
threads = $threads
port = $shard_port
kv_memory = "$kv_memory"
EOF

# True when GET http://$http$1 answers 200.
http_ok() {
    python3 - "http://$http$1" <<'EOF'
import sys, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1], timeout=2) as r:
        sys.exit(0 if r.status == 200 else 1)
except Exception:
    sys.exit(1)
EOF
}

up_pid=""
# Stops the cluster as Ctrl-C does and checks that nothing of it is left; keeps the logs.
# shellcheck disable=SC2329  # the EXIT trap calls it
stop_cluster() {
    local status=$?
    trap - EXIT
    if [[ -n "$up_pid" ]] && kill -0 "$up_pid" 2>/dev/null; then
        local stop_started=$SECONDS
        kill -TERM "$up_pid"
        # Drain (30 s at most) and the two rounds of --grace 20 s bound it; after that
        # a second signal makes tessera up kill every child at once.
        for _ in $(seq 1 150); do kill -0 "$up_pid" 2>/dev/null || break; sleep 0.5; done
        kill -0 "$up_pid" 2>/dev/null && kill -TERM "$up_pid"
        local up_status=0
        wait "$up_pid" || up_status=$?
        echo "serving: tessera up stopped in $((SECONDS - stop_started)) s, exit $up_status"
        [[ "$up_status" == 0 ]] || status=1
    fi
    cp "$run_dir"/logs/*.log "$out_dir/logs/" 2>/dev/null || true
    # Every process of the cluster names the run directory on its command line.
    local left
    if ! command -v pgrep > /dev/null; then
        echo "serving: no pgrep here: cannot check that no process of the cluster is left" >&2
        status=1
    elif left="$(pgrep -f -- "$run_dir")"; then
        echo "serving: processes of the cluster still running:" >&2
        ps -o pid,pgid,etimes,args -p "$(echo "$left" | paste -sd,)" >&2 || true
        status=1
    else
        echo "serving: no process of the cluster is left"
        rm -rf "$run_dir"
    fi
    exit "$status"
}
trap stop_cluster EXIT

echo "serving: tessera up, one shard on $device (threads $threads, KV $kv_memory), model $model_dir"
"$bin_dir/tessera" up --topology "$run_dir/topology.toml" --run-dir "$run_dir" \
    --bin-dir "$bin_dir" --grace 20 > "$out_dir/logs/up.log" 2>&1 &
up_pid=$!
started=$SECONDS
until http_ok /ready; do
    if ! kill -0 "$up_pid" 2>/dev/null; then
        echo "serving: tessera up exited before the cluster was ready; its output:" >&2
        tail -n 40 "$out_dir/logs/up.log" >&2
        exit 1
    fi
    if (( SECONDS - started > ${TESSERA_SERVING_READY_S:-180} )); then
        echo "serving: not ready after $((SECONDS - started)) s; the last lines of tessera up:" >&2
        tail -n 40 "$out_dir/logs/up.log" >&2
        exit 1
    fi
    sleep 0.5
done
echo "serving: ready after $((SECONDS - started)) s"

failed=0
for concurrency in $levels; do
    requests=$(( concurrency * 2 > 8 ? concurrency * 2 : 8 ))
    echo "serving: concurrency $concurrency, $requests requests"
    # The bench's own timeouts bound it; `timeout` is the last resort.
    if ! timeout 120 "$bin_dir/tessera" bench --url "http://$http" \
        --prompt-token-ids "$vocab" --prompt-tokens 128 --output-tokens 128 \
        --concurrency "$concurrency" --requests "$requests" --warmup 2 --duration 20 \
        --request-timeout 60 --seed 0 --label "$device c=$concurrency" \
        --json "$out_dir/bench-c$concurrency.json"; then
        echo "serving: the bench at concurrency $concurrency failed" >&2
        failed=1
    fi
done
exit "$failed"
