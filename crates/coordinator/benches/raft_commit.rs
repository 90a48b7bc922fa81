//! Raft commit latency of one journal entry (`Accept` of a 256-token prompt), proposed on
//! the leader and awaited until applied there: 1 peer (an fsync), and 3 peers on this
//! host over QUIC with mutual TLS (a round trip to a follower, whose fsync the leader
//! waits for, plus the leader's own). Each peer's log is a redb file in a temporary
//! directory, as `tessera-coordinator` keeps it. Prints p50, p99 and max.
//!
//! `cargo bench -p tessera-coordinator --bench raft_commit` (`TESSERA_BENCH_ENTRIES`
//! sets how many entries are timed; 500 by default).

// The report is this benchmark's output.
#![allow(clippy::print_stdout)]

use std::net::{SocketAddr, UdpSocket};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use tessera_comm::certs::{Credentials, Identity};
use tessera_comm::proto::Sampling;
use tessera_comm::quic;
use tessera_coordinator::engine::GenerateRequest;
use tessera_coordinator::replication::node::NodeHandle;
use tessera_coordinator::replication::peer::Peer;
use tessera_coordinator::replication::state::Command;
use tessera_coordinator::replication::transport::{self, Addresses, serve_inbound};
use tessera_coordinator::replication::{LogStore, log};
use tessera_topology::{PeerId, Topology};

fn free_udp() -> SocketAddr {
    UdpSocket::bind("127.0.0.1:0")
        .and_then(|s| s.local_addr())
        .expect("a free port")
}

fn topology_text(quic: &[SocketAddr], model: &str) -> String {
    let mut t = String::new();
    for (i, addr) in quic.iter().enumerate() {
        let id = i + 1;
        let http = free_udp();
        t += &format!(
            "[[coordinator]]\nid = {id}\nhost = \"local\"\nquic = \"{addr}\"\nhttp = \"{http}\"\ndata_dir = \"c{id}\"\n\n"
        );
    }
    t += &format!(
        "[[host]]\nname = \"local\"\naddress = \"127.0.0.1\"\n\n[[model]]\nname = \"m\"\npath = \"{model}\"\n\n\
         [[group]]\nname = \"g\"\nmodel = \"m\"\ntp = 1\n\n[[group.shard]]\nrank = 0\nhost = \"local\"\ndevice = \"cpu\"\nthreads = 1\nport = 1\nkv_memory = \"1MiB\"\n"
    );
    t
}

async fn start_peers(n: usize, dir: &std::path::Path) -> Vec<NodeHandle> {
    let quic_addrs: Vec<SocketAddr> = (0..n).map(|_| free_udp()).collect();
    let model = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../fixtures/models/llama-gqa/f32"
    );
    let path = dir.join("topology.toml");
    let text = topology_text(&quic_addrs, model);
    std::fs::write(&path, &text).expect("topology");
    let topology = Topology::parse(&text, &path).expect("valid topology");
    let certs = dir.join("certs");
    tessera_comm::certs::init_cluster(&topology, &certs).expect("certificates");
    let voters: Vec<PeerId> = (1..=n as u64).map(PeerId).collect();
    let addresses: Addresses = Arc::new(RwLock::new(
        quic_addrs
            .iter()
            .enumerate()
            .map(|(i, a)| (PeerId(i as u64 + 1), a.to_string()))
            .collect(),
    ));
    let mut nodes = Vec::new();
    for (i, addr) in quic_addrs.iter().enumerate() {
        let id = i as u64 + 1;
        let creds = Credentials::load(&certs, &Identity::Coordinator(PeerId(id))).expect("creds");
        let endpoint = quic::server_endpoint(*addr, &creds).expect("endpoint");
        let store = LogStore::open(&dir.join(format!("raft-{id}.redb"))).expect("store");
        let peer = Peer::start(PeerId(id), &voters, store, id, &log::discard()).expect("peer");
        let handle =
            transport::start(peer, endpoint.clone(), Arc::clone(&addresses)).expect("thread");
        let inbound = handle.clone();
        tokio::spawn(async move {
            while let Some(incoming) = endpoint.accept().await {
                let node = inbound.clone();
                tokio::spawn(async move {
                    let Ok(connection) = incoming.await else {
                        return;
                    };
                    if let Ok(Identity::Coordinator(from)) = quic::peer_identity(&connection) {
                        serve_inbound(connection, from, node).await;
                    }
                });
            }
        });
        nodes.push(handle);
    }
    nodes
}

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

async fn measure(peers: usize, entries: usize) {
    let dir = tempfile::tempdir().expect("temp dir");
    let nodes = start_peers(peers, dir.path()).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    let leader = loop {
        if let Some(l) = nodes.iter().find(|n| n.role().borrow().is_leader()) {
            break l.clone();
        }
        assert!(Instant::now() < deadline, "no leader");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // Warm up the connections.
    for i in 0..20 {
        leader
            .propose(accept(i), Duration::from_secs(5))
            .await
            .expect("committed");
    }
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
        "raft commit, {peers} peer(s), {entries} journal entries: p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms",
        percentile(&times, 0.5).as_secs_f64() * 1e3,
        percentile(&times, 0.99).as_secs_f64() * 1e3,
        times.last().map_or(0.0, |t| t.as_secs_f64() * 1e3),
    );
    for node in nodes {
        tokio::task::spawn_blocking(move || node.stop())
            .await
            .expect("stopped");
    }
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
    runtime.block_on(async {
        measure(1, entries).await;
        measure(3, entries).await;
    });
}
