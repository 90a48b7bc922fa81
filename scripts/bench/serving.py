#!/usr/bin/env python3
"""Serving throughput and latency of Tessera's demo cluster and of llama.cpp's server
(llama-cpp-python) on this machine, under the same `tessera bench` loads.

1. Builds the release binaries (unless --no-build), starts `target/release/tessera up`
   (the SmolLM2 demo, API on 127.0.0.1:8000), waits for GET /ready, runs `tessera bench`
   at each concurrency (default 1, 8, 32; prompt 128 and output 128 tokens), stops it.
2. Installs `llama-cpp-python[server]` into .venv-bench/ if it is missing (this builds
   llama.cpp from source: several minutes, needs a C++ compiler), starts
   `python -m llama_cpp.server` on the same GGUF with as many threads as this machine has
   cores, on 127.0.0.1:8001, runs the same loads, stops it.
3. Prints throughput and TTFT per load and the ratios Tessera / llama.cpp; the JSON
   reports are in run/bench/ (<server>-c<N>.json).

llama-cpp-python's server holds one llama.cpp context behind a lock: it serves one request
at a time, and exposes neither llama.cpp's slots (`--parallel`) nor continuous batching.
With `--interrupt_requests False` (set here) concurrent requests wait their turn; with its
default (True) a new request would cut the stream being served short. So at concurrency > 1
llama.cpp's numbers are those of a queue in front of one sequence; Tessera's are whatever
its scheduler does with the requests in flight.

Streaming: when the Tessera coordinator refuses `stream: true` (before streaming lands) both
servers are measured with whole answers (`--no-stream`, no TTFT: E2E is compared instead),
so the two sides always run the same load. `--stream on|off` forces a mode.

Standard library only. Usage: scripts/bench/serving.py [--concurrency 1,8,32] [--requests N]
    [--prompt-tokens 128] [--output-tokens 128] [--up-args "..."] [--skip-tessera]
    [--skip-llamacpp]
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
TESSERA = os.path.join(ROOT, "target", "release", "tessera")
VENV = os.path.join(ROOT, ".venv-bench")
OUT = os.path.join(ROOT, "run", "bench")
# The version the README's single-stream comparison (vs-llamacpp.sh) was measured with.
LLAMA_CPP_PYTHON = "llama-cpp-python[server]==0.3.36"
TESSERA_URL = "http://127.0.0.1:8000"
LLAMACPP_URL = "http://127.0.0.1:8001"


def log(message):
    print(f"[serving] {message}", file=sys.stderr, flush=True)


def http_status(url, body=None, timeout=5):
    """The status of GET url (or POST body as JSON), or None when nothing answers."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def wait_for(url, proc, what, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{what} exited with {proc.returncode} before answering {url}")
        if http_status(url) == 200:
            return
        time.sleep(0.5)
    stop(proc)
    sys.exit(f"{what} did not answer {url} within {timeout} s")


def stop(proc):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def start(cmd, log_path):
    log(f"starting: {' '.join(cmd)} (log: {os.path.relpath(log_path, ROOT)})")
    with open(log_path, "w") as f:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def first_model(url):
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        return json.load(r)["data"][0]["id"]


def streams(url):
    """Whether the server accepts a streaming completion."""
    body = {"model": first_model(url), "prompt": "Hello", "max_tokens": 2, "stream": True}
    return http_status(url + "/v1/completions", body, timeout=120) == 200


def requests_for(concurrency, args):
    # Enough for every worker to finish several requests, and at least 32 in all.
    return args.requests or max(32, 4 * concurrency)


def run_loads(name, url, args, stream):
    reports = {}
    for c in args.concurrency:
        path = os.path.join(OUT, f"{name}-c{c}.json")
        cmd = [TESSERA, "bench", "--url", url, "--concurrency", str(c),
               "--requests", str(requests_for(c, args)), "--warmup", str(args.warmup),
               "--prompt-tokens", args.prompt_tokens, "--output-tokens", args.output_tokens,
               "--seed", str(args.seed), "--label", f"{name} c={c}", "--json", path]
        if not stream:
            cmd.append("--no-stream")
        log(" ".join(os.path.relpath(a, ROOT) if a.startswith(ROOT) else a for a in cmd))
        subprocess.run(cmd, cwd=ROOT, check=True)
        with open(path) as f:
            reports[c] = json.load(f)
    return reports


def bench_tessera(args, stream_mode):
    proc = start([TESSERA, "up", "--run-dir", os.path.join(OUT, "cluster")] + args.up_args.split(),
                 os.path.join(OUT, "tessera-up.log"))
    try:
        wait_for(TESSERA_URL + "/ready", proc, "tessera up", timeout=300)
        stream = stream_mode == "on" or (stream_mode == "auto" and streams(TESSERA_URL))
        if not stream:
            log("the coordinator does not stream (or --stream off): whole answers for both servers")
        return run_loads("tessera", TESSERA_URL, args, stream), stream
    finally:
        stop(proc)


def ensure_llamacpp():
    python = os.path.join(VENV, "bin", "python")
    check = [python, "-c", "import llama_cpp.server"]
    if os.path.exists(python) and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    log(f"installing {LLAMA_CPP_PYTHON} into {os.path.relpath(VENV, ROOT)} "
        "(builds llama.cpp from source: several minutes)")
    if not os.path.exists(python):
        subprocess.run([sys.executable, "-m", "venv", VENV], check=True)
    subprocess.run([python, "-m", "pip", "install", "--quiet", LLAMA_CPP_PYTHON], check=True)
    subprocess.run(check, check=True)
    return python


def bench_llamacpp(args, stream):
    python = ensure_llamacpp()
    threads = str(os.cpu_count() or 1)
    cmd = [python, "-m", "llama_cpp.server", "--model", MODEL, "--model_alias", "smollm2",
           "--host", "127.0.0.1", "--port", LLAMACPP_URL.rsplit(":", 1)[1],
           "--n_threads", threads, "--n_threads_batch", threads, "--n_ctx", str(args.n_ctx),
           "--interrupt_requests", "False", "--verbose", "False",
           # On, as llama.cpp's own server defaults to (`-fa auto`); faster on this machine.
           "--flash_attn", "True"]
    proc = start(cmd, os.path.join(OUT, "llamacpp-server.log"))
    try:
        wait_for(LLAMACPP_URL + "/v1/models", proc, "llama_cpp.server", timeout=300)
        return run_loads("llamacpp", LLAMACPP_URL, args, stream)
    finally:
        stop(proc)


def fmt(x, digits=1):
    return "n/a" if x is None else f"{x:.{digits}f}"


def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def latency(report, metric):
    d = report.get(metric)
    return None if d is None else d["p50_ms"]


def print_table(ours, theirs, stream):
    metric = "ttft" if stream else "e2e"
    name = "TTFT" if stream else "E2E"
    print(f"\nSmolLM2-135M-Instruct Q4_1, {os.cpu_count()} cores, "
          f"{'streaming' if stream else 'whole answers'}; ratios are Tessera / llama.cpp "
          f"(throughput: higher is better for Tessera; {name}: lower is better)\n")
    print(f"| concurrency | Tessera out tok/s | llama.cpp out tok/s | ratio "
          f"| Tessera {name} p50 ms | llama.cpp {name} p50 ms | ratio | failed (T / l) |")
    print("|---|---|---|---|---|---|---|---|")
    for c in sorted(set(ours) | set(theirs)):
        a, b = ours.get(c, {}), theirs.get(c, {})
        ta, tb = a.get("output_token_throughput_per_s"), b.get("output_token_throughput_per_s")
        la, lb = latency(a, metric), latency(b, metric)
        print(f"| {c} | {fmt(ta)} | {fmt(tb)} | {fmt(ratio(ta, tb), 2)} | {fmt(la)} | {fmt(lb)} "
              f"| {fmt(ratio(la, lb), 2)} | {a.get('failed', '-')} / {b.get('failed', '-')} |")
    print(f"\nreports: {os.path.relpath(OUT, ROOT)}/")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrencies")
    p.add_argument("--requests", type=int, default=0,
                   help="measured requests per load (default: max(32, 4 × concurrency))")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--prompt-tokens", default="128")
    p.add_argument("--output-tokens", default="128")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-ctx", type=int, default=2048, help="llama.cpp's context (prompt + output must fit)")
    p.add_argument("--stream", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--up-args", default="",
                   help="more arguments for `tessera up` (default: none, the demo: 3 exact CPU "
                        "shards); e.g. \"--model models/SmolLM2-135M-Instruct.Q4_1.gguf "
                        "--precision fast\" for one shard with this machine's cores, as "
                        "llama.cpp's server has")
    p.add_argument("--skip-tessera", action="store_true")
    p.add_argument("--skip-llamacpp", action="store_true")
    p.add_argument("--no-build", action="store_true")
    args = p.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if not os.path.exists(MODEL):
        sys.exit("no model: run scripts/get-demo-model.sh first")
    os.makedirs(OUT, exist_ok=True)
    for url in (TESSERA_URL, LLAMACPP_URL):
        if http_status(url + "/v1/models", timeout=1) is not None:
            sys.exit(f"something already answers at {url}: stop it first")
    if not args.no_build:
        subprocess.run(["cargo", "build", "--release", "-p", "tessera-cli", "-p", "tessera-shard",
                        "-p", "tessera-coordinator"], cwd=ROOT, check=True)
    ours, theirs, stream = {}, {}, args.stream != "off"
    if not args.skip_tessera:
        ours, stream = bench_tessera(args, args.stream)
    if not args.skip_llamacpp:
        theirs = bench_llamacpp(args, stream)
    print_table(ours, theirs, stream)


if __name__ == "__main__":
    main()
