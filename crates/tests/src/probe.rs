//! What the tests read of a running cluster from outside: who leads, as a peer sees it,
//! a process's memory and open files, processes by command line, and request latencies.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::get;

/// The leader's id as peer `url` itself sees it (`?local=true`: not forwarded), and its
/// view of the cluster.
pub fn leader_seen_by(url: &str) -> Option<(u64, Value)> {
    let (status, view) = get(&format!("{url}/v1/cluster?local=true")).ok()?;
    if status != 200 {
        return None;
    }
    let peers = view["peers"].as_array()?;
    let leaders: Vec<u64> = peers
        .iter()
        .filter(|p| p["role"] == "leader")
        .filter_map(|p| p["id"].as_u64())
        .collect();
    match leaders[..] {
        [one] => Some((one, view)),
        _ => None,
    }
}

/// A process's resident memory in bytes (0 when it is gone).
pub fn rss(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// How many file descriptors a process has open (0 when it is gone).
pub fn open_fds(pid: i32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count() as u64)
}

/// Latencies of six greedy requests to `model` at `http`, one after another, each with a
/// prompt of its own (8 tokens, so no prefix cache hit) and `max_tokens` tokens: the
/// first one's, and the median of the other five (the steady state).
pub fn first_and_steady_latency(
    http: &str,
    model: &str,
    max_tokens: usize,
) -> (Duration, Duration) {
    let mut times: Vec<Duration> = (0..6u32)
        .map(|i| {
            let prompt: Vec<u32> = (0..8).map(|t| 1 + (i * 8 + t) % 60).collect();
            let body = serde_json::json!({
                "model": model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": true,
            });
            let started = Instant::now();
            let (status, answer) = crate::post(&format!("{http}/v1/completions"), &body)
                .unwrap_or_else(|e| panic!("request {i}: {e:#}"));
            assert_eq!(status, 200, "request {i}: {answer}");
            started.elapsed()
        })
        .collect();
    let first = times.remove(0);
    times.sort();
    (first, times[times.len() / 2])
}

/// Processes whose command line contains every one of `needles` (as whole arguments or
/// substrings of one), other than this test process.
pub fn find_pids(needles: &[&str]) -> Vec<i32> {
    let me = std::process::id() as i32;
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut pids = Vec::new();
    for entry in entries.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(raw) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = raw
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if pid != me && needles.iter().all(|n| args.iter().any(|a| a.contains(n))) {
            pids.push(pid);
        }
    }
    pids
}

/// A shard started by `tessera up` for `topology`: its pid, when exactly one runs.
pub fn shard_pid(topology: &Path, group: &str, rank: usize) -> Option<i32> {
    let topology = topology.display().to_string();
    let rank = rank.to_string();
    let pids: Vec<i32> = find_pids(&["tessera-shard", &topology, group])
        .into_iter()
        .filter(|pid| {
            let raw = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let args: Vec<&[u8]> = raw.split(|b| *b == 0).collect();
            args.windows(2)
                .any(|w| w[0] == b"--rank" && w[1] == rank.as_bytes())
        })
        .collect();
    (pids.len() == 1).then(|| pids[0])
}
