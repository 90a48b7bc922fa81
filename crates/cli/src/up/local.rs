//! Which processes of a topology run on this machine, and their command lines.
//!
//! A host of the topology is this machine when `--host NAME` names it, or, without
//! `--host`, when it is named `local`, or its address is a loopback address, an address of
//! one of this machine's interfaces (one a socket can be bound to), this machine's hostname,
//! or a DNS name that resolves to one of those.

use std::ffi::OsString;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs, UdpSocket};
use std::path::{Path, PathBuf};

use anyhow::bail;
use tessera_comm::certs::Identity;
use tessera_topology::{Host, Topology};

/// One process to start and supervise.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChildSpec {
    /// `coordinator-<id>` or `<group>/<rank>`: the prefix of its log lines.
    pub name: String,
    pub identity: Identity,
    pub program: PathBuf,
    pub args: Vec<OsString>,
}

impl ChildSpec {
    /// Its log file's name: the certificate file stem, which has no `/`.
    pub fn log_name(&self) -> String {
        format!("{}.log", self.identity.file_stem())
    }

    /// The command line, for messages.
    pub fn command_line(&self) -> String {
        let mut line = self.program.display().to_string();
        for arg in &self.args {
            line.push(' ');
            line.push_str(&arg.to_string_lossy());
        }
        line
    }
}

/// Where the children's command lines point.
#[derive(Clone, Debug)]
pub struct Paths<'a> {
    /// The topology file, as the children should open it.
    pub topology: &'a Path,
    pub certs: &'a Path,
    /// Where `tessera-shard` and `tessera-coordinator` are.
    pub bin_dir: &'a Path,
}

/// The names of the hosts that are this machine.
pub fn local_hosts(topology: &Topology, explicit: Option<&str>) -> anyhow::Result<Vec<String>> {
    if let Some(name) = explicit {
        if topology.host(name).is_none() {
            let known: Vec<&str> = topology.hosts.iter().map(|h| h.name.as_str()).collect();
            bail!(
                "--host {name}: the topology has no such host (its hosts: {})",
                known.join(", ")
            );
        }
        return Ok(vec![name.to_owned()]);
    }
    let hostname = nix::unistd::gethostname()
        .ok()
        .map(|h| h.to_string_lossy().into_owned());
    Ok(topology
        .hosts
        .iter()
        .filter(|h| is_this_machine(h, hostname.as_deref()))
        .map(|h| h.name.clone())
        .collect())
}

fn is_this_machine(host: &Host, hostname: Option<&str>) -> bool {
    if host.name == "local" {
        return true;
    }
    if let Ok(ip) = host.address.parse::<IpAddr>() {
        return is_local_ip(ip);
    }
    if host.address.eq_ignore_ascii_case("localhost")
        || hostname.is_some_and(|h| h.eq_ignore_ascii_case(&host.address))
    {
        return true;
    }
    (host.address.as_str(), 0)
        .to_socket_addrs()
        .is_ok_and(|mut addrs| addrs.any(|a| is_local_ip(a.ip())))
}

/// Loopback, or an address a socket can be bound to (so one of this machine's).
fn is_local_ip(ip: IpAddr) -> bool {
    ip.is_loopback() || UdpSocket::bind(SocketAddr::new(ip, 0)).is_ok()
}

/// The processes of `hosts`: coordinators first, then every shard by group and rank.
/// `http` replaces the HTTP address of the (only) local coordinator.
pub fn children(
    topology: &Topology,
    hosts: &[String],
    paths: &Paths<'_>,
    http: Option<SocketAddr>,
) -> Vec<ChildSpec> {
    let here = |host: &str| hosts.iter().any(|h| h == host);
    let mut children = Vec::new();
    for peer in topology.coordinators.iter().filter(|c| here(&c.host)) {
        let mut args: Vec<OsString> = vec![
            "--topology".into(),
            paths.topology.into(),
            "--peer".into(),
            peer.id.to_string().into(),
            "--certs".into(),
            paths.certs.into(),
        ];
        if let Some(http) = http {
            args.extend(["--http".into(), http.to_string().into()]);
        }
        children.push(ChildSpec {
            name: format!("coordinator-{}", peer.id),
            identity: Identity::Coordinator(peer.id),
            program: paths.bin_dir.join("tessera-coordinator"),
            args,
        });
    }
    for group in &topology.groups {
        for shard in group.shards.iter().filter(|s| here(&s.host)) {
            children.push(ChildSpec {
                name: format!("{}/{}", group.name, shard.rank),
                identity: Identity::Shard {
                    group: group.name.clone(),
                    rank: shard.rank,
                },
                program: paths.bin_dir.join("tessera-shard"),
                args: vec![
                    "--topology".into(),
                    paths.topology.into(),
                    "--group".into(),
                    group.name.clone().into(),
                    "--rank".into(),
                    shard.rank.to_string().into(),
                    "--certs".into(),
                    paths.certs.into(),
                ],
            });
        }
    }
    children
}

#[cfg(test)]
mod tests {
    use super::*;

    const TWO_HOSTS: &str = r#"
[[coordinator]]
id = 1
host = "a"
quic = "127.0.0.1:7000"
http = "127.0.0.1:8000"

[[host]]
name = "a"
address = "127.0.0.1"

[[host]]
name = "b"
address = "192.0.2.7"

[[model]]
name = "m"
path = "m.gguf"

[[group]]
name = "g"
model = "m"
tp = 2

[[group.shard]]
rank = 0
host = "a"
device = "cpu"
port = 7101
kv_memory = "16MiB"

[[group.shard]]
rank = 1
host = "b"
device = "cpu"
port = 7101
kv_memory = "16MiB"
"#;

    fn topology() -> Topology {
        Topology::parse(TWO_HOSTS, Path::new("/t/topology.toml")).expect("valid")
    }

    fn paths() -> Paths<'static> {
        Paths {
            topology: Path::new("/t/topology.toml"),
            certs: Path::new("/t/certs"),
            bin_dir: Path::new("/bin"),
        }
    }

    #[test]
    fn loopback_hosts_are_this_machine_and_documentation_addresses_are_not() {
        // 192.0.2.0/24 is reserved for documentation (RFC 5737): never an interface here.
        assert_eq!(local_hosts(&topology(), None).expect("hosts"), ["a"]);
    }

    #[test]
    fn host_picks_one_and_must_exist() {
        assert_eq!(local_hosts(&topology(), Some("b")).expect("b"), ["b"]);
        let error = local_hosts(&topology(), Some("c")).expect_err("no host c");
        assert!(error.to_string().contains("its hosts: a, b"), "{error}");
    }

    #[test]
    fn children_of_a_host_with_their_command_lines() {
        let t = topology();
        let http: SocketAddr = "127.0.0.1:9000".parse().expect("addr");
        let here = children(&t, &["a".to_owned()], &paths(), Some(http));
        let names: Vec<&str> = here.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["coordinator-1", "g/0"]);
        assert_eq!(
            here[0].command_line(),
            "/bin/tessera-coordinator --topology /t/topology.toml --peer 1 --certs /t/certs --http 127.0.0.1:9000"
        );
        assert_eq!(
            here[1].command_line(),
            "/bin/tessera-shard --topology /t/topology.toml --group g --rank 0 --certs /t/certs"
        );
        assert_eq!(here[1].log_name(), "shard-g-0.log");
        let there = children(&t, &["b".to_owned()], &paths(), None);
        let names: Vec<&str> = there.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["g/1"]);
    }
}
