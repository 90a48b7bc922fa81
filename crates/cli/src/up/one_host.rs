//! The topology `tessera up` writes when it is given no topology file: one host, one
//! coordinator peer (or 3 or 5, a Raft group, with `--coordinators`) and one group of CPU
//! shards for one model — the SmolLM2 demo, or `--model PATH --tp N`.

use std::fmt::Write as _;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, UdpSocket};
use std::path::Path;

use anyhow::Context;

/// The demo model, relative to the working directory (`scripts/get-demo-model.sh` puts it
/// there).
pub const DEMO_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
/// The demo's served model name and tensor-parallel degree (SmolLM2-135M has 9 heads and 3
/// KV heads: each of 3 ranks holds 3 heads and 1 KV head).
pub const DEMO_NAME: &str = "smollm2";
pub const DEMO_TP: usize = 3;
pub const DEMO_GROUP: &str = "smollm2-cpu";

/// The group's name for `--model`.
pub fn group_name(tp: usize) -> String {
    format!("cpu-tp{tp}")
}

/// The coordinator's HTTP API when neither the topology nor `--http` says otherwise.
pub const DEFAULT_HTTP: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(Ipv4Addr::LOCALHOST), 8000);
/// Preferred ports: the coordinator's QUIC port, and the first shard's (the next ranks
/// count up). Taken ones are replaced by free ports the system picks.
const QUIC_PORT: u16 = 7000;
const FIRST_SHARD_PORT: u16 = 7101;

/// What the generated file holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OneHost {
    /// The name clients ask for.
    pub model_name: String,
    /// Absolute path of the model file or directory.
    pub model_path: String,
    /// The group's name (short: certificates carry it in a DNS label).
    pub group: String,
    pub tp: usize,
    pub precision: tessera_topology::Precision,
    /// CPU threads of each shard.
    pub threads: usize,
    pub kv_memory: String,
    pub quic_port: u16,
    pub http: SocketAddr,
    /// Coordinator peers after the first: their QUIC port and HTTP address each.
    pub more_coordinators: Vec<(u16, SocketAddr)>,
    /// One per rank.
    pub shard_ports: Vec<u16>,
    /// The command line that made it, for the file's header.
    pub made_by: String,
}

impl OneHost {
    /// The topology file's text. Relative paths in it (the coordinator's data directory)
    /// resolve against the file's directory, the run directory.
    pub fn text(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "# Written by `{}`.", self.made_by);
        let _ = writeln!(
            s,
            "# Every run rewrites it: to change it, copy it and pass the copy with --topology."
        );
        let peers =
            std::iter::once((self.quic_port, self.http)).chain(self.more_coordinators.clone());
        for (id, (quic, http)) in (1..).zip(peers) {
            let _ = writeln!(
                s,
                "\n[[coordinator]]\nid = {id}\nhost = \"local\"\nquic = \"127.0.0.1:{quic}\"\nhttp = {}\ndata_dir = \"coordinator-{id}\"",
                toml_string(&http.to_string()),
            );
        }
        let _ = writeln!(s, "\n[[host]]\nname = \"local\"\naddress = \"127.0.0.1\"");
        let _ = writeln!(
            s,
            "\n[[model]]\nname = {}\npath = {}\ndtype = \"auto\"",
            toml_string(&self.model_name),
            toml_string(&self.model_path),
        );
        let _ = writeln!(
            s,
            "\n[[group]]\nname = \"{}\"\nmodel = {}\ntp = {}\ncollective = \"shm\"\nprecision = \"{}\"",
            self.group,
            toml_string(&self.model_name),
            self.tp,
            self.precision,
        );
        for (rank, port) in self.shard_ports.iter().enumerate() {
            let _ = writeln!(
                s,
                "\n[[group.shard]]\nrank = {rank}\nhost = \"local\"\ndevice = \"cpu\"\nthreads = {}\nport = {port}\nkv_memory = {}",
                self.threads,
                toml_string(&self.kv_memory),
            );
        }
        s
    }
}

/// A TOML basic string. JSON's string escapes are a subset of TOML's.
fn toml_string(value: &str) -> String {
    serde_json::Value::from(value).to_string()
}

/// CPU threads per shard: the cores shared out evenly, at least one.
pub fn threads_per_shard(cores: usize, tp: usize) -> usize {
    (cores / tp.max(1)).max(1)
}

/// The name clients ask for, from the model's path: a GGUF file's stem or the directory's
/// name, with characters a topology name cannot hold (whitespace, quotes, controls) as `_`.
pub fn model_name_of(path: &Path) -> String {
    let is_gguf = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
    let name = if is_gguf {
        path.file_stem()
    } else {
        path.file_name()
    };
    let name = name
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let name: String = name
        .chars()
        .map(|c| {
            if c.is_whitespace() || c.is_control() || matches!(c, '"' | '\'') {
                '_'
            } else {
                c
            }
        })
        .take(128)
        .collect();
    if name.is_empty() {
        "model".to_owned()
    } else {
        name
    }
}

/// QUIC ports and HTTP addresses of `n` more coordinator peers next to the first (whose
/// HTTP address is `first_http`): the HTTP ports after the first's where they are free,
/// otherwise ports the system hands out.
pub fn more_coordinators(
    first_http: SocketAddr,
    n: usize,
) -> anyhow::Result<Vec<(u16, SocketAddr)>> {
    let mut held = Vec::new();
    let mut peers = Vec::with_capacity(n);
    for i in 1..=n {
        let quic = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).context("finding a free UDP port")?;
        let preferred = SocketAddr::new(
            first_http.ip(),
            first_http.port().checked_add(i as u16).unwrap_or(0),
        );
        let http = match TcpListener::bind(preferred) {
            Ok(l) if preferred.port() != 0 => l,
            _ => TcpListener::bind(SocketAddr::new(first_http.ip(), 0))
                .context("finding a free TCP port")?,
        };
        peers.push((quic.local_addr()?.port(), http.local_addr()?));
        held.push((quic, http));
    }
    Ok(peers)
}

/// The QUIC port and one port per rank: the preferred ones where they are free on
/// 127.0.0.1, otherwise ports the system hands out.
pub fn pick_ports(tp: usize) -> anyhow::Result<(u16, Vec<u16>)> {
    let quic = if UdpSocket::bind((Ipv4Addr::LOCALHOST, QUIC_PORT)).is_ok() {
        QUIC_PORT
    } else {
        let socket =
            UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).context("finding a free UDP port")?;
        socket.local_addr()?.port()
    };
    // Hold every listener until all ports are chosen, so no port is handed out twice.
    let mut held = Vec::with_capacity(tp);
    let mut ports = Vec::with_capacity(tp);
    for rank in 0..tp {
        let preferred = u16::try_from(usize::from(FIRST_SHARD_PORT) + rank).unwrap_or(0);
        let listener = match TcpListener::bind((Ipv4Addr::LOCALHOST, preferred)) {
            Ok(l) if preferred != 0 => l,
            _ => TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).context("finding a free TCP port")?,
        };
        ports.push(listener.local_addr()?.port());
        held.push(listener);
    }
    Ok((quic, ports))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn demo() -> OneHost {
        OneHost {
            model_name: "smollm2".into(),
            model_path: "/m/Smol \"LM\".gguf".into(),
            group: group_name(3),
            tp: 3,
            precision: tessera_topology::Precision::Fast,
            threads: 1,
            kv_memory: "256MiB".into(),
            quic_port: 7000,
            http: DEFAULT_HTTP,
            more_coordinators: Vec::new(),
            shard_ports: vec![7101, 7102, 7103],
            made_by: "tessera up".into(),
        }
    }

    #[test]
    fn the_text_is_a_valid_topology() {
        let one = demo();
        let text = one.text();
        let topology = tessera_topology::Topology::parse(&text, Path::new("/run/topology.toml"))
            .unwrap_or_else(|issues| panic!("{issues:?}\n{text}"));
        assert_eq!(topology.models[0].path, Path::new("/m/Smol \"LM\".gguf"));
        assert_eq!(
            topology.coordinators[0].data_dir,
            Path::new("/run/coordinator-1")
        );
        assert_eq!(topology.coordinators[0].http.to_string(), "127.0.0.1:8000");
        let group = &topology.groups[0];
        assert_eq!(group.name, "cpu-tp3");
        assert_eq!(group.tp, 3);
        assert_eq!(group.collective, tessera_topology::Collective::Shm);
        let ports: Vec<u16> = group.shards.iter().map(|s| s.port).collect();
        assert_eq!(ports, [7101, 7102, 7103]);
    }

    #[test]
    fn three_coordinators_make_a_raft_group_of_three_peers() {
        let mut three = demo();
        three.more_coordinators = more_coordinators(DEFAULT_HTTP, 2).expect("ports");
        let text = three.text();
        let topology = tessera_topology::Topology::parse(&text, Path::new("/run/topology.toml"))
            .unwrap_or_else(|issues| panic!("{issues:?}\n{text}"));
        let ids: Vec<u64> = topology.coordinators.iter().map(|c| c.id.0).collect();
        assert_eq!(ids, [1, 2, 3]);
        assert_eq!(
            topology.coordinators[2].data_dir,
            Path::new("/run/coordinator-3")
        );
        let https: std::collections::BTreeSet<String> = topology
            .coordinators
            .iter()
            .map(|c| c.http.to_string())
            .collect();
        assert_eq!(https.len(), 3, "{text}");
    }

    #[test]
    fn threads_share_the_cores() {
        assert_eq!(threads_per_shard(16, 3), 5);
        assert_eq!(threads_per_shard(2, 3), 1);
        assert_eq!(threads_per_shard(8, 1), 8);
    }

    #[test]
    fn model_names_come_from_the_path() {
        assert_eq!(
            model_name_of(Path::new("models/SmolLM2-135M-Instruct.Q4_1.gguf")),
            "SmolLM2-135M-Instruct.Q4_1"
        );
        assert_eq!(model_name_of(Path::new("/w/llama 3/")), "llama_3");
        assert_eq!(model_name_of(Path::new("/")), "model");
    }

    #[test]
    fn picked_ports_are_distinct() {
        let (_, ports) = pick_ports(4).expect("ports");
        let mut unique = ports.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), 4, "{ports:?}");
    }
}
