//! Three driven peers over an in-process transport: real threads, real ticks.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use raft::prelude::Message;
use tessera_topology::PeerId;

use super::{NodeHandle, ProposalError, Transport, is_snapshot, spawn};
use crate::replication::log;
use crate::replication::peer::{Peer, ProposalRefused};
use crate::replication::state::{Command, Outcome};
use crate::replication::store::LogStore;

/// Each peer's handle, by id; a removed entry is a peer that is down.
type Network = Arc<Mutex<BTreeMap<u64, NodeHandle>>>;

struct Loopback {
    from: u64,
    network: Network,
}

impl Transport for Loopback {
    fn send(&mut self, message: Message) {
        let network = self.network.lock().expect("network");
        match network.get(&message.to) {
            Some(to) => {
                if is_snapshot(&message)
                    && let Some(me) = network.get(&self.from)
                {
                    me.snapshot_sent(PeerId(message.to));
                }
                to.receive(message);
            }
            None => {
                if let Some(me) = network.get(&self.from) {
                    me.unreachable(PeerId(message.to), is_snapshot(&message));
                }
            }
        }
    }
}

fn start(id: u64, store: LogStore, network: &Network) -> NodeHandle {
    let voters = [PeerId(1), PeerId(2), PeerId(3)];
    let peer =
        Peer::start(PeerId(id), &voters, store, id * 1000 + 1, &log::discard()).expect("peer");
    let transport = Loopback {
        from: id,
        network: Arc::clone(network),
    };
    let handle = spawn(peer, transport).expect("thread");
    network.lock().expect("network").insert(id, handle.clone());
    handle
}

/// Waits until some peer leads; returns its id, and how long that took.
async fn leader(network: &Network, deadline: Duration) -> (u64, Duration) {
    let started = Instant::now();
    while started.elapsed() < deadline {
        let leaders: Vec<u64> = network
            .lock()
            .expect("network")
            .values()
            .map(|h| *h.role().borrow())
            .filter(|r| r.is_leader())
            .map(|r| r.id.0)
            .collect();
        if let [one] = leaders[..] {
            return (one, started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("no single leader within {deadline:?}");
}

fn fence(epoch: u64) -> Command {
    Command::Fence {
        group: "g".into(),
        epoch,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_peers_elect_commit_and_survive_the_leader_stopping() {
    let network: Network = Arc::default();
    let stores: Vec<LogStore> = (1..=3)
        .map(|id| LogStore::in_memory(&format!("peer {id}")).expect("store"))
        .collect();
    for id in 1..=3u64 {
        start(id, stores[id as usize - 1].clone(), &network);
    }
    let (first, took) = leader(&network, Duration::from_secs(10)).await;
    eprintln!("first leader: peer {first} after {took:?}");

    // Proposed at a follower: forwarded to the leader, applied here.
    let follower = (1..=3).find(|&id| id != first).expect("a follower");
    let handle = network.lock().expect("network")[&follower].clone();
    let applied = handle
        .propose(fence(1), Duration::from_secs(5))
        .await
        .expect("committed");
    assert_eq!(applied.outcome, Outcome::Applied);
    let again = handle
        .propose(fence(1), Duration::from_secs(5))
        .await
        .expect("committed");
    assert_eq!(again.outcome, Outcome::StaleEpoch { current: 1 });

    // Every peer applies it.
    for id in 1..=3u64 {
        let mut state = network.lock().expect("network")[&id].summary();
        tokio::time::timeout(
            Duration::from_secs(5),
            state.wait_for(|s| s.groups.get("g").is_some_and(|g| g.epoch == 1)),
        )
        .await
        .expect("applied everywhere")
        .expect("peer running");
    }

    // The leader stops: the others elect a new one, which commits.
    let old = network
        .lock()
        .expect("network")
        .remove(&first)
        .expect("leader");
    old.stop();
    let (second, took) = leader(&network, Duration::from_secs(10)).await;
    eprintln!("new leader: peer {second} after {took:?}");
    assert_ne!(second, first);
    let handle = network.lock().expect("network")[&second].clone();
    let applied = handle
        .propose(fence(2), Duration::from_secs(5))
        .await
        .expect("committed");
    assert_eq!(applied.outcome, Outcome::Applied);

    // It restarts from its store and catches up.
    let restarted = start(first, stores[first as usize - 1].clone(), &network);
    let mut state = restarted.summary();
    tokio::time::timeout(
        Duration::from_secs(10),
        state.wait_for(|s| s.groups.get("g").is_some_and(|g| g.epoch == 2)),
    )
    .await
    .expect("caught up")
    .expect("peer running");
    // Not under the lock: a stopping peer's thread may be sending.
    let handles: Vec<NodeHandle> = network.lock().expect("network").values().cloned().collect();
    for handle in handles {
        handle.stop();
    }
}

#[tokio::test]
async fn a_lone_peer_without_quorum_refuses_or_times_out() {
    let network: Network = Arc::default();
    let store = LogStore::in_memory("alone").expect("store");
    let handle = start(1, store, &network);
    // Peers 2 and 3 never start: no leader, so nothing commits.
    let result = handle.propose(fence(1), Duration::from_millis(300)).await;
    assert!(
        matches!(
            result,
            Err(ProposalError::Refused(ProposalRefused::NoLeader) | ProposalError::Timeout(_))
        ),
        "{result:?}"
    );
    handle.stop();
    let stopped = handle.propose(fence(1), Duration::from_millis(300)).await;
    assert_eq!(stopped, Err(ProposalError::Stopped));
}

/// A peer whose disk is full (the store's write fails) or whose core fails stops, and
/// says why through `failure`, which the coordinator's process exits on. Before, its
/// thread ended silently and the process lived on, answering `/health` with 200.
#[cfg(feature = "failpoints")]
#[tokio::test]
async fn a_failpoint_in_the_store_or_the_core_stops_the_peer_and_says_why() {
    let scenario = fail::FailScenario::setup();
    for (failpoint, says) in [
        ("store::persist", "No space left on device"),
        ("raft::before_apply", "failpoint raft::before_apply fired"),
    ] {
        let network: Network = Arc::default();
        let store = LogStore::in_memory("alone").expect("store");
        let voters = [PeerId(1)];
        let peer = Peer::start(PeerId(1), &voters, store, 1, &log::discard()).expect("peer");
        let transport = Loopback {
            from: 1,
            network: Arc::clone(&network),
        };
        let handle = spawn(peer, transport).expect("thread");
        let applied = handle.propose(fence(1), Duration::from_secs(5)).await;
        assert_eq!(applied.expect("committed").outcome, Outcome::Applied);
        assert_eq!(*handle.failure().borrow(), None);

        fail::cfg(failpoint, "return").expect("failpoint");
        let refused = handle.propose(fence(2), Duration::from_secs(5)).await;
        assert!(refused.is_err(), "{failpoint}: {refused:?}");
        let mut failure = handle.failure();
        let reason =
            tokio::time::timeout(Duration::from_secs(5), failure.wait_for(Option::is_some))
                .await
                .expect("the failure is reported")
                .expect("watch open")
                .clone();
        let reason = reason.expect("a reason");
        assert!(reason.contains(says), "{failpoint}: {reason}");
        fail::remove(failpoint);
        handle.stop();
    }
    scenario.teardown();
}

/// A peer stopped on request has no failure to report.
#[tokio::test]
async fn a_peer_stopped_on_request_reports_no_failure() {
    let network: Network = Arc::default();
    let handle = start(1, LogStore::in_memory("stopped").expect("store"), &network);
    handle.stop();
    assert_eq!(*handle.failure().borrow(), None);
}

/// A leader that hands over names another voter, which leads within an election timeout
/// and commits; the old leader follows it. A follower has nothing to hand over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_hands_over_to_another_voter_which_then_leads() {
    let network: Network = Arc::default();
    for id in 1..=3u64 {
        let store = LogStore::in_memory(&format!("peer {id}")).expect("store");
        start(id, store, &network);
    }
    let (first, _) = leader(&network, Duration::from_secs(10)).await;
    let handles: BTreeMap<u64, NodeHandle> = network.lock().expect("network").clone();
    let old = &handles[&first];
    old.propose(fence(1), Duration::from_secs(5))
        .await
        .expect("committed");
    let follower = (1..=3).find(|&id| id != first).expect("a follower");
    assert_eq!(handles[&follower].hand_over().await, None);

    let to = old.hand_over().await.expect("a leader hands over");
    assert_ne!(to.0, first);
    let mut role = old.role();
    let role = tokio::time::timeout(
        Duration::from_secs(2),
        role.wait_for(|r| r.leader == Some(to) && !r.is_leader()),
    )
    .await
    .expect("the old leader follows the new one within 2 s")
    .map(|r| *r)
    .expect("peer running");
    eprintln!("peer {first} handed over to {to} (term {})", role.term);
    let applied = handles[&to.0]
        .propose(fence(2), Duration::from_secs(5))
        .await
        .expect("the new leader commits");
    assert_eq!(applied.outcome, Outcome::Applied);
    for handle in handles.values() {
        handle.stop();
    }
}
