//! Coordinator peers in this process, each with its own redb log in a temporary
//! directory and its own QUIC endpoint with mutual TLS, as `tessera-coordinator` runs
//! them: for the Raft benchmark and the journal's tests. A peer can be stopped and
//! started again from its log.

use std::net::{SocketAddr, UdpSocket};
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use tessera_comm::certs::{Credentials, Identity};
use tessera_comm::quic;
use tessera_coordinator::replication::node::NodeHandle;
use tessera_coordinator::replication::peer::Peer;
use tessera_coordinator::replication::transport::{self, Addresses, HttpStreams, serve_inbound};
use tessera_coordinator::replication::{LogStore, log};
use tessera_topology::{PeerId, Topology};

/// A free UDP port on loopback.
pub fn free_udp() -> SocketAddr {
    UdpSocket::bind("127.0.0.1:0")
        .and_then(|s| s.local_addr())
        .expect("a free port")
}

/// A topology of one coordinator per QUIC address (data dirs `c1`, `c2`, …) and one
/// group serving `model`.
pub fn topology_text(quic: &[SocketAddr], model: &str) -> String {
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

/// A running peer.
struct Running {
    node: NodeHandle,
    endpoint: quinn::Endpoint,
}

/// `n` peers, ids 1 to `n`, all voters.
pub struct Peers {
    dir: PathBuf,
    quic: Vec<SocketAddr>,
    addresses: Addresses,
    running: Vec<Option<Running>>,
    forwarded: HttpStreams,
}

impl Peers {
    /// Starts `n` peers with their logs and certificates in `dir`. They serve no API: a
    /// call forwarded to one is dropped.
    pub fn start(n: usize, dir: &Path) -> Peers {
        Peers::serving(n, dir, Arc::new(|_, _, _| {}))
    }

    /// Starts `n` peers as [`Peers::start`] does, each serving the calls forwarded to it
    /// with `forwarded`.
    pub fn serving(n: usize, dir: &Path, forwarded: HttpStreams) -> Peers {
        let quic: Vec<SocketAddr> = (0..n).map(|_| free_udp()).collect();
        let model = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../fixtures/models/llama-gqa/f32"
        );
        let path = dir.join("topology.toml");
        let text = topology_text(&quic, model);
        std::fs::write(&path, &text).expect("topology");
        let topology = Topology::parse(&text, &path).expect("valid topology");
        tessera_comm::certs::init_cluster(&topology, &dir.join("certs")).expect("certificates");
        let addresses: Addresses = Arc::new(RwLock::new(
            quic.iter()
                .enumerate()
                .map(|(i, a)| (PeerId(i as u64 + 1), a.to_string()))
                .collect(),
        ));
        let mut peers = Peers {
            dir: dir.to_path_buf(),
            quic,
            addresses,
            running: (0..n).map(|_| None).collect(),
            forwarded,
        };
        for id in 1..=n as u64 {
            peers.start_peer(id);
        }
        peers
    }

    /// Starts peer `id` from its log (a new one the first time). Must run inside a tokio
    /// runtime.
    pub fn start_peer(&mut self, id: u64) {
        let i = id as usize - 1;
        assert!(self.running[i].is_none(), "peer {id} runs already");
        let certs = self.dir.join("certs");
        let creds = Credentials::load(&certs, &Identity::Coordinator(PeerId(id))).expect("creds");
        // A stopped peer's socket is released once its last connection has gone.
        let deadline = Instant::now() + Duration::from_secs(10);
        let endpoint = loop {
            match quic::server_endpoint(self.quic[i], &creds) {
                Ok(endpoint) => break endpoint,
                Err(error) if Instant::now() >= deadline => panic!("peer {id}'s endpoint: {error}"),
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        let store = LogStore::open(&self.dir.join(format!("raft-{id}.redb"))).expect("store");
        let voters: Vec<PeerId> = (1..=self.quic.len() as u64).map(PeerId).collect();
        let incarnation = rand::random();
        let peer =
            Peer::start(PeerId(id), &voters, store, incarnation, &log::discard()).expect("peer");
        let node =
            transport::start(peer, endpoint.clone(), Arc::clone(&self.addresses)).expect("thread");
        let inbound = node.clone();
        let accepting = endpoint.clone();
        let forwarded = Arc::clone(&self.forwarded);
        tokio::spawn(async move {
            while let Some(incoming) = accepting.accept().await {
                let node = inbound.clone();
                let forwarded = Arc::clone(&forwarded);
                tokio::spawn(async move {
                    let Ok(connection) = incoming.await else {
                        return;
                    };
                    if let Ok(Identity::Coordinator(from)) = quic::peer_identity(&connection) {
                        serve_inbound(connection, from, node, forwarded).await;
                    }
                });
            }
        });
        self.running[i] = Some(Running { node, endpoint });
    }

    /// Stops peer `id` as a crash would (its log holds what it acknowledged) and closes
    /// its endpoint.
    pub async fn stop_peer(&mut self, id: u64) {
        let running = self.running[id as usize - 1].take().expect("running");
        running.endpoint.close(0u32.into(), b"stopped");
        let node = running.node;
        tokio::task::spawn_blocking(move || node.stop())
            .await
            .expect("stopped");
        let _ = tokio::time::timeout(Duration::from_secs(2), running.endpoint.wait_idle()).await;
    }

    /// Peer `id`'s handle.
    pub fn node(&self, id: u64) -> NodeHandle {
        let running = self.running[id as usize - 1].as_ref().expect("running");
        running.node.clone()
    }

    /// The ids of the running peers.
    pub fn running(&self) -> Vec<u64> {
        (1..=self.quic.len() as u64)
            .filter(|&id| self.running[id as usize - 1].is_some())
            .collect()
    }

    /// The leader's id, once a running peer leads (20 s at most).
    pub async fn leader(&self) -> u64 {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            for id in self.running() {
                if self.node(id).role().borrow().is_leader() {
                    return id;
                }
            }
            assert!(Instant::now() < deadline, "no leader within 20 s");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Peer `id`'s QUIC address.
    pub fn quic(&self, id: u64) -> SocketAddr {
        self.quic[id as usize - 1]
    }

    /// The directory of the cluster's certificates.
    pub fn certs(&self) -> PathBuf {
        self.dir.join("certs")
    }

    /// Stops every running peer.
    pub async fn stop_all(&mut self) {
        for id in self.running() {
            self.stop_peer(id).await;
        }
    }
}
