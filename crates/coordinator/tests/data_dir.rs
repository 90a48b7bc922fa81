//! A coordinator peer whose data dir holds another configuration than the topology's
//! peers refuses to start (`--check`, which `tessera up` runs first, and a plain start
//! alike). Before, `tessera up` then `tessera up --coordinators 3` in one directory left
//! peer 1 leading its old one-peer cluster beside the new peers' own: two leaders, and no
//! message.

use std::path::Path;
use std::process::Command;

use tessera_coordinator::replication::peer::Peer;
use tessera_coordinator::replication::{LogStore, log};
use tessera_topology::PeerId;

mod support;
use support::peers::{free_udp, topology_text};

/// Leaves in `dir` the log of a peer that bootstrapped `voters`.
fn bootstrap(dir: &Path, id: u64, voters: &[u64]) {
    std::fs::create_dir_all(dir).expect("data dir");
    let store = LogStore::open(&dir.join("raft.redb")).expect("store");
    let voters: Vec<PeerId> = voters.iter().map(|&v| PeerId(v)).collect();
    Peer::start(PeerId(id), &voters, store, 1, &log::discard()).expect("peer");
}

/// `tessera-coordinator --topology T --peer ID --certs C EXTRA…`: success and stderr.
fn coordinator(topology: &Path, id: u64, extra: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tessera-coordinator"))
        .arg("--topology")
        .arg(topology)
        .args(["--peer", &id.to_string(), "--certs", "/nonexistent"])
        .args(extra)
        .output()
        .expect("runs");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out.status.success(), stderr)
}

#[test]
fn a_data_dir_of_another_configuration_is_refused_naming_both_lists() {
    let dir = tempfile::tempdir().expect("temp dir");
    let quic: Vec<_> = (0..3).map(|_| free_udp()).collect();
    let model = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../fixtures/models/llama-gqa/f32"
    );
    let topology = dir.path().join("topology.toml");
    std::fs::write(&topology, topology_text(&quic, model)).expect("topology");
    // Peer 1 ran alone before; peer 2 with the topology's three peers.
    bootstrap(&dir.path().join("c1"), 1, &[1]);
    bootstrap(&dir.path().join("c2"), 2, &[1, 2, 3]);

    let (ok, stderr) = coordinator(&topology, 1, &["--check"]);
    assert!(!ok, "{stderr}");
    for part in [
        "peers [1]",
        "lists peers [1, 2, 3]",
        "tessera cluster add",
        "fresh data dir",
    ] {
        assert!(stderr.contains(part), "{part}: {stderr}");
    }
    assert!(!stderr.contains("panicked"), "{stderr}");
    // The same refusal on a plain start, before it opens any port (the certificates are
    // never read: their directory does not exist).
    let (ok, plain) = coordinator(&topology, 1, &[]);
    assert!(!ok && plain.contains("lists peers [1, 2, 3]"), "{plain}");

    let (ok, stderr) = coordinator(&topology, 2, &["--check"]);
    assert!(ok, "{stderr}");
    // A peer with no data dir yet has nothing to disagree with, and --check creates none.
    let (ok, stderr) = coordinator(&topology, 3, &["--check"]);
    assert!(ok, "{stderr}");
    assert!(!dir.path().join("c3").exists());
}
