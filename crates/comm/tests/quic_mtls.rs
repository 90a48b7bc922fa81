//! The control plane end to end on loopback: certificates made by `init_cluster`, a
//! coordinator's server endpoint, shard clients, and the refusals mutual TLS must give.

use std::net::{Ipv4Addr, SocketAddr};
use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::time::{Duration, Instant};

use tessera_comm::CommError;
use tessera_comm::certs::{Credentials, Identity, init_cluster};
use tessera_comm::proto::{CoordinatorMsg, PROTOCOL_VERSION, Register, ShardMsg};
use tessera_comm::quic::{
    MAX_IDLE_TIMEOUT, client_endpoint, connect, expect_coordinator, expect_shard, peer_identity,
    server_endpoint,
};
use tessera_comm::wire::{MAX_FRAME_BYTES, read_frame, write_frame};
use tessera_topology::{PeerId, Rank, Topology};
use tokio::net::UdpSocket;
use tokio::time::timeout;

/// Long enough for any loopback handshake; bounds every await so no test can hang.
const STEP: Duration = Duration::from_secs(10);

const TOPOLOGY: &str = r#"
[[coordinator]]
id = 1
host = "local"
quic = "127.0.0.1:7000"
http = "127.0.0.1:8000"
data_dir = "run/c1"

[[coordinator]]
id = 2
host = "local"
quic = "127.0.0.1:7001"
http = "127.0.0.1:8001"
data_dir = "run/c2"

[[coordinator]]
id = 3
host = "local"
quic = "127.0.0.1:7002"
http = "127.0.0.1:8002"
data_dir = "run/c3"

[[host]]
name = "local"
address = "127.0.0.1"

[[model]]
name = "tiny"
path = "models/tiny"

[[group]]
name = "g0"
model = "tiny"
tp = 2

[[group.shard]]
rank = 0
host = "local"
device = "cpu"
port = 7101
kv_memory = "64MiB"

[[group.shard]]
rank = 1
host = "local"
device = "cpu"
port = 7102
kv_memory = "64MiB"
"#;

fn topology(dir: &Path) -> Topology {
    Topology::parse(TOPOLOGY, &dir.join("cluster.toml"))
        .unwrap_or_else(|issues| panic!("test topology is invalid: {issues:?}"))
}

fn coordinator() -> Identity {
    Identity::Coordinator(PeerId(1))
}

fn shard(rank: u32) -> Identity {
    Identity::Shard {
        group: "g0".into(),
        rank: Rank(rank),
    }
}

/// A cluster's certificates in a fresh temporary directory.
fn cluster() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    init_cluster(&topology(dir.path()), &dir.path().join("certs")).unwrap();
    dir
}

fn creds(cluster: &tempfile::TempDir, identity: &Identity) -> Credentials {
    Credentials::load(&cluster.path().join("certs"), identity).unwrap()
}

fn loopback() -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, 0))
}

fn register(rank: u32) -> ShardMsg {
    ShardMsg::Register(Register {
        version: PROTOCOL_VERSION,
        group: "g0".into(),
        rank: Rank(rank),
        pid: std::process::id(),
        device: "cpu".into(),
        held: Vec::new(),
    })
}

/// Accepts one connection and returns the peer's identity, or the error that refused it.
async fn accept_identity(
    server: &quinn::Endpoint,
) -> Result<(quinn::Connection, Identity), String> {
    let incoming = timeout(STEP, server.accept())
        .await
        .map_err(|_| "no incoming connection".to_owned())?
        .ok_or("endpoint closed")?;
    let conn = timeout(STEP, incoming)
        .await
        .map_err(|_| "handshake did not finish".to_owned())?
        .map_err(|e| e.to_string())?;
    let identity = peer_identity(&conn).map_err(|e| e.to_string())?;
    Ok((conn, identity))
}

#[tokio::test]
async fn shard_registers_and_exchanges_frames() {
    let cluster = cluster();
    let server = server_endpoint(loopback(), &creds(&cluster, &coordinator())).unwrap();
    let addr = server.local_addr().unwrap();

    let serve = tokio::spawn(async move {
        let (conn, identity) = accept_identity(&server).await.unwrap();
        let (group, rank) = expect_shard(&identity).unwrap();
        let (mut send, mut recv) = timeout(STEP, conn.accept_bi()).await.unwrap().unwrap();
        let msg: ShardMsg = read_frame(&mut recv, MAX_FRAME_BYTES)
            .await
            .unwrap()
            .unwrap();
        write_frame(&mut send, &CoordinatorMsg::Drain)
            .await
            .unwrap();
        send.finish().unwrap();
        // The shard closes once it has read the answer.
        timeout(STEP, conn.closed()).await.unwrap();
        (group, rank, msg)
    });

    let client = client_endpoint(&creds(&cluster, &shard(1))).unwrap();
    let conn = timeout(STEP, connect(&client, addr, &coordinator()))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(peer_identity(&conn).unwrap(), coordinator());
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    write_frame(&mut send, &register(1)).await.unwrap();
    let answer: Option<CoordinatorMsg> = timeout(STEP, read_frame(&mut recv, MAX_FRAME_BYTES))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(answer, Some(CoordinatorMsg::Drain));
    // The server finished its side: a clean end of stream reads as `None`.
    let end: Option<CoordinatorMsg> = read_frame(&mut recv, MAX_FRAME_BYTES).await.unwrap();
    assert_eq!(end, None);
    conn.close(0u32.into(), b"done");

    let (group, rank, msg) = serve.await.unwrap();
    assert_eq!((group.as_str(), rank), ("g0", Rank(1)));
    assert_eq!(msg, register(1));
}

/// A client that trusts the cluster CA but presents a certificate from another CA: under
/// TLS 1.3 the refusal reaches it on its first stream read, not necessarily at connect.
#[tokio::test]
async fn client_certificate_from_another_ca_is_refused() {
    let cluster = cluster();
    let rogue = cluster_certs_mixed(&cluster);
    let server = server_endpoint(loopback(), &creds(&cluster, &coordinator())).unwrap();
    let addr = server.local_addr().unwrap();
    let serve = tokio::spawn(async move { accept_identity(&server).await.map(|(_, id)| id) });

    let rogue_creds = Credentials::load(rogue.path(), &shard(0)).unwrap();
    let client = client_endpoint(&rogue_creds).unwrap();
    let outcome = timeout(STEP, async {
        let conn = connect(&client, addr, &coordinator()).await?;
        let (mut send, mut recv) = conn.open_bi().await.map_err(std::io::Error::from)?;
        write_frame(&mut send, &register(0)).await?;
        read_frame::<_, CoordinatorMsg>(&mut recv, MAX_FRAME_BYTES).await
    })
    .await
    .expect("the refusal arrives within the timeout");
    let err = outcome.expect_err("a certificate from another CA must be refused");
    // The server's TLS alert, carried in the error's causes.
    assert!(
        err.to_string().contains("invalid peer certificate"),
        "{err}"
    );

    let refused = serve.await.unwrap();
    assert!(refused.is_err(), "server accepted {refused:?}");
}

/// A directory with the cluster's `ca.pem` and a shard certificate and key of another
/// cluster's CA.
fn cluster_certs_mixed(cluster: &tempfile::TempDir) -> tempfile::TempDir {
    let other = self::cluster();
    let mixed = tempfile::tempdir().unwrap();
    let certs = cluster.path().join("certs");
    let other_certs = other.path().join("certs");
    std::fs::copy(certs.join("ca.pem"), mixed.path().join("ca.pem")).unwrap();
    for file in ["shard-g0-0.pem", "shard-g0-0.key"] {
        std::fs::copy(other_certs.join(file), mixed.path().join(file)).unwrap();
    }
    mixed
}

/// A client of another cluster does not trust this cluster's coordinator: connect fails.
#[tokio::test]
async fn server_from_another_ca_is_refused_by_the_client() {
    let cluster = cluster();
    let other = self::cluster();
    let server = server_endpoint(loopback(), &creds(&cluster, &coordinator())).unwrap();
    let addr = server.local_addr().unwrap();
    let _serve = tokio::spawn(async move { accept_identity(&server).await.map(|(_, id)| id) });

    let client = client_endpoint(&creds(&other, &shard(0))).unwrap();
    let err = timeout(STEP, connect(&client, addr, &coordinator()))
        .await
        .unwrap()
        .unwrap_err();
    assert!(matches!(err, CommError::Connection { .. }), "{err}");
}

/// Dialling coordinator 2 at coordinator 1's address fails the server-name check.
#[tokio::test]
async fn server_with_another_identity_is_refused_by_the_client() {
    let cluster = cluster();
    let server = server_endpoint(loopback(), &creds(&cluster, &coordinator())).unwrap();
    let addr = server.local_addr().unwrap();
    let _serve = tokio::spawn(async move { accept_identity(&server).await.map(|(_, id)| id) });

    let client = client_endpoint(&creds(&cluster, &shard(0))).unwrap();
    let err = timeout(
        STEP,
        connect(&client, addr, &Identity::Coordinator(PeerId(2))),
    )
    .await
    .unwrap()
    .unwrap_err();
    assert!(matches!(err, CommError::Connection { .. }), "{err}");
}

/// A coordinator certificate used to dial is seen as a coordinator, so the shard
/// registration path refuses it.
#[tokio::test]
async fn coordinator_certificate_as_client_is_not_a_shard() {
    let cluster = cluster();
    let server = server_endpoint(loopback(), &creds(&cluster, &coordinator())).unwrap();
    let addr = server.local_addr().unwrap();
    let serve = tokio::spawn(async move { accept_identity(&server).await.map(|(_, id)| id) });

    let peer = Identity::Coordinator(PeerId(2));
    let client = client_endpoint(&creds(&cluster, &peer)).unwrap();
    let conn = timeout(STEP, connect(&client, addr, &coordinator()))
        .await
        .unwrap()
        .unwrap();
    let seen = serve.await.unwrap().unwrap();
    assert_eq!(seen, peer);
    assert_eq!(expect_coordinator(&seen).unwrap(), PeerId(2));
    let err = expect_shard(&seen).unwrap_err();
    assert!(matches!(err, CommError::WrongRole { .. }), "{err}");
    assert_eq!(err.to_string(), "peer coordinator 2 is not a shard");
    conn.close(0u32.into(), b"done");
}

/// A peer that goes silent (a killed process: no close, no packets) is noticed through the
/// idle timeout. The shard talks to the coordinator through a UDP relay that is then cut.
#[tokio::test]
async fn silent_peer_is_detected_by_the_idle_timeout() {
    let cluster = cluster();
    let server = server_endpoint(loopback(), &creds(&cluster, &coordinator())).unwrap();
    let server_addr = server.local_addr().unwrap();
    let (relay_addr, relay) = udp_relay(server_addr).await;
    let serve = tokio::spawn(async move { accept_identity(&server).await.map(|(c, _)| c) });

    let client = client_endpoint(&creds(&cluster, &shard(0))).unwrap();
    let _conn = timeout(STEP, connect(&client, relay_addr, &coordinator()))
        .await
        .unwrap()
        .unwrap();
    let server_conn = serve.await.unwrap().unwrap();

    // Keep-alives hold the idle connection open past the idle timeout.
    tokio::time::sleep(MAX_IDLE_TIMEOUT + Duration::from_secs(1)).await;
    assert!(server_conn.close_reason().is_none());

    relay.abort();
    let cut = Instant::now();
    let reason = timeout(STEP, server_conn.closed()).await.unwrap();
    let waited = cut.elapsed();
    assert!(
        matches!(reason, quinn::ConnectionError::TimedOut),
        "{reason}"
    );
    assert!(waited < Duration::from_secs(5), "noticed after {waited:?}");
}

/// Forwards datagrams between one client and `server` until the task is aborted.
async fn udp_relay(server: SocketAddr) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let front = UdpSocket::bind(loopback()).await.unwrap();
    let back = UdpSocket::bind(loopback()).await.unwrap();
    back.connect(server).await.unwrap();
    let addr = front.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let mut client = None;
        let mut up = vec![0u8; 65536];
        let mut down = vec![0u8; 65536];
        loop {
            tokio::select! {
                Ok((n, from)) = front.recv_from(&mut up) => {
                    client = Some(from);
                    let _ = back.send(&up[..n]).await;
                }
                Ok(n) = back.recv(&mut down) => {
                    if let Some(client) = client {
                        let _ = front.send_to(&down[..n], client).await;
                    }
                }
            }
        }
    });
    (addr, task)
}

#[test]
fn init_cluster_writes_every_identity_with_private_keys() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("certs");
    let summary = init_cluster(&topology(dir.path()), &out).unwrap();
    let mode = |path: &Path| std::fs::metadata(path).unwrap().permissions().mode() & 0o777;

    assert_eq!(mode(&out), 0o700);
    assert_eq!(mode(&summary.ca_key), 0o600);
    assert!(summary.ca_name.starts_with("Tessera cluster CA "));
    let stems: Vec<String> = summary
        .issued
        .iter()
        .map(|issued| issued.identity.file_stem())
        .collect();
    assert_eq!(
        stems,
        [
            "coordinator-1",
            "coordinator-2",
            "coordinator-3",
            "shard-g0-0",
            "shard-g0-1"
        ]
    );
    for issued in &summary.issued {
        assert_eq!(mode(&issued.key), 0o600, "{}", issued.key.display());
        assert!(issued.cert.exists());
        let loaded = Credentials::load(&out, &issued.identity).unwrap();
        assert_eq!(loaded.identity(), &issued.identity);
    }
}

#[test]
fn init_cluster_never_overwrites_a_ca() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("certs");
    init_cluster(&topology(dir.path()), &out).unwrap();
    let before = std::fs::read(out.join("ca.key")).unwrap();
    let err = init_cluster(&topology(dir.path()), &out).unwrap_err();
    assert!(matches!(err, CommError::CertsExist { .. }), "{err}");
    assert!(err.to_string().contains("ca.pem"), "{err}");
    assert!(err.to_string().contains("delete the directory"), "{err}");
    assert_eq!(std::fs::read(out.join("ca.key")).unwrap(), before);
}

#[test]
fn missing_credentials_name_the_files_and_the_command() {
    let dir = tempfile::tempdir().unwrap();
    let err = Credentials::load(dir.path(), &shard(0)).unwrap_err();
    let message = err.to_string();
    assert!(matches!(err, CommError::CredentialsMissing { .. }), "{err}");
    for needle in [
        "ca.pem",
        "shard-g0-0.pem",
        "shard-g0-0.key",
        "tessera certs init --topology FILE --out",
    ] {
        assert!(message.contains(needle), "{message:?} lacks {needle:?}");
    }
}

#[test]
fn a_certificate_under_another_identity_name_is_refused() {
    let cluster = cluster();
    let certs = cluster.path().join("certs");
    for ext in ["pem", "key"] {
        std::fs::copy(
            certs.join(format!("shard-g0-1.{ext}")),
            certs.join(format!("shard-g0-5.{ext}")),
        )
        .unwrap();
    }
    let err = Credentials::load(&certs, &shard(5)).unwrap_err();
    assert!(err.to_string().contains("is for shard g0/1"), "{err}");
}

/// A peer added after `certs init` gets its certificate from the same CA with
/// `issue_one`, and the others accept it under its identity.
#[tokio::test]
async fn a_certificate_issued_later_from_the_ca_is_accepted() {
    let cluster = cluster();
    let dir = cluster.path().join("certs");
    let newcomer = Identity::Coordinator(PeerId(9));
    let issued = tessera_comm::certs::issue_one(&dir, &newcomer).unwrap();
    assert_eq!(issued.cert, dir.join("coordinator-9.pem"));
    let mode = std::fs::metadata(&issued.key).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);

    let server = server_endpoint(loopback(), &creds(&cluster, &coordinator())).unwrap();
    let addr = server.local_addr().unwrap();
    let serve = tokio::spawn(async move { accept_identity(&server).await.map(|(_, id)| id) });
    let client = client_endpoint(&creds(&cluster, &newcomer)).unwrap();
    let conn = timeout(STEP, connect(&client, addr, &coordinator()))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(serve.await.unwrap().unwrap(), newcomer);
    conn.close(0u32.into(), b"done");

    // Never twice: the key of a running peer is not replaced.
    let err = tessera_comm::certs::issue_one(&dir, &newcomer).unwrap_err();
    assert!(err.to_string().contains("already exists"), "{err}");
}
