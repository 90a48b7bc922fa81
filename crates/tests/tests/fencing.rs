//! Term fencing with the real shard binary: a deposed coordinator leader cannot drive a
//! shard. Two fake coordinator peers of three (this test, speaking the control protocol over QUIC
//! with the cluster's certificates) play the leaders: peer 1 leads term 5 and runs a step;
//! peer 2 announces term 6 on its standby connection and the shard moves to it; when
//! peer 2 goes away the shard comes back to peer 1, whose assignment and plans of term 5
//! it ignores — until peer 1 assigns under a newer term (7), which it takes.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tessera_comm::certs::{Credentials, Identity};
use tessera_comm::proto::{
    Assignment, Bootstrap, CoordinatorMsg, Epoch, ModelSource, NewSeq, PrefillChunk, Sampling,
    SeqId, ShardMsg, StepId, StepPlan, Term, Warmup,
};
use tessera_comm::{GroupToken, quic, wire};
use tessera_tests::{Cluster, GroupSpec, fixture, local_peer_addrs, peers_topology_text};
use tessera_topology::PeerId;
use tokio::sync::mpsc;
use tokio::time::timeout;

type Link = (quinn::Connection, quinn::SendStream, quinn::RecvStream);

/// A fake coordinator peer: hands over each registered connection; holds standby ones,
/// keeping the last one's send stream for announcements; answers registrations with
/// `NotLeader` once told to.
struct FakePeer {
    links: mpsc::UnboundedReceiver<Link>,
    standby: Arc<Mutex<Option<quinn::SendStream>>>,
    refuse: Arc<Mutex<Option<u64>>>,
}

fn fake_peer(addr: SocketAddr, creds: &Credentials) -> FakePeer {
    let endpoint = quic::server_endpoint(addr, creds).expect("endpoint");
    let (links_tx, links) = mpsc::unbounded_channel();
    let standby = Arc::new(Mutex::new(None));
    let refuse: Arc<Mutex<Option<u64>>> = Arc::new(Mutex::new(None));
    let (standby_slot, refuse_to) = (Arc::clone(&standby), Arc::clone(&refuse));
    tokio::spawn(async move {
        while let Some(incoming) = endpoint.accept().await {
            let (links_tx, standby_slot, refuse_to) = (
                links_tx.clone(),
                Arc::clone(&standby_slot),
                Arc::clone(&refuse_to),
            );
            tokio::spawn(async move {
                let Ok(connection) = incoming.await else {
                    return;
                };
                let Ok((mut send, mut recv)) = connection.accept_bi().await else {
                    return;
                };
                let first = wire::read_frame::<_, ShardMsg>(&mut recv, wire::MAX_FRAME_BYTES).await;
                match first {
                    Ok(Some(ShardMsg::Standby(_))) => {
                        *standby_slot.lock().unwrap() = Some(send);
                        // Held until the shard closes it.
                        let _ = wire::read_frame::<_, ShardMsg>(&mut recv, 4096).await;
                    }
                    Ok(Some(ShardMsg::Register(_))) => {
                        let leader = *refuse_to.lock().unwrap();
                        if let Some(leader) = leader {
                            let msg = CoordinatorMsg::NotLeader {
                                leader: Some(PeerId(leader)),
                            };
                            let _ = wire::write_frame(&mut send, &msg).await;
                            let _ = send.finish();
                            let _ = timeout(Duration::from_secs(1), send.stopped()).await;
                            return;
                        }
                        let _ = links_tx.send((connection, send, recv));
                    }
                    _ => {}
                }
            });
        }
    });
    FakePeer {
        links,
        standby,
        refuse,
    }
}

fn assign(term: u64, epoch: u64) -> CoordinatorMsg {
    CoordinatorMsg::Assign(Assignment {
        term: Term(term),
        epoch: Epoch(epoch),
        token: GroupToken::random(),
        bootstrap: Bootstrap::Solo,
        collective_deadline_ms: 2000,
        keep: Vec::new(),
        warmup: Warmup::NONE,
        model: ModelSource {
            version: 1,
            path: fixture("llama-gqa/f32").display().to_string(),
        },
    })
}

fn step(term: u64, epoch: u64, seq: u64) -> CoordinatorMsg {
    CoordinatorMsg::Step(StepPlan {
        term: Term(term),
        epoch: Epoch(epoch),
        step: StepId(0),
        free: Vec::new(),
        new: vec![NewSeq {
            seq: SeqId(seq),
            request: String::new(),
            prompt: vec![1, 5, 9],
            generated: Vec::new(),
            sampling: Sampling::default(),
            max_tokens: 4,
            stop_token_ids: Vec::new(),
        }],
        prefill: vec![PrefillChunk {
            seq: SeqId(seq),
            tokens: 3,
        }],
        decode: Vec::new(),
    })
}

/// The next message other than loading progress, or `None` when none comes in `wait`.
async fn next(link: &mut Link, wait: Duration) -> Option<ShardMsg> {
    loop {
        let frame = timeout(
            wait,
            wire::read_frame::<_, ShardMsg>(&mut link.2, wire::MAX_FRAME_BYTES),
        )
        .await
        .ok()?;
        match frame {
            Ok(Some(ShardMsg::Loading { .. })) => continue,
            Ok(Some(msg)) => return Some(msg),
            Ok(None) | Err(_) => return None,
        }
    }
}

async fn send(link: &mut Link, msg: &CoordinatorMsg) {
    wire::write_frame(&mut link.1, msg)
        .await
        .expect("write to the shard");
}

async fn registered(peer: &mut FakePeer, who: &str) -> Link {
    timeout(Duration::from_secs(30), peer.links.recv())
        .await
        .unwrap_or_else(|_| panic!("the shard did not register with {who}"))
        .expect("peer running")
}

#[test]
fn a_deposed_leader_cannot_drive_the_shard() {
    // Three peers (raft needs an odd number); peer 3 never starts.
    let addrs = local_peer_addrs(3);
    let group = GroupSpec::local("g", "m", &fixture("llama-gqa/f32"), 1);
    let text = peers_topology_text(&addrs, &[("local", "127.0.0.1")], &[group]);
    let mut cluster = Cluster::prepare(&text, &addrs[0].2).expect("prepared");
    let creds = |id| Credentials::load(&cluster.certs, &Identity::Coordinator(PeerId(id))).unwrap();
    let (creds1, creds2) = (creds(1), creds(2));
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let _guard = runtime.enter();
    let mut peer1 = fake_peer(addrs[0].1.parse().unwrap(), &creds1);
    let mut peer2 = fake_peer(addrs[1].1.parse().unwrap(), &creds2);
    cluster.start_shard("g", 0).expect("shard starts");
    let logs = runtime.block_on(async {
        let wait = Duration::from_secs(30);
        // Peer 1 leads term 5: the shard loads, joins and runs a step.
        let mut link1 = registered(&mut peer1, "peer 1").await;
        send(&mut link1, &assign(5, 1)).await;
        assert!(
            matches!(next(&mut link1, wait).await, Some(ShardMsg::Ready(r)) if r.epoch == Epoch(1))
        );
        send(&mut link1, &step(5, 1, 1)).await;
        match next(&mut link1, wait).await {
            Some(ShardMsg::StepDone(done)) => assert_eq!(done.tokens.len(), 1),
            other => panic!("no result of term 5's step: {other:?}"),
        }

        // Peer 2 leads term 6 and says so on its standby connection: the shard moves.
        let mut standby = None;
        for _ in 0..100 {
            standby = peer2.standby.lock().unwrap().take();
            if standby.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let mut standby = standby.expect("a standby connection to peer 2");
        let leading = CoordinatorMsg::Leading {
            peer: PeerId(2),
            term: Term(6),
        };
        wire::write_frame(&mut standby, &leading)
            .await
            .expect("announce");
        let mut link2 = registered(&mut peer2, "peer 2").await;
        assert_eq!(
            next(&mut link1, Duration::from_secs(5)).await,
            None,
            "peer 1's link closes"
        );
        send(&mut link2, &assign(6, 2)).await;
        assert!(
            matches!(next(&mut link2, wait).await, Some(ShardMsg::Ready(r)) if r.epoch == Epoch(2))
        );

        // Peer 2 goes away (and names peer 1 to a shard that asks it again): the shard
        // comes back to peer 1, deposed but unaware — its term-5 orders are ignored.
        *peer2.refuse.lock().unwrap() = Some(1);
        link2.0.close(0u32.into(), b"gone");
        let mut link3 = registered(&mut peer1, "peer 1 again").await;
        send(&mut link3, &assign(5, 3)).await;
        send(&mut link3, &step(5, 3, 2)).await;
        let answer = next(&mut link3, Duration::from_secs(3)).await;
        assert_eq!(answer, None, "the shard obeyed a deposed leader");

        // The same connection carries an assignment of a newer term: taken at once.
        send(&mut link3, &assign(7, 4)).await;
        assert!(
            matches!(next(&mut link3, wait).await, Some(ShardMsg::Ready(r)) if r.epoch == Epoch(4))
        );
        cluster.logs()
    });
    assert!(
        logs.contains("assignment from a deposed coordinator leader ignored"),
        "{logs}"
    );
}
