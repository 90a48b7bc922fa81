//! The NCCL bootstrap through the real coordinator, with two fake cuda shards (this test,
//! speaking the control protocol over QUIC with the cluster's certificates; no GPU needed):
//! the group's assignment says `Nccl`, rank 0's unique id reaches every rank unchanged,
//! and the group serves once both are ready. An id from another rank fences the group.

use std::net::SocketAddr;
use std::time::Duration;

use tessera_comm::certs::{Credentials, Identity};
use tessera_comm::proto::{
    Bootstrap, CoordinatorMsg, Epoch, PROTOCOL_VERSION, Ready, Register, ShardMsg,
};
use tessera_comm::{quic, wire};
use tessera_tests::{Cluster, GroupSpec, fixture, get};
use tessera_topology::Rank;
use tokio::time::timeout;

type Link = (quinn::Connection, quinn::SendStream, quinn::RecvStream);

fn cuda_cluster() -> (Cluster, SocketAddr) {
    let quic_addr = format!("127.0.0.1:{}", tessera_tests::free_port());
    let http = format!("127.0.0.1:{}", tessera_tests::free_port());
    let mut group = GroupSpec::local("g", "m", &fixture("llama-gqa/f32"), 2);
    group.collective = "auto";
    let text = tessera_tests::topology_text(
        "local",
        &quic_addr,
        &http,
        &[("local", "127.0.0.1")],
        &[group],
    )
    .replacen("device = \"cpu\"", "device = \"cuda:0\"", 1)
    .replacen("device = \"cpu\"", "device = \"cuda:1\"", 1);
    let mut cluster = Cluster::prepare(&text, &http).expect("topology and certificates");
    cluster.start_coordinator().expect("coordinator starts");
    cluster
        .wait_healthy(Duration::from_secs(30))
        .expect("coordinator healthy");
    (cluster, quic_addr.parse().expect("address"))
}

async fn register(cluster: &Cluster, addr: SocketAddr, rank: u32) -> Link {
    let me = Identity::Shard {
        group: "g".into(),
        rank: Rank(rank),
    };
    let creds = Credentials::load(&cluster.certs, &me).expect("shard credentials");
    let endpoint = quic::client_endpoint(&creds).expect("client endpoint");
    let conn = quic::connect(
        &endpoint,
        addr,
        &Identity::Coordinator(tessera_topology::PeerId(1)),
    )
    .await
    .expect("connect");
    let (mut send, recv) = conn.open_bi().await.expect("stream");
    let msg = ShardMsg::Register(Register {
        version: PROTOCOL_VERSION,
        group: "g".into(),
        rank: Rank(rank),
        pid: 1000 + rank,
        device: format!("cuda:{rank}"),
        held: Vec::new(),
    });
    wire::write_frame(&mut send, &msg).await.expect("register");
    (conn, send, recv)
}

async fn next(link: &mut Link) -> CoordinatorMsg {
    timeout(
        Duration::from_secs(15),
        wire::read_frame::<_, CoordinatorMsg>(&mut link.2, wire::MAX_FRAME_BYTES),
    )
    .await
    .expect("the coordinator answers in time")
    .expect("a frame")
    .expect("not closed")
}

/// The next assignment's epoch, checking that it asks for NCCL.
async fn nccl_assignment(link: &mut Link) -> Epoch {
    match next(link).await {
        CoordinatorMsg::Assign(a) => {
            assert_eq!(a.bootstrap, Bootstrap::Nccl, "cuda shards get NCCL");
            a.epoch
        }
        other => panic!("expected an assignment, got {other:?}"),
    }
}

async fn send(link: &mut Link, msg: &ShardMsg) {
    wire::write_frame(&mut link.1, msg).await.expect("send");
}

#[test]
fn rank_0s_nccl_id_reaches_every_rank_and_the_group_serves() {
    let (cluster, addr) = cuda_cluster();
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    runtime.block_on(async {
        let mut r0 = register(&cluster, addr, 0).await;
        let mut r1 = register(&cluster, addr, 1).await;
        let epoch = nccl_assignment(&mut r0).await;
        assert_eq!(nccl_assignment(&mut r1).await, epoch);

        let id: Vec<u8> = (0..128u8).collect();
        send(
            &mut r0,
            &ShardMsg::NcclId {
                epoch,
                id: id.clone(),
            },
        )
        .await;
        for link in [&mut r0, &mut r1] {
            match next(link).await {
                CoordinatorMsg::NcclId { epoch: e, id: got } => {
                    assert_eq!((e, &got), (epoch, &id), "the id arrives unchanged");
                }
                other => panic!("expected the NCCL id, got {other:?}"),
            }
        }
        let ready = Ready {
            epoch,
            kv_blocks: 64,
            block_size: 16,
            weight_bytes: 1,
            kept: Vec::new(),
            warmup_ms: None,
        };
        send(&mut r0, &ShardMsg::Ready(ready.clone())).await;
        send(&mut r1, &ShardMsg::Ready(ready)).await;
        let url = format!("{}/ready", cluster.http);
        let mut last = None;
        for _ in 0..100 {
            let answer = get(&url);
            if matches!(answer, Ok((200, _))) {
                last = None;
                break;
            }
            last = Some(answer);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(
            last.is_none(),
            "the group serves once both ranks are ready: {last:?}\n{}",
            cluster.logs()
        );

        // An NCCL id from rank 1 is not its to send: the group is fenced and assigned
        // again under a new epoch.
        send(&mut r1, &ShardMsg::NcclId { epoch, id }).await;
        let again = nccl_assignment(&mut r0).await;
        assert!(again > epoch, "epoch {again} after {epoch}");
    });
    let logs = cluster.logs();
    assert!(
        logs.contains("sent an NCCL id it was not asked for"),
        "{logs}"
    );
}
