//! Membership changes of the coordinator's Raft group through `tessera cluster`, with the
//! real binaries: three peers serve; a fourth starts with `--join` and replaces a follower
//! (`tessera cluster replace`: added, then the old one removed and stopped); then the
//! leader is killed, and the one original peer left and the new one elect a leader that
//! serves — the new peer votes.

use std::process::Command;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use serde_json::{Value, json};
use tessera_tests::{
    Cluster, GroupSpec, TEST_ADMIN_KEY, TEST_API_KEY, bin, fixture, get, local_peer_addrs,
    peers_topology_text, post, token_ids,
};

/// `tessera cluster ARGS --url URL` with the test's admin key: its stdout, or the failure.
fn cluster_cmd(url: &str, args: &[&str]) -> String {
    let out = Command::new(bin("tessera"))
        .arg("cluster")
        .args(args)
        .args(["--url", url])
        .env("TESSERA_API_KEY", TEST_API_KEY)
        .env("TESSERA_ADMIN_KEY", TEST_ADMIN_KEY)
        .output()
        .expect("tessera runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "tessera cluster {args:?}: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Peer `url`'s own view: the voters it lists and the leader it knows.
fn view(url: &str) -> Option<(Vec<u64>, Option<u64>)> {
    let (status, view) = get(&format!("{url}/v1/cluster?local=true")).ok()?;
    if status != 200 {
        return None;
    }
    let peers = view["peers"].as_array()?;
    let ids = peers.iter().filter_map(|p| p["id"].as_u64()).collect();
    let leader = peers
        .iter()
        .find(|p| p["role"] == "leader")
        .and_then(|p| p["id"].as_u64());
    Some((ids, leader))
}

fn wait_until(
    what: &str,
    timeout: Duration,
    mut ok: impl FnMut() -> bool,
    logs: impl Fn() -> String,
) {
    let deadline = Instant::now() + timeout;
    while !ok() {
        assert!(
            Instant::now() < deadline,
            "{what} within {timeout:?}\n{}",
            logs()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn greedy(url: &str) -> anyhow::Result<Vec<u32>> {
    let body = json!({
        "model": "m", "prompt": [1, 5, 9], "max_tokens": 6,
        "temperature": 0, "ignore_eos": true, "return_token_ids": true,
    });
    let (status, answer): (u16, Value) = post(&format!("{url}/v1/completions"), &body)?;
    anyhow::ensure!(status == 200, "status {status}: {answer}");
    token_ids(&answer)
}

#[test]
fn a_peer_added_with_tessera_cluster_votes_and_a_removed_one_is_gone() {
    let addrs = local_peer_addrs(5);
    let group = GroupSpec::local("g", "m", &fixture("llama-gqa/f32"), 1);
    let hosts = [("local", "127.0.0.1")];
    // The first three peers start from a topology of three; the fourth (and the shard)
    // read the topology of five.
    let five = peers_topology_text(&addrs, &hosts, std::slice::from_ref(&group));
    let mut cluster = Cluster::prepare(&five, &addrs[0].2).expect("prepared");
    let five_path = cluster.topology.clone();
    let three_path = cluster.dir.path().join("three.toml");
    std::fs::write(
        &three_path,
        peers_topology_text(&addrs[..3], &hosts, std::slice::from_ref(&group)),
    )
    .expect("topology of three");
    cluster.topology = three_path;
    for id in 1..=3 {
        cluster.start_coordinator_peer(id).expect("peer starts");
    }
    // The shard knows every peer it may have to follow, the fourth included.
    cluster.topology = five_path.clone();
    cluster.start_shard("g", 0).expect("shard starts");
    let urls: Vec<String> = addrs.iter().map(|a| format!("http://{}", a.2)).collect();
    let want = {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match greedy(&urls[0]) {
                Ok(tokens) => break tokens,
                Err(e) => {
                    assert!(Instant::now() < deadline, "{e:#}\n{}", cluster.logs());
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
    };

    // Peer 4 joins: its certificate issued now from the cluster CA (the one made at the
    // start is thrown away), started with --join, then added.
    for ext in ["pem", "key"] {
        std::fs::remove_file(cluster.certs.join(format!("coordinator-4.{ext}"))).expect("rm");
    }
    let issued = Command::new(bin("tessera"))
        .args(["certs", "issue", "--coordinator", "4", "--dir"])
        .arg(&cluster.certs)
        .output()
        .expect("tessera certs issue runs");
    assert!(issued.status.success(), "{issued:?}");
    let args: Vec<String> = [
        "--topology",
        five_path.to_str().expect("utf-8"),
        "--certs",
        cluster.certs.to_str().expect("utf-8"),
        "--peer",
        "4",
        "--api-key",
        TEST_API_KEY,
        "--join",
    ]
    .map(String::from)
    .to_vec();
    cluster
        .spawn("coordinator-4", &bin("tessera-coordinator"), &args, &[])
        .expect("peer 4 starts");
    let (_, leader) = view(&urls[0]).expect("a view");
    let leader = leader.expect("a leader");
    let removed = (1..=3).find(|&id| id != leader).expect("a follower");
    let listed = cluster_cmd(
        &urls[1],
        &[
            "replace",
            "--old",
            &removed.to_string(),
            "--id",
            "4",
            "--http",
            &addrs[3].2,
            "--quic",
            &addrs[3].1,
        ],
    );
    let ids: Vec<&str> = listed
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    let mut expected: Vec<String> = [1, 2, 3, 4]
        .iter()
        .filter(|&&id| id != removed)
        .map(u64::to_string)
        .collect();
    expected.sort();
    assert_eq!(ids, expected, "{listed}");
    cluster.signal(&format!("coordinator-{removed}"), Signal::SIGKILL);
    wait_until(
        "peer 4 sees the new configuration and a leader",
        Duration::from_secs(20),
        || {
            view(&urls[3]).is_some_and(|(ids, leader)| {
                ids.len() == 3 && ids.contains(&4) && !ids.contains(&removed) && leader.is_some()
            })
        },
        || format!("peer 4's view: {:?}\n{}", view(&urls[3]), cluster.logs()),
    );
    assert_eq!(greedy(&urls[3]).expect("via peer 4"), want);

    // Kill the leader: of the three voters left, two remain — peer 4 among them — and
    // they elect a leader that serves.
    cluster.signal(&format!("coordinator-{leader}"), Signal::SIGKILL);
    let survivor = (1..=3)
        .find(|&id| id != leader && id != removed)
        .expect("a survivor");
    wait_until(
        "a new leader among the survivors",
        Duration::from_secs(20),
        || view(&urls[3]).is_some_and(|(_, l)| l.is_some_and(|l| l == 4 || l == survivor)),
        || cluster.logs(),
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    let got = loop {
        match greedy(&urls[survivor as usize - 1]) {
            Ok(tokens) => break tokens,
            Err(e) => {
                assert!(Instant::now() < deadline, "{e:#}\n{}", cluster.logs());
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    };
    assert_eq!(got, want);
}
