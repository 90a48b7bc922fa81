//! Coordinator failover through the real binaries: three coordinator peers (Raft) and a
//! tp = 2 group. Any peer answers (followers forward to the leader); the leader is
//! killed with SIGKILL and the other two elect a new one, which the shards re-register
//! with; the tokens stay those of transformers; the killed peer restarts from its data
//! dir and rejoins as a follower.

use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use serde::Deserialize;
use serde_json::{Value, json};
use tessera_tests::{Cluster, GroupSpec, fixture, get, post, token_ids};

#[derive(Deserialize)]
struct Expected {
    prompts: Vec<Vec<u32>>,
    variants: std::collections::BTreeMap<String, Variant>,
}

#[derive(Deserialize)]
struct Variant {
    results: Vec<Greedy>,
}

#[derive(Deserialize)]
struct Greedy {
    greedy: Vec<u32>,
}

/// The leader's id as peer `url` reports it, once every peer it lists agrees on one.
fn leader_seen_by(url: &str) -> Option<(u64, Value)> {
    let (status, view) = get(&format!("{url}/v1/cluster")).ok()?;
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

fn wait_for_leader(urls: &[&str], not: Option<u64>, timeout: Duration) -> u64 {
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

fn greedy(url: &str, prompt: &[u32], n: usize) -> anyhow::Result<Vec<u32>> {
    let body = json!({
        "model": "m", "prompt": prompt, "max_tokens": n,
        "temperature": 0, "ignore_eos": true, "return_token_ids": true,
    });
    let (status, answer) = post(&format!("{url}/v1/completions"), &body)?;
    anyhow::ensure!(status == 200, "status {status}: {answer}");
    token_ids(&answer)
}

#[test]
fn killing_the_leader_elects_another_that_serves_the_same_tokens() {
    let expected: Expected = serde_json::from_str(
        &std::fs::read_to_string(fixture("llama-gqa/expected.json")).expect("expected.json"),
    )
    .expect("expected.json parses");
    let prompt = &expected.prompts[0];
    let want = &expected.variants["f32"].results[0].greedy;
    let group = GroupSpec::local("g", "m", &fixture("llama-gqa/f32"), 2);
    let (mut cluster, urls) = Cluster::start_local_peers(3, &[group]).expect("cluster starts");
    let all: Vec<&str> = urls.iter().map(String::as_str).collect();

    let leader = wait_for_leader(&all, None, Duration::from_secs(20));
    eprintln!("leader: peer {leader}");
    // Every peer serves: followers forward to the leader.
    for url in &all {
        let got = greedy(url, prompt, want.len())
            .unwrap_or_else(|e| panic!("via {url}: {e:#}\n{}", cluster.logs()));
        assert_eq!(&got, want, "via {url}");
    }
    // Every peer is listed with its address and, once it has announced itself, its pid.
    let listed = Instant::now();
    let view = loop {
        let (_, view) = leader_seen_by(all[0]).expect("a view");
        let announced = view["peers"]
            .as_array()
            .is_some_and(|ps| ps.iter().all(|p| p["pid"].is_u64()));
        if announced || listed.elapsed() > Duration::from_secs(10) {
            break view;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let peers = view["peers"].as_array().expect("peers");
    assert_eq!(peers.len(), 3, "{view}");
    for (i, p) in peers.iter().enumerate() {
        assert_eq!(p["id"], i as u64 + 1, "{view}");
        assert_eq!(
            format!("http://{}", p["http"].as_str().unwrap_or("")),
            all[i]
        );
        assert!(p["pid"].as_u64().is_some(), "{view}");
        assert!(p["term"].as_u64().is_some_and(|t| t >= 1), "{view}");
    }

    // SIGKILL the leader; the others elect a new one, and it serves.
    cluster.signal(&format!("coordinator-{leader}"), Signal::SIGKILL);
    let killed = Instant::now();
    let survivors: Vec<&str> = (1..=3u64)
        .filter(|&id| id != leader)
        .map(|id| all[id as usize - 1])
        .collect();
    let served = loop {
        match greedy(survivors[0], prompt, want.len()) {
            Ok(got) => break got,
            Err(error) => {
                assert!(
                    killed.elapsed() < Duration::from_secs(30),
                    "no leader served within 30 s: {error:#}\n{}",
                    cluster.logs()
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    };
    let took = killed.elapsed();
    eprintln!("leader killed → a request served by the new leader: {took:?}");
    assert_eq!(&served, want, "after failover");
    let new_leader = wait_for_leader(&survivors, Some(leader), Duration::from_secs(10));
    assert_ne!(new_leader, leader);

    // The killed peer restarts from its data dir and follows the new leader.
    cluster
        .start_coordinator_peer(leader as usize)
        .expect("restart");
    assert_eq!(
        wait_for_leader(&all, None, Duration::from_secs(20)),
        new_leader,
        "the restarted peer took over instead of following"
    );
    let got = greedy(all[leader as usize - 1], prompt, want.len()).expect("via the restarted peer");
    assert_eq!(&got, want);
}
