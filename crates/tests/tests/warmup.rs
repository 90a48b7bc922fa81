//! Warmup before traffic (issue 19, item 1), through `tessera up` and the real binaries:
//! with `--warmup on` every rank of a tp = 2 group runs the largest steps the scheduler
//! plans (a prefill of the step budget, a decode of 256 sequences, through the group's
//! collective) before it says ready, and `/ready` answers 200 only after that. The warmup
//! leaves no trace: the greedy tokens are still transformers'. With `--warmup off`, and
//! with `auto` on CPU shards, no rank warms up.
//!
//! The first request's latency against the steady state's is checked where the warmup
//! is on by default, on a GPU (`cuda_cluster.rs`): on CPU shards, the first request was
//! measured as fast as the later ones without any warmup.

use std::time::{Duration, Instant};

use tessera_tests::up::Up;
use tessera_tests::{GroupSpec, f32_greedy, fixture, metric, post, token_ids};

const TIMEOUT: Duration = Duration::from_secs(120);

/// `tessera up` of one tp = 2 group of the llama-gqa fixture, with `TESSERA_WARMUP=mode`,
/// ready; what each rank's `tessera_shard_warmup_seconds` was right when `/ready` first
/// answered 200 (the coordinator sets it before the group serves, and never after).
fn start(mode: &str) -> (Up, [f64; 2]) {
    let groups = [GroupSpec::local("g", "m", &fixture("llama-gqa/f32"), 2)];
    let up = Up::start(&groups, &[("TESSERA_WARMUP", mode)]);
    up.wait_ready(TIMEOUT);
    let warmup = [0, 1].map(|rank| {
        let labels = format!("group=\"g\",rank=\"{rank}\"");
        metric(&up.http, "tessera_shard_warmup_seconds", &labels).expect("metrics")
    });
    (up, warmup)
}

/// `tessera up`'s log once it holds `lines` lines with `needle` (the launcher relays its
/// children's output a little after they write it), or after 10 s.
fn log_with(up: &Up, needle: &str, lines: usize) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let log = up.log();
        if log.lines().filter(|l| l.contains(needle)).count() >= lines || Instant::now() > deadline
        {
            return log;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn warmed_ranks(log: &str) -> usize {
    log.lines()
        .filter(|l| l.contains("rank warmed up") && l.contains("group=g"))
        .count()
}

fn assert_transformers_tokens(up: &Up) {
    for (prompt, want) in f32_greedy("llama-gqa") {
        let body = serde_json::json!({
            "model": "m", "prompt": prompt, "max_tokens": want.len(),
            "temperature": 0, "ignore_eos": true, "return_token_ids": true,
        });
        let (status, answer) = post(&format!("{}/v1/completions", up.http), &body).expect("post");
        assert_eq!(status, 200, "{answer}");
        let got = token_ids(&answer).expect("token ids");
        assert_eq!(got, want, "prompt {prompt:?}\n{}", up.log());
    }
}

#[test]
fn every_rank_warms_up_before_ready_and_the_warmup_leaves_no_trace() {
    let (up, warmup) = start("on");
    assert!(
        warmup.iter().all(|&s| s > 0.0),
        "both ranks had warmed up when /ready answered 200: {warmup:?} s\n{}",
        up.log()
    );
    let log = log_with(&up, "warmed up epoch=1", 2);
    for rank in 0..2 {
        let line = log
            .lines()
            .find(|l| l.contains("warmed up epoch=1") && l.contains(&format!("rank={rank} ")))
            .unwrap_or_else(|| panic!("rank {rank}'s warmup line\n{log}"));
        assert!(
            line.contains("decode_seqs=256") && line.contains("steps=4"),
            "the largest decode the scheduler plans: {line}"
        );
    }
    assert_transformers_tokens(&up);
}

#[test]
fn off_and_auto_on_cpu_shards_skip_the_warmup() {
    for mode in ["off", "auto"] {
        let (up, warmup) = start(mode);
        assert_transformers_tokens(&up);
        assert_eq!(warmup, [0.0; 2], "{mode}: no warmup time exported");
        assert_eq!(warmed_ranks(&up.log()), 0, "{mode}\n{}", up.log());
    }
}
