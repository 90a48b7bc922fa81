//! The control plane refuses what it must: a shard whose certificate comes from another
//! cluster's CA, a coordinator's certificate presented by a shard, and frames that are
//! too large or garbage — each without disturbing the coordinator, which keeps serving.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tessera_comm::certs::{Credentials, Identity};
use tessera_comm::proto::{CoordinatorMsg, PROTOCOL_VERSION, Register, ShardMsg};
use tessera_comm::{quic, wire};
use tessera_tests::{Cluster, GroupSpec, bin, fixture};
use tessera_topology::{PeerId, Rank};

fn one_shard_cluster(group: &str) -> Cluster {
    let path = fixture("llama-gqa/f32");
    let quic = format!("127.0.0.1:{}", tessera_tests::free_port());
    let http = format!("127.0.0.1:{}", tessera_tests::free_port());
    let text = tessera_tests::topology_text(
        "local",
        &quic,
        &http,
        &[("local", "127.0.0.1")],
        &[GroupSpec::local(group, "m", &path, 1)],
    );
    let mut cluster = Cluster::prepare(&text, &http).expect("topology and certificates");
    cluster.start_coordinator().expect("coordinator starts");
    cluster
        .wait_healthy(Duration::from_secs(30))
        .expect("coordinator healthy");
    cluster
}

/// Runs `tessera-shard` with `certs` for up to `wait`; its exit status (None: still
/// running, then killed) and its output.
fn run_shard(
    cluster: &Cluster,
    group: &str,
    certs: &Path,
    wait: Duration,
) -> (Option<i32>, String) {
    let mut child = Command::new(bin("tessera-shard"))
        .arg("--topology")
        .arg(&cluster.topology)
        .args(["--group", group, "--rank", "0", "--certs"])
        .arg(certs)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("shard starts");
    let deadline = Instant::now() + wait;
    let status = loop {
        if let Ok(Some(status)) = child.try_wait() {
            break status.code();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let out = child.wait_with_output().expect("output");
    let text =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    (status, text)
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for entry in std::fs::read_dir(from).expect("readable") {
        let entry = entry.expect("entry");
        std::fs::copy(entry.path(), to.join(entry.file_name())).expect("copy");
    }
}

#[test]
fn shard_with_a_foreign_ca_is_refused() {
    let cluster = one_shard_cluster("g");
    // The same topology, certificates from a second, unrelated CA.
    let text = std::fs::read_to_string(&cluster.topology).expect("topology");
    let topology = tessera_topology::Topology::parse(&text, &cluster.topology).expect("valid");
    let foreign = cluster.dir.path().join("foreign-certs");
    tessera_comm::certs::init_cluster(&topology, &foreign).expect("second CA");
    let (status, output) = run_shard(&cluster, "g", &foreign, Duration::from_secs(6));
    assert!(status.is_none_or(|code| code != 0), "{output}");
    let coordinator = std::fs::read_to_string(&cluster.procs[0].log).unwrap_or_default();
    assert!(
        !coordinator.contains("registration accepted"),
        "a foreign certificate must not register\n{coordinator}"
    );
    assert!(
        coordinator.contains("connection refused"),
        "the coordinator should log the refused handshake\n{coordinator}"
    );
    // Still serving /health.
    cluster
        .wait_healthy(Duration::from_secs(5))
        .expect("coordinator alive");
}

#[test]
fn coordinator_certificate_cannot_register_as_a_shard() {
    let cluster = one_shard_cluster("g");
    // A shard given the coordinator's certificate under its own file name refuses to
    // start: the certificate does not name it.
    let stolen = cluster.dir.path().join("stolen-certs");
    copy_dir(&cluster.certs, &stolen);
    let shard = Identity::Shard {
        group: "g".into(),
        rank: Rank(0),
    };
    let coordinator = Identity::Coordinator(PeerId(1));
    for ext in ["pem", "key"] {
        std::fs::copy(
            stolen.join(format!("{}.{ext}", coordinator.file_stem())),
            stolen.join(format!("{}.{ext}", shard.file_stem())),
        )
        .expect("swap certificate");
    }
    let (status, output) = run_shard(&cluster, "g", &stolen, Duration::from_secs(15));
    assert!(
        matches!(status, Some(code) if code != 0),
        "{status:?}\n{output}"
    );
    assert!(
        output.contains("the certificate is for coordinator 1"),
        "{output}"
    );

    // A peer that presents the coordinator's certificate and registers as a shard anyway
    // is refused by the coordinator, with the reason.
    let creds = Credentials::load(&cluster.certs, &coordinator).expect("coordinator credentials");
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let answer = runtime.block_on(async {
        let endpoint = quic::client_endpoint(&creds).expect("client endpoint");
        let conn = quic::connect(&endpoint, quic_addr(&cluster), &coordinator)
            .await
            .expect("mutual TLS succeeds: the certificate is the cluster's");
        let (mut send, mut recv) = conn.open_bi().await.expect("stream");
        let register = ShardMsg::Register(Register {
            version: PROTOCOL_VERSION,
            group: "g".into(),
            rank: Rank(0),
            pid: 1,
            device: "cpu".into(),
            held: Vec::new(),
        });
        wire::write_frame(&mut send, &register)
            .await
            .expect("write");
        tokio::time::timeout(
            Duration::from_secs(10),
            wire::read_frame::<_, CoordinatorMsg>(&mut recv, wire::MAX_FRAME_BYTES),
        )
        .await
        .expect("the coordinator answers")
    });
    match answer {
        Ok(Some(CoordinatorMsg::Refused { error })) => assert!(
            error.message.contains("cannot register as a shard"),
            "{error:?}"
        ),
        other => panic!("expected a refusal, got {other:?}"),
    }
    let log = std::fs::read_to_string(&cluster.procs[0].log).unwrap_or_default();
    assert!(!log.contains("registration accepted"), "{log}");
    cluster
        .wait_healthy(Duration::from_secs(5))
        .expect("coordinator alive");
}

fn quic_addr(cluster: &Cluster) -> std::net::SocketAddr {
    let text = std::fs::read_to_string(&cluster.topology).expect("topology");
    let t = tessera_topology::Topology::parse(&text, &cluster.topology).expect("valid");
    t.coordinators[0]
        .quic
        .to_string()
        .parse()
        .expect("socket address")
}

#[test]
fn oversized_and_garbage_frames_are_rejected_without_a_crash() {
    let mut cluster = one_shard_cluster("g");
    let quic_addr = quic_addr(&cluster);
    let creds = Credentials::load(
        &cluster.certs,
        &Identity::Shard {
            group: "g".into(),
            rank: Rank(0),
        },
    )
    .expect("shard credentials");
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let frames: [Vec<u8>; 3] = [
        // A length prefix of 4 GiB - 1, then a few bytes: must be refused before allocating.
        [0xFFu8, 0xFF, 0xFF, 0xFF, 1, 2, 3].to_vec(),
        // A small frame of garbage.
        [8u8, 0, 0, 0, 0xde, 0xad, 0xbe, 0xef, 0xde, 0xad, 0xbe, 0xef].to_vec(),
        // A valid length with a truncated body, then the stream ends.
        [100u8, 0, 0, 0, 1].to_vec(),
    ];
    for frame in frames {
        runtime.block_on(async {
            let endpoint = quic::client_endpoint(&creds).expect("client endpoint");
            let conn = quic::connect(&endpoint, quic_addr, &Identity::Coordinator(PeerId(1)))
                .await
                .expect("mutual TLS with a valid shard certificate");
            let (mut send, mut recv) = conn.open_bi().await.expect("stream");
            send.write_all(&frame).await.expect("write");
            let _ = send.finish();
            // The coordinator answers with a refusal or closes; it must not hang us.
            let answer =
                tokio::time::timeout(Duration::from_secs(10), recv.read_to_end(1 << 20)).await;
            assert!(
                answer.is_ok(),
                "the coordinator neither answered nor closed"
            );
            endpoint.close(0u32.into(), b"done");
        });
    }
    cluster
        .wait_healthy(Duration::from_secs(5))
        .expect("coordinator alive");
    // And a real shard still registers and serves afterwards.
    cluster.start_shard("g", 0).expect("shard starts");
    let tokens = cluster
        .greedy("m", &[1, 2, 3], 4)
        .expect("generation after the attacks");
    assert_eq!(tokens.len(), 4);
}
