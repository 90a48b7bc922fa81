#!/usr/bin/env python3
"""One table and one JSON file from a `scripts/gpu-check.sh` log.

gpu-check.sh runs each step under a heading line (`== ...`). Within a step, the test
binaries print `test result: ok. N passed; M failed; ...`, and the benchmarks print one
`RESULT {json}` line per measured row (`crates/model/benches/cuda_decode.rs`,
`crates/kernels/benches/cuda_gemv.rs`) next to their own tables. This collects, per heading, the tests' counts and the results, and:

  - prints one summary: each step with its test counts, then the decode throughput
    (graphed, by batch and sampling) of every variant, and the GEMV's share of the copy
    bandwidth per projection;
  - writes the same figures as JSON (`--json FILE`).

With `--serving DIR` it also reads the `tessera bench` reports that scripts/gpu/serving.sh
wrote there (`bench-c<N>.json`, one per concurrency) and adds a serving table: requests
ok and failed, output tokens/s, TTFT p50 and p99, ITL p50 per concurrency (`serving` in
the JSON).

Usage: scripts/gpu-report.py LOG [--json FILE] [--serving DIR]
       scripts/gpu-report.py --self-test
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import tempfile

FIRST = "(before the first step)"
TEST_RESULT = re.compile(r"test result: (\w+)\. (\d+) passed; (\d+) failed")


def parse(lines) -> dict:
    """The steps of a log, in order: heading, test counts, results."""
    device = None
    steps: list[dict] = []
    step = {"heading": FIRST, "passed": 0, "failed": 0,
            "test_runs": 0, "results": []}
    for raw in lines:
        line = raw.rstrip("\n")
        if line.startswith("== "):
            # Every step counts, and the lines before the first heading when they hold any.
            if steps or step["test_runs"] or step["results"] or step["heading"] != FIRST:
                steps.append(step)
            step = {"heading": line[3:], "passed": 0, "failed": 0, "test_runs": 0,
                    "results": []}
            continue
        if step["heading"] == "the device" and device is None and line.strip():
            device = line.strip()
        m = TEST_RESULT.search(line)
        if m:
            step["test_runs"] += 1
            step["passed"] += int(m.group(2))
            step["failed"] += int(m.group(3))
            continue
        if line.startswith("RESULT "):
            try:
                step["results"].append(json.loads(line[len("RESULT "):]))
            except json.JSONDecodeError as e:
                step.setdefault("unreadable", []).append(f"{e}: {line[:200]}")
    steps.append(step)
    return {"device": device, "steps": steps}


def serving_row(bench: dict, source: str) -> dict:
    """One concurrency's figures from a `tessera bench --json` report."""
    def ms(metric: str, stat: str):
        return (bench.get(metric) or {}).get(stat)
    return {
        "source": source,
        "label": bench.get("label"),
        "concurrency": (bench.get("load") or {}).get("concurrency"),
        "completed": bench.get("completed"),
        "failed": bench.get("failed"),
        "output_tok_s": bench.get("output_token_throughput_per_s"),
        "ttft_p50_ms": ms("ttft", "p50_ms"),
        "ttft_p99_ms": ms("ttft", "p99_ms"),
        "itl_p50_ms": ms("itl", "p50_ms"),
        "errors": bench.get("errors") or [],
    }


def read_serving(directory: str) -> list[dict]:
    """The rows of every bench report in `directory`, by concurrency."""
    rows = []
    for path in glob.glob(os.path.join(directory, "bench-c*.json")):
        try:
            with open(path, encoding="utf-8") as f:
                rows.append(serving_row(json.load(f), os.path.basename(path)))
        except (OSError, ValueError, AttributeError) as e:
            rows.append({"source": os.path.basename(path), "unreadable": str(e)})
    return sorted(rows, key=lambda r: (r.get("concurrency") is None, r.get("concurrency") or 0))


def number(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def summary(report: dict) -> str:
    out = [f"device: {report['device'] or 'unknown'}", "", "step | tests passed | failed"]
    out.append("---|---|---")
    for s in report["steps"]:
        if s["test_runs"]:
            out.append(f"{s['heading']} | {s['passed']} | {s['failed']}")
    decode = [(s["heading"], r) for s in report["steps"] for r in s["results"]
              if r.get("kind") == "decode" and r.get("mode") == "graph"]
    if decode:
        out += ["", "decode, graphed: model | attention | launches | gemm | batch | sampling | "
                "tok/s | host µs/step | of peak bandwidth | of a device copy",
                "---|---|---|---|---|---|---|---|---|---"]
        for _, r in decode:
            share = r.get("of_copy")
            out.append(
                f"{r.get('model')} | {r.get('attention')} | {r.get('launches_path')} | "
                f"{r.get('gemm')} | {r.get('batch'):g} | {r.get('sampling')} | "
                f"{r.get('tok_s', 0):.0f} | {r.get('host_us_step', 0):.1f} | "
                f"{100 * (r.get('of_peak') or 0):.1f}% | "
                f"{'-' if share is None else f'{100 * share:.1f}%'}")
    prefill = [r for s in report["steps"] for r in s["results"] if r.get("kind") == "prefill"]
    if prefill:
        out += ["", "prefill, one sequence in one pass: model | attention | launches | tokens | "
                "ms | tok/s", "---|---|---|---|---|---"]
        for r in prefill:
            out.append(
                f"{r.get('model')} | {r.get('attention')} | {r.get('launches_path')} | "
                f"{r.get('tokens'):g} | {number(r.get('ms'), 2)} | {number(r.get('tok_s'), 0)}")
    gemv = [r for s in report["steps"] for r in s["results"] if r.get("kind") == "gemv"]
    if gemv:
        out += ["", "bf16 GEMV: projection | rows×cols | tokens | GEMV GB/s | of copy | "
                "cuBLAS GB/s | of copy", "---|---|---|---|---|---|---"]
        for r in gemv:
            out.append(
                f"{r.get('projection')} | {r.get('shape')} | {r.get('tokens'):g} | "
                f"{r.get('gemv_gb_s', 0):.0f} | {100 * (r.get('gemv_of_copy') or 0):.1f}% | "
                f"{r.get('cublas_gb_s', 0):.0f} | {100 * (r.get('cublas_of_copy') or 0):.1f}%")
    if "serving" in report:
        out += ["", "serving (tessera up + tessera bench): concurrency | requests ok | failed | "
                "output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms",
                "---|---|---|---|---|---|---"]
        for r in report["serving"]:
            if "unreadable" in r:
                out.append(f"{r['source']}: unreadable ({r['unreadable']})")
                continue
            out.append(
                f"{r['concurrency']} | {r['completed']} | {r['failed']} | "
                f"{number(r['output_tok_s'])} | {number(r['ttft_p50_ms'])} | "
                f"{number(r['ttft_p99_ms'])} | {number(r['itl_p50_ms'], 2)}")
        if not report["serving"]:
            out.append("(no bench report: the serving step failed or did not run)")
    failed = sum(s["failed"] for s in report["steps"])
    out += ["", f"tests failed in all: {failed}"]
    return "\n".join(out)


SAMPLE = """== the device
NVIDIA H200, 143771 MiB, 580.65
== each kernel against its CPU twin
test result: ok. 31 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out
== the bf16 GEMV against cuBLAS: GB/s per projection, next to a device copy's
RESULT {"kind":"copy","gb_s":4273}
RESULT {"kind":"gemv","projection":"o","shape":"2048x2048","tokens":1,"gemv_us":3.1,"gemv_gb_s":2706,"gemv_of_copy":0.633,"cublas_us":4.0,"cublas_gb_s":2097,"cublas_of_copy":0.49}
== TESSERA_FUSED=0 (legacy launches, the default), TESSERA_ATTENTION=legacy (the default): decode throughput
RESULT {"kind":"decode","model":"llama-1b","attention":"legacy","launches_path":"legacy","gemm":"cublas","batch":1,"mode":"graph","sampling":"device","ms_step":3.0,"host_us_step":40.0,"tok_s":333,"launches_step":1,"allocs_step":0,"gb_s":800,"of_peak":0.17,"of_copy":0.187}
RESULT {"kind":"prefill","model":"llama-1b","attention":"legacy","launches_path":"legacy","tokens":4096,"ms":52.5,"tok_s":78019.0}
RESULT {"kind":"decode","model":"llama-1b","attention":"legacy","launches_path":"legacy","gemm":"cublas","batch":1,"mode":"eager","sampling":"host","ms_step":4.0,"host_us_step":900.0,"tok_s":250,"launches_step":300,"allocs_step":2,"gb_s":600,"of_peak":null}
RESULT {"kind":"decode", broken
== a cluster
test result: FAILED. 1 passed; 1 failed; 0 ignored
"""


# Two levels of `tessera bench --json` (the fields read, and a few others), the second
# with every request failed.
SAMPLE_BENCH = {
    "bench-c16.json": {
        "label": "cuda:0 c=16", "load": {"mode": "closed", "concurrency": 16},
        "completed": 32, "failed": 0, "errors": [], "wall_s": 2.5,
        "output_token_throughput_per_s": 1638.44, "request_throughput_per_s": 12.8,
        "ttft": {"count": 32, "mean_ms": 30.0, "p50_ms": 25.04, "p90_ms": 40.0,
                 "p99_ms": 61.96, "min_ms": 9.0, "max_ms": 63.0},
        "itl": {"count": 4064, "mean_ms": 9.5, "p50_ms": 9.134, "p90_ms": 11.0,
                "p99_ms": 14.0, "min_ms": 0.0, "max_ms": 20.0},
    },
    "bench-c64.json": {
        "label": "cuda:0 c=64", "load": {"mode": "closed", "concurrency": 64},
        "completed": 0, "failed": 128, "wall_s": 1.0,
        "errors": [{"message": "HTTP 503: overloaded", "count": 128}],
        "output_token_throughput_per_s": 0.0, "ttft": None, "itl": None,
    },
    "bench-c1.json": "{ not json",
}


def self_test() -> None:
    report = parse(SAMPLE.splitlines(keepends=True))
    assert report["device"] == "NVIDIA H200, 143771 MiB, 580.65", report["device"]
    steps = {s["heading"]: s for s in report["steps"]}
    assert steps["each kernel against its CPU twin"]["passed"] == 31
    assert steps["a cluster"]["failed"] == 1 and steps["a cluster"]["passed"] == 1
    decode = [r for s in report["steps"] for r in s["results"] if r["kind"] == "decode"]
    assert len(decode) == 2 and decode[1]["of_peak"] is None, decode
    assert [s["heading"] for s in report["steps"]][0] == "the device"
    assert len(steps[next(h for h in steps if h.startswith("TESSERA_FUSED=0"))]
               .get("unreadable", [])) == 1
    text = summary(report)
    assert "llama-1b | legacy | legacy | cublas | 1 | device | 333 | 40.0 | 17.0% | 18.7%" in text, text
    assert "llama-1b | legacy | legacy | 4096 | 52.50 | 78019" in text, text
    assert "| eager" not in text and "250" not in text, "only graphed decode rows"
    assert "o | 2048x2048 | 1 | 2706 | 63.3% | 2097 | 49.0%" in text, text
    assert text.endswith("tests failed in all: 1"), text
    json.dumps(report)

    with tempfile.TemporaryDirectory() as directory:
        for name, content in SAMPLE_BENCH.items():
            with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
                f.write(content if isinstance(content, str) else json.dumps(content))
        report["serving"] = read_serving(directory)
    rows = report["serving"]
    assert [r.get("concurrency") for r in rows] == [16, 64, None], rows
    assert rows[0]["output_tok_s"] == 1638.44 and rows[0]["itl_p50_ms"] == 9.134, rows[0]
    assert rows[1]["errors"][0]["count"] == 128 and rows[1]["ttft_p50_ms"] is None
    assert rows[2]["source"] == "bench-c1.json" and "unreadable" in rows[2], rows[2]
    text = summary(report)
    assert "16 | 32 | 0 | 1638.4 | 25.0 | 62.0 | 9.13" in text, text
    assert "64 | 0 | 128 | 0.0 | - | - | -" in text, text
    assert "bench-c1.json: unreadable" in text, text
    assert text.endswith("tests failed in all: 1"), text
    assert "(no bench report" in summary({**report, "serving": []})
    assert "serving (" not in summary({k: v for k, v in report.items() if k != "serving"})
    json.dumps(report)
    print("gpu-report.py: self-test passed")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", nargs="?")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--serving", metavar="DIR",
                        help="add the serving table from the bench reports in DIR")
    parser.add_argument("--self-test", action="store_true")
    args = parser.parse_args()
    if args.self_test:
        self_test()
        return 0
    if not args.log:
        parser.error("a log file is needed (or --self-test)")
    with open(args.log, encoding="utf-8", errors="replace") as f:
        report = parse(f)
    if args.serving:
        report["serving"] = read_serving(args.serving)
    print(summary(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
