//! Raft commit latency of one journal entry (`Accept` of a 256-token prompt), proposed on
//! the leader and awaited until applied there: 1 peer (an fsync), and 3 peers on this
//! host over QUIC with mutual TLS (a round trip to a follower, whose fsync the leader
//! waits for, plus the leader's own). Each peer's log is a redb file in a temporary
//! directory, as `tessera-coordinator` keeps it. Prints p50, p99 and max.
//!
//! Two loads: one entry at a time (each waits for the one before), and an open loop of
//! 1,000 proposals per second, each timed from when it was due until it was applied, so
//! that a Ready that falls behind shows as latency (with group commit, one fsync covers
//! every proposal that arrived while the last one ran).
//!
//! `cargo bench -p tessera-coordinator --bench raft_commit` (`TESSERA_BENCH_ENTRIES`
//! sets how many entries are timed one at a time, 500 by default; the open loop runs for
//! 5 s, `TESSERA_BENCH_PACED_SECONDS`).

// The report is this benchmark's output.
#![allow(clippy::print_stdout)]

use std::time::{Duration, Instant};

use tessera_comm::proto::Sampling;
use tessera_coordinator::engine::GenerateRequest;
use tessera_coordinator::replication::node::NodeHandle;
use tessera_coordinator::replication::state::Command;

// The benchmark uses only part of the peers' harness.
#[allow(dead_code)]
#[path = "../tests/support/peers.rs"]
mod peers;

fn accept(i: usize) -> Command {
    Command::Accept {
        id: format!("cmpl-bench-{i}"),
        request: GenerateRequest {
            model: "m".into(),
            prompt: (0..256).map(|t| (t * 7 + i as u32) % 32_000).collect(),
            max_tokens: 128,
            sampling: Sampling::default(),
            stop_token_ids: vec![2],
            stop: Vec::new(),
            priority: 0,
        },
        at_ms: i as u64,
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// `count` peers with their logs in `dir`, and their leader once 20 entries have warmed up
/// the connections.
async fn warmed_up(count: usize, dir: &std::path::Path) -> (peers::Peers, NodeHandle) {
    let peers = peers::Peers::start(count, dir);
    let leader = peers.node(peers.leader().await);
    for i in 0..20 {
        leader
            .propose(accept(i), Duration::from_secs(5))
            .await
            .expect("committed");
    }
    (peers, leader)
}

async fn measure(count: usize, entries: usize) {
    let dir = tempfile::tempdir().expect("temp dir");
    let (mut peers, leader) = warmed_up(count, dir.path()).await;
    let mut times = Vec::with_capacity(entries);
    for i in 0..entries {
        let started = Instant::now();
        leader
            .propose(accept(1_000 + i), Duration::from_secs(5))
            .await
            .expect("committed");
        times.push(started.elapsed());
    }
    times.sort();
    println!(
        "raft commit, {count} peer(s), {entries} journal entries: p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms",
        percentile(&times, 0.5).as_secs_f64() * 1e3,
        percentile(&times, 0.99).as_secs_f64() * 1e3,
        times.last().map_or(0.0, |t| t.as_secs_f64() * 1e3),
    );
    peers.stop_all().await;
}

/// Proposals due at `rate` per second for `seconds`, each timed from its due time.
async fn measure_paced(count: usize, rate: f64, seconds: f64) {
    let dir = tempfile::tempdir().expect("temp dir");
    let (mut peers, leader) = warmed_up(count, dir.path()).await;
    let total = (rate * seconds) as usize;
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(total);
    for i in 0..total {
        let due = start + Duration::from_secs_f64(i as f64 / rate);
        tokio::time::sleep_until(due.into()).await;
        let node = leader.clone();
        tasks.push(tokio::spawn(async move {
            node.propose(accept(100_000 + i), Duration::from_secs(10))
                .await
                .expect("committed");
            due.elapsed()
        }));
    }
    let mut times = Vec::with_capacity(total);
    for task in tasks {
        times.push(task.await.expect("proposal task"));
    }
    let elapsed = start.elapsed().as_secs_f64();
    times.sort();
    println!(
        "raft commit, {count} peer(s), open loop at {rate} proposals/s for {seconds} s \
         ({:.0}/s achieved): p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms",
        total as f64 / elapsed,
        percentile(&times, 0.5).as_secs_f64() * 1e3,
        percentile(&times, 0.99).as_secs_f64() * 1e3,
        times.last().map_or(0.0, |t| t.as_secs_f64() * 1e3),
    );
    peers.stop_all().await;
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` runs it once, briefly.
    let testing = !std::env::args().any(|a| a == "--bench");
    let entries = std::env::var("TESSERA_BENCH_ENTRIES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if testing { 20 } else { 500 });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let paced_seconds = std::env::var("TESSERA_BENCH_PACED_SECONDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if testing { 0.2 } else { 5.0 });
    runtime.block_on(async {
        measure(1, entries).await;
        measure(3, entries).await;
        measure_paced(1, 1_000.0, paced_seconds).await;
        measure_paced(3, 1_000.0, paced_seconds).await;
    });
}
