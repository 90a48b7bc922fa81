#!/usr/bin/env bash
# Decode and prefill tokens/s of `tessera generate` (in both precisions, exact and fast) and
# llama.cpp (llama-cpp-python) on the same GGUF, same prompt tokens, same thread counts,
# run alternately on this machine, plus the machine's memory bandwidth (numpy copy) for
# scale. Prints a Markdown table.
#
# Setup once:  python3 -m venv .venv-bench && .venv-bench/bin/pip install llama-cpp-python numpy
# Usage:       scripts/bench/vs-llamacpp.sh [MODEL.gguf] [REPEATS]
#              (LLAMACPP_PYTHON=path/to/python to use another environment)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

model="${1:-models/SmolLM2-135M-Instruct.Q4_1.gguf}"
repeats="${2:-3}"
max_tokens=128
py="${LLAMACPP_PYTHON:-.venv-bench/bin/python}"
[[ -x "$py" ]] || { echo "error: $py not found; see the setup line at the top of $0" >&2; exit 1; }
[[ -f "$model" ]] || scripts/get-demo-model.sh

cargo build --release -q -p tessera-cli
tessera=target/release/tessera
prompt=$("$tessera" generate --model "$model" --max-tokens 1 --json \
    --chat "Write a short story about a lighthouse keeper who finds a message in a bottle." |
    python3 -c "import json,sys; print(','.join(map(str, json.load(sys.stdin)['prompt_token_ids'])))")

bandwidth=$("$py" - <<'PY'
import time, numpy as np
a = np.ones(256 * 2**20 // 8); b = np.empty_like(a); best = 0.0
for _ in range(5):
    t = time.perf_counter(); np.copyto(b, a); dt = time.perf_counter() - t
    best = max(best, 2 * a.nbytes / dt / 1e9)
print(f"{best:.1f}")
PY
)

results=$(mktemp)
trap 'rm -f "$results"' EXIT
for threads in 1 2; do
    for ((i = 0; i < repeats; i++)); do
        for precision in exact fast; do
            "$tessera" generate --model "$model" --prompt-tokens "$prompt" --max-tokens $max_tokens \
                --ignore-eos --threads "$threads" --precision $precision --json |
                python3 -c "import json,sys; d=json.load(sys.stdin); print('tessera-$precision', $threads, d['prefill_tokens_per_s'], d['decode_tokens_per_s'], ','.join(map(str,d['tokens'])))" >> "$results"
        done
        "$py" scripts/bench/llamacpp_run.py --model "$model" --prompt-tokens "$prompt" \
            --max-tokens $max_tokens --threads "$threads" |
            python3 -c "import json,sys; d=json.load(sys.stdin); print('llama.cpp', $threads, d['prefill_tokens_per_s'], d['decode_tokens_per_s'], ','.join(map(str,d['tokens'])))" >> "$results"
    done
done

python3 - "$results" "$bandwidth" "$model" "$(echo "$prompt" | tr ',' '\n' | wc -l)" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
bandwidth, model, n_prompt = sys.argv[2], sys.argv[3], sys.argv[4]
med = lambda xs: statistics.median(float(x) for x in xs)
print(f"model {model}, {n_prompt} prompt tokens, 128 generated (greedy), median of {len(rows)//6} runs each;")
print(f"memory bandwidth (numpy copy, 1 thread): {bandwidth} GB/s\n")
print("| threads | engine | prefill tok/s | decode tok/s | prefill / llama.cpp | decode / llama.cpp | greedy tokens equal to llama.cpp's |")
print("|---|---|---|---|---|---|---|")
for threads in ("1", "2"):
    stats = {}
    for engine in ("tessera-exact", "tessera-fast", "llama.cpp"):
        rs = [r for r in rows if r[0] == engine and r[1] == threads]
        stats[engine] = (med(r[2] for r in rs), med(r[3] for r in rs), rs[0][4].split(","))
    base = stats["llama.cpp"]
    for engine, (pre, dec, tokens) in stats.items():
        same = next((i for i, (x, y) in enumerate(zip(tokens, base[2])) if x != y), len(tokens))
        print(f"| {threads} | {engine} | {pre:.1f} | {dec:.1f} | {pre / base[0]:.2f} | {dec / base[1]:.2f} | first {same} of {len(tokens)} |")
PY
