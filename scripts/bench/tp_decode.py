#!/usr/bin/env python3
"""SmolLM2 decode speed at tp = 1 and tp = 3 (or --tps) through the whole cluster path.

For each tp, starts `tessera up --model models/SmolLM2-135M-Instruct.Q4_1.gguf --tp N`
(release build), and measures through the HTTP API:
  - decode tokens/s: (time of a 129-token generation - time of a 1-token generation) / 128,
    the median of --runs pairs, so prefill and HTTP overhead cancel;
  - from the coordinator's "step timings" log lines: the share of each rank's step time
    spent inside collectives, and the bubble (time a shard waited for its next plan, as a
    share of step + wait time).
Prints one table; tp = 1 is the reference the tp = 3 figures are divided by. Standard
library only. Usage: scripts/bench/tp_decode.py [--runs 5] [--tokens 128]
"""

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
TESSERA = os.path.join(ROOT, "target", "release", "tessera")


def post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


def wait_health(url, proc, timeout=180):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"tessera up exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    sys.exit("the cluster did not come up")


def timed(url, model, max_tokens):
    body = {"model": model, "prompt": "Write a story about a lighthouse keeper.", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    answer = post(url + "/v1/completions", body)
    elapsed = time.perf_counter() - start
    assert answer["usage"]["completion_tokens"] == max_tokens, answer
    return elapsed


def shares(log_text):
    """Mean collective and bubble shares over every 'step timings' line of the run."""
    coll, bubble = [], []
    for line in log_text.splitlines():
        if "step timings" not in line:
            continue
        c = re.search(r"collective_share=\"?([0-9.]+)", line)
        b = re.search(r"bubble_share=\"?([0-9.]+)", line)
        if c and b:
            coll.append(float(c.group(1)))
            bubble.append(float(b.group(1)))
    if not coll:
        return None, None
    return statistics.mean(coll), statistics.mean(bubble)


def run(tp, args, port):
    run_dir = tempfile.mkdtemp(prefix=f"tessera-bench-tp{tp}-")
    log_path = os.path.join(run_dir, "up.log")
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [TESSERA, "up", "--model", MODEL, "--tp", str(tp), "--http", f"127.0.0.1:{port}",
             "--run-dir", run_dir],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_health(url, proc)
        models = json.load(urllib.request.urlopen(url + "/v1/models"))
        model = models["data"][0]["id"]
        timed(url, model, 8)  # warm-up (and wait until the group serves)
        rates = []
        for _ in range(args.runs):
            short = timed(url, model, 1)
            long = timed(url, model, args.tokens + 1)
            rates.append(args.tokens / max(long - short, 1e-9))
        time.sleep(11)  # one more 10 s timing report from the coordinator
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    with open(log_path) as f:
        coll, bubble = shares(f.read())
    return statistics.median(rates), coll, bubble


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--tps", default="1,3", help="tensor-parallel degrees to run; the first is the reference")
    args = p.parse_args()
    if not os.path.exists(MODEL):
        sys.exit("run scripts/get-demo-model.sh first")
    subprocess.run(["cargo", "build", "--release", "-p", "tessera-cli", "-p", "tessera-shard",
                    "-p", "tessera-coordinator"], cwd=ROOT, check=True)
    tps = [int(t) for t in args.tps.split(",")]
    results = {tp: run(tp, args, 18000 + tp) for tp in tps}
    print(f"\nSmolLM2-135M Q4_1, {os.cpu_count()} CPUs, decode of {args.tokens} tokens, median of {args.runs}")
    print(f"{'tp':>3} {'tok/s':>8} {'vs tp=' + str(tps[0]):>8} {'collective':>11} {'bubble':>8}")
    base = results[tps[0]][0]
    for tp, (rate, coll, bubble) in results.items():
        fmt = lambda x: "n/a" if x is None else f"{100 * x:.1f}%"
        print(f"{tp:>3} {rate:>8.1f} {rate / base:>8.2f} {fmt(coll):>11} {fmt(bubble):>8}")


if __name__ == "__main__":
    main()
