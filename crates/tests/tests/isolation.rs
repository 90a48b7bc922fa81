//! The leader of three coordinator peers cut off with network namespaces: each peer in a
//! namespace of its own on a bridge, the shard and the test in the root namespace. The
//! cut leader stops leading within 2 s (check-quorum) and releases the shards; the other
//! two elect a leader that serves; after the link heals the old leader follows, with no
//! further leader change (pre-vote).
//!
//! Needs root (CI runs as root): elsewhere it prints SKIPPED.

use std::time::{Duration, Instant};

use serde_json::json;
use tessera_tests::netns::{self, Net};
use tessera_tests::{
    Cluster, GroupSpec, fixture, free_port, get, peers_topology_text, post, token_ids,
};

/// Peer `url`'s own view: the leader it knows and the term.
fn leader_of(url: &str) -> Option<(u64, u64)> {
    let (status, view) = get(&format!("{url}/v1/cluster?local=true")).ok()?;
    if status != 200 {
        return None;
    }
    let peers = view["peers"].as_array()?;
    let leader = peers.iter().find(|p| p["role"] == "leader")?;
    Some((leader["id"].as_u64()?, leader["term"].as_u64()?))
}

fn greedy(url: &str) -> anyhow::Result<Vec<u32>> {
    let body = json!({
        "model": "m", "prompt": [2, 7, 1], "max_tokens": 6,
        "temperature": 0, "ignore_eos": true, "return_token_ids": true,
    });
    let (status, answer) = post(&format!("{url}/v1/completions"), &body)?;
    anyhow::ensure!(status == 200, "status {status}: {answer}");
    token_ids(&answer)
}

fn eventually<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "{what} within {timeout:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn an_isolated_leader_steps_down_and_the_majority_serves() {
    let hosts = ["a", "b", "c"];
    let Some(net) = Net::create_or_skip(&hosts, 7) else {
        return;
    };
    let peers: Vec<(&str, String, String)> = hosts
        .iter()
        .map(|h| {
            (
                *h,
                format!("{}:{}", net.addr(h), free_port()),
                format!("{}:{}", net.addr(h), free_port()),
            )
        })
        .collect();
    let bridge = net.bridge_addr();
    let mut addresses: Vec<(&str, &str)> = hosts
        .iter()
        .zip(&peers)
        .map(|(h, p)| (*h, p.1.split(':').next().unwrap_or_default()))
        .collect();
    addresses.push(("local", bridge.as_str()));
    let group = GroupSpec::local("g", "m", &fixture("llama-gqa/f32"), 1);
    let text = peers_topology_text(&peers, &addresses, &[group]);
    let mut cluster = Cluster::prepare(&text, &peers[0].2).expect("topology and certificates");
    let namespaces: Vec<(String, String)> = (1..=3)
        .map(|i| (format!("coordinator-{i}"), net.ns(hosts[i - 1])))
        .collect();
    cluster.wrap = netns::wrap(namespaces);
    for id in 1..=3 {
        cluster.start_coordinator_peer(id).expect("peer starts");
    }
    cluster.start_shard("g", 0).expect("shard starts");
    let urls: Vec<String> = peers.iter().map(|p| format!("http://{}", p.2)).collect();

    let (leader, term) = eventually(
        "a leader every peer agrees on",
        Duration::from_secs(30),
        || {
            let seen: Vec<_> = urls.iter().map(|u| leader_of(u)).collect();
            seen[0].filter(|l| seen.iter().all(|s| s == &Some(*l)))
        },
    );
    let want = eventually("a first answer", Duration::from_secs(30), || {
        greedy(&urls[0]).ok()
    });

    // Cut the leader off.
    let host = hosts[leader as usize - 1];
    net.cut(host).expect("cut");
    let cut = Instant::now();
    let survivors: Vec<&String> = (1..=3u64)
        .filter(|&id| id != leader)
        .map(|id| &urls[id as usize - 1])
        .collect();
    // The cut leader noticed it has no quorum, and stopped driving the shards.
    let log = &cluster.proc(&format!("coordinator-{leader}")).log.clone();
    let stepped_down = eventually(
        "the cut leader stepping down",
        Duration::from_secs(5),
        || {
            std::fs::read_to_string(log)
                .ok()
                .filter(|l| l.contains("no longer leading"))
                .map(|_| cut.elapsed())
        },
    );
    eprintln!("the cut leader stepped down after at most {stepped_down:?}");
    assert!(stepped_down < Duration::from_secs(3), "{stepped_down:?}");
    let (new_leader, new_term) = eventually(
        "a new leader among the others",
        Duration::from_secs(10),
        || {
            leader_of(survivors[0]).filter(|&(l, t)| {
                l != leader && t > term && leader_of(survivors[1]) == Some((l, t))
            })
        },
    );
    eprintln!(
        "cut → new leader {new_leader} (term {new_term}) in {:?}",
        cut.elapsed()
    );
    let got = eventually(
        "an answer from the new leader",
        Duration::from_secs(20),
        || greedy(survivors[0]).ok(),
    );
    assert_eq!(got, want);

    // Heal: the old leader rejoins as a follower of the same leader and term.
    net.heal(host).expect("heal");
    let old = &urls[leader as usize - 1];
    eventually("the old leader following", Duration::from_secs(10), || {
        (leader_of(old) == Some((new_leader, new_term))).then_some(())
    });
    std::thread::sleep(Duration::from_secs(3));
    for url in &urls {
        assert_eq!(
            leader_of(url),
            Some((new_leader, new_term)),
            "a leader change after healing (pre-vote should prevent it)\n{}",
            cluster.logs()
        );
    }
    drop(cluster);
    drop(net);
}
