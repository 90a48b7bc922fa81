//! What the failover tests share: three coordinator peers over a slow group, the leader
//! they agree on, and greedy reference tokens from a run without a fault.

use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use serde_json::json;

use crate::{Cluster, GroupSpec, fixture, leader_seen_by, post, token_ids};

/// The leader every peer of `urls` names (and not `not`), waited for up to `timeout`.
pub fn wait_for_leader(urls: &[&str], not: Option<u64>, timeout: Duration) -> u64 {
    let deadline = Instant::now() + timeout;
    loop {
        let seen: Vec<Option<u64>> = urls
            .iter()
            .map(|u| leader_seen_by(u).map(|(l, _)| l))
            .collect();
        if let Some(Some(leader)) = seen.first()
            && seen.iter().all(|s| *s == Some(*leader))
            && Some(*leader) != not
        {
            return *leader;
        }
        assert!(
            Instant::now() < deadline,
            "no agreed leader within {timeout:?}: {seen:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Kills `leader` (of the peers at `urls`, peer N at `urls[N - 1]`) with SIGKILL and
/// waits until the others agree on a new one: their URLs.
pub fn kill_leader<'a>(cluster: &mut Cluster, urls: &[&'a str], leader: u64) -> Vec<&'a str> {
    cluster.signal(&format!("coordinator-{leader}"), Signal::SIGKILL);
    let others: Vec<&str> = (1..=urls.len())
        .filter(|&p| p != leader as usize)
        .map(|p| urls[p - 1])
        .collect();
    wait_for_leader(&others, Some(leader), Duration::from_secs(15));
    others
}

pub fn greedy(url: &str, prompt: &[u32], n: usize) -> anyhow::Result<Vec<u32>> {
    let body = json!({
        "model": "m", "prompt": prompt, "max_tokens": n,
        "temperature": 0, "ignore_eos": true, "return_token_ids": true,
    });
    let (status, answer) = post(&format!("{url}/v1/completions"), &body)?;
    anyhow::ensure!(status == 200, "status {status}: {answer}");
    token_ids(&answer)
}

/// Greedy tokens of each prompt without a fault, all requests at once (greedy tokens do
/// not depend on the batch).
pub fn references(url: &str, prompts: &[Vec<u32>], n: usize) -> Vec<Vec<u32>> {
    std::thread::scope(|scope| {
        let runs: Vec<_> = prompts
            .iter()
            .map(|p| scope.spawn(|| greedy(url, p, n)))
            .collect();
        runs.into_iter()
            .map(|r| {
                r.join()
                    .expect("thread")
                    .unwrap_or_else(|e| panic!("{e:#}"))
            })
            .collect()
    })
}

/// Three coordinator peers and a tp = 2 group whose steps are slow (60 ms), so that a fault
/// lands in the middle of a generation.
pub fn slow_three_peers() -> (Cluster, Vec<String>) {
    let group = GroupSpec::local("g", "m", &fixture("llama-gqa/f32"), 2);
    Cluster::start_local_peers(3, &[group], &[("TESSERA_FAULT_STEP_DELAY_MS", "60")])
        .expect("cluster starts")
}
