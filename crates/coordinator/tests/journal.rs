//! The request journal under a heavy load, on three peers over QUIC with their logs on
//! disk: requests with 4k-token prompts are journaled as the leader journals them for an
//! engine that answers at once (reserve room in the budget, `Accept`, `Progress`,
//! `Finish`), far past what one wire frame or one snapshot used to hold.
//!
//! `TESSERA_JOURNAL_REQUESTS` sets how many (20,000 by default, the size; about
//! 11 s here).

use std::time::{Duration, Instant};

use tessera_comm::proto::{FinishReason, Sampling};
use tessera_comm::wire::MAX_FRAME_BYTES;
use tessera_coordinator::engine::GenerateRequest;
use tessera_coordinator::leader::{JournalBudget, JournalLimits};
use tessera_coordinator::replication::node::NodeHandle;
use tessera_coordinator::replication::state::Command;

mod support;
use support::peers::Peers;

const TIMEOUT: Duration = Duration::from_secs(30);
const PROMPT_TOKENS: u32 = 4096;
const OUTPUT_TOKENS: u32 = 16;
const CLIENTS: usize = 32;

fn request(i: usize) -> GenerateRequest {
    GenerateRequest {
        model: "m".into(),
        prompt: (0..PROMPT_TOKENS)
            .map(|t| (t * 31 + i as u32) % 32_000)
            .collect(),
        max_tokens: OUTPUT_TOKENS,
        sampling: Sampling::default(),
        stop_token_ids: vec![2],
        stop: Vec::new(),
        priority: 0,
    }
}

/// One request, start to end, as the leader journals it.
async fn journal_one(node: &NodeHandle, budget: &JournalBudget, i: usize) {
    let id = format!("cmpl-{i}");
    let request = request(i);
    let reservation = budget.reserve(&id, &request).await.expect("room");
    let accept = Command::Accept {
        id: id.clone(),
        request,
        at_ms: now_ms(),
    };
    node.propose(accept, TIMEOUT).await.expect("accepted");
    drop(reservation);
    let progress = Command::Progress {
        id: id.clone(),
        offset: 0,
        tokens: (0..OUTPUT_TOKENS).collect(),
    };
    node.propose(progress, TIMEOUT).await.expect("progress");
    let finish = Command::Finish {
        id,
        reason: Some(FinishReason::Length),
        at_ms: now_ms(),
    };
    node.propose(finish, TIMEOUT).await.expect("finished");
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The applied index and a digest of the journal (ids and tokens sent) of one peer.
async fn journal_of(node: &NodeHandle) -> (u64, Vec<(String, usize)>) {
    node.read(|s| {
        let entries = s.journal.iter().map(|(id, j)| (id.clone(), j.sent.len()));
        (s.applied, entries.collect())
    })
    .await
    .expect("running")
}

/// Waits until peer `id` has applied what the leader has.
async fn caught_up(peers: &Peers, leader: u64, id: u64) {
    let deadline = Instant::now() + Duration::from_secs(120);
    let target = journal_of(&peers.node(leader)).await;
    loop {
        if journal_of(&peers.node(id)).await.0 >= target.0 {
            assert_eq!(journal_of(&peers.node(id)).await.1, target.1, "peer {id}");
            return;
        }
        assert!(Instant::now() < deadline, "peer {id} did not catch up");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Far more requests than the budget holds: every one is journaled (finished ones make
/// room), the journal stays within its budget, no peer stops, a peer that was down
/// catches up through a snapshot several frames long, and a restarted peer restores it.
/// Before the budget and the chunked snapshots, a snapshot past one frame failed to
/// encode and stopped every peer at the same index.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_journal_past_one_frame_stays_within_its_budget_on_every_peer() {
    let requests: usize = std::env::var("TESSERA_JOURNAL_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    let dir = tempfile::tempdir().expect("temp dir");
    let mut peers = Peers::start(3, dir.path());
    let leader = peers.leader().await;
    let lagging = peers
        .running()
        .into_iter()
        .find(|&id| id != leader)
        .expect("a follower");
    peers.stop_peer(lagging).await;

    let node = peers.node(leader);
    let limits = JournalLimits::default();
    let budget = JournalBudget::new(node.clone(), limits);
    let started = Instant::now();
    let mut clients = Vec::new();
    for c in 0..CLIENTS {
        let (node, budget) = (node.clone(), budget.clone());
        clients.push(tokio::spawn(async move {
            let mut most = 0;
            for i in (c..requests).step_by(CLIENTS) {
                journal_one(&node, &budget, i).await;
                most = most.max(node.journal_usage().bytes);
            }
            most
        }));
    }
    let mut most = 0;
    for client in clients {
        most = most.max(client.await.expect("client"));
    }
    let usage = node.journal_usage();
    eprintln!(
        "{requests} requests journaled in {:.1} s; journal now {usage:?}, at most {most} bytes \
         of a {} byte budget",
        started.elapsed().as_secs_f64(),
        limits.budget
    );
    assert!(most <= limits.budget, "{most} > {}", limits.budget);
    assert!(
        usage.entries < requests as u64,
        "finished requests were pruned"
    );
    let snapshot = node
        .read(|s| s.snapshot().map(|b| b.len()))
        .await
        .expect("running")
        .expect("the state encodes");
    assert!(
        snapshot > 2 * MAX_FRAME_BYTES,
        "a snapshot of {snapshot} bytes"
    );

    // The peer that was down catches up: the log it missed is compacted away, so only
    // the snapshot brings it back.
    peers.start_peer(lagging);
    caught_up(&peers, leader, lagging).await;
    // A restarted peer restores the snapshot from its own log.
    let other = peers
        .running()
        .into_iter()
        .find(|&id| id != leader && id != lagging);
    let restarted = other.expect("a third peer");
    peers.stop_peer(restarted).await;
    peers.start_peer(restarted);
    caught_up(&peers, leader, restarted).await;
    for id in peers.running() {
        assert_eq!(
            *peers.node(id).failure().borrow(),
            None,
            "peer {id} stopped"
        );
    }
    peers.stop_all().await;
}

/// Open requests that fill the budget turn new ones away (503, with the figures), however
/// many arrive at once, and never push the journal past its budget; once some finish,
/// new requests find room again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn open_requests_that_fill_the_budget_turn_new_ones_away() {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut peers = Peers::start(1, dir.path());
    let node = peers.node(peers.leader().await);
    let limits = JournalLimits {
        budget: 1 << 20,
        ..JournalLimits::default()
    };
    let budget = JournalBudget::new(node.clone(), limits);
    let mut arrivals = Vec::new();
    for i in 0..200 {
        let (node, budget) = (node.clone(), budget.clone());
        arrivals.push(tokio::spawn(async move {
            let id = format!("cmpl-{i}");
            let request = request(i);
            let reservation = budget.reserve(&id, &request).await?;
            let accept = Command::Accept {
                id,
                request,
                at_ms: now_ms(),
            };
            node.propose(accept, TIMEOUT).await.expect("accepted");
            drop(reservation);
            Ok::<usize, tessera_coordinator::error::CoordinatorError>(i)
        }));
    }
    let mut accepted = Vec::new();
    let mut refused = Vec::new();
    for arrival in arrivals {
        match arrival.await.expect("task") {
            Ok(i) => accepted.push(i),
            Err(error) => refused.push(error),
        }
    }
    let usage = node.journal_usage();
    // Each request counts about 16.7 KB: about 62 fit 1 MiB.
    assert!(usage.bytes <= limits.budget, "{usage:?}");
    assert_eq!(usage.open as usize, accepted.len());
    assert!((50..70).contains(&accepted.len()), "{}", accepted.len());
    let wire = tessera_comm::proto::WireError::from(refused.pop().expect("refusals"));
    assert_eq!(wire.class, tessera_comm::proto::ErrorClass::Unavailable);
    assert!(wire.message.contains("journal is full"), "{}", wire.message);

    // Half of them finish: the next request prunes them and finds room.
    for &i in &accepted[..accepted.len() / 2] {
        let finish = Command::Finish {
            id: format!("cmpl-{i}"),
            reason: Some(FinishReason::Length),
            at_ms: now_ms(),
        };
        node.propose(finish, TIMEOUT).await.expect("finished");
    }
    let reservation = budget.reserve("cmpl-late", &request(1_000)).await;
    assert!(reservation.is_ok(), "{reservation:?}");
    assert!(node.journal_usage().bytes <= limits.budget / 4 * 3);
    peers.stop_all().await;
}
