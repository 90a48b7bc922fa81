//! The TCP ring with ranks as threads on loopback: results against a sequential reference,
//! identical bits on every rank, deadlines, authentication and dropped peers.

mod common;

use std::thread;
use std::time::{Duration, Instant};

use tessera_comm::collective::Op;
use tessera_comm::collective::tcp::TcpRing;
use tessera_comm::{Collective, CollectiveError, GroupToken};
use tessera_topology::Rank;

use common::{MARGIN, SHORT, bits, config, loopback_peers as peers, spawn_rank};

fn on_ranks<T: Send + 'static>(
    world: usize,
    body: impl Fn(TcpRing) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let peers = peers(world);
    let token = GroupToken([3; 32]);
    common::run_ranks(
        world,
        move |rank| {
            TcpRing::connect(rank, &peers, &token, config(Duration::from_secs(10)))
                .expect("connect")
        },
        body,
    )
}

#[test]
fn all_reduce_matches_the_reference_on_every_rank() {
    common::all_reduce_matches_the_reference(|world, body| {
        on_ranks(world, move |mut c| body(&mut c))
    });
}

#[test]
fn all_reduce_f64_adds_every_bit_in_rank_order() {
    common::all_reduce_f64_adds_in_rank_order(|world, body| {
        on_ranks(world, move |mut c| body(&mut c))
    });
}

#[test]
fn all_reduce_gives_identical_bits_on_every_rank() {
    let results = on_ranks(4, |mut c| {
        let r = c.rank().0 as f32;
        let mut data: Vec<f32> = (0..1003)
            .map(|i| [1e8 * (1.0 - r), 1.0 + r, 0.1 * r + i as f32 * 1e-3][i % 3])
            .collect();
        for _ in 0..5 {
            c.all_reduce_sum(&mut data).unwrap();
            data.iter_mut().for_each(|x| *x /= 3.0);
        }
        data
    });
    for data in &results[1..] {
        assert_eq!(bits(data), bits(&results[0]));
    }
}

#[test]
fn all_gather_and_broadcast_match_the_reference() {
    common::all_gather_and_broadcast_match_the_reference(|world, body| {
        on_ranks(world, move |mut c| body(&mut c))
    });
}

#[test]
fn a_missing_rank_times_out_by_name() {
    let (peers, token) = (peers(3), GroupToken([1; 32]));
    let joins: Vec<_> = (0..3)
        .map(|r| spawn_rank(r, &peers, &token, config(SHORT)))
        .collect();
    let mut ranks: Vec<_> = joins
        .into_iter()
        .map(|h| h.join().unwrap().unwrap())
        .collect();
    let mut late = ranks.pop().unwrap();
    let started = Instant::now();
    let waiters: Vec<_> = ranks
        .into_iter()
        .map(|mut c| thread::spawn(move || (c.all_reduce_sum(&mut [1.0; 10]), c)))
        .collect();
    let errors: Vec<_> = waiters
        .into_iter()
        .map(|h| h.join().unwrap().0.unwrap_err())
        .collect();
    assert!(
        started.elapsed() < SHORT + MARGIN,
        "{:?}",
        started.elapsed()
    );
    // Rank 0 receives from rank 2, which never sends.
    assert!(
        matches!(
            errors[0],
            CollectiveError::Timeout {
                op: Op::AllReduce,
                missing: Rank(2),
                ..
            }
        ),
        "{errors:?}"
    );
    assert!(errors[1].culprit().is_some(), "{errors:?}");
    // The late rank finds the ring closed at once.
    let started = Instant::now();
    assert!(late.barrier().is_err());
    assert!(started.elapsed() < MARGIN);
}

#[test]
fn a_wrong_token_is_refused_by_both_sides_by_the_deadline() {
    let peers = peers(2);
    let started = Instant::now();
    let good = spawn_rank(0, &peers, &GroupToken([1; 32]), config(SHORT));
    let bad = spawn_rank(1, &peers, &GroupToken([2; 32]), config(SHORT));
    for (result, other) in [(good.join().unwrap(), 1), (bad.join().unwrap(), 0)] {
        // Each refuses the other's proof.
        assert!(
            matches!(
                &result,
                Err(CollectiveError::Unauthenticated { op: Op::Connect, peer, reason })
                    if *peer == Rank(other) && reason.contains("failed to prove the group token")
            ),
            "{result:?}"
        );
    }
    assert!(
        started.elapsed() < SHORT + MARGIN,
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn a_rank_that_never_listens_times_out_by_name() {
    let peers = peers(2);
    let started = Instant::now();
    let result = TcpRing::connect(Rank(0), &peers, &GroupToken([1; 32]), config(SHORT));
    assert!(
        matches!(
            result,
            Err(CollectiveError::Timeout {
                op: Op::Connect,
                missing: Rank(1),
                ..
            })
        ),
        "{result:?}"
    );
    assert!(started.elapsed() < SHORT + MARGIN);
}

#[test]
fn a_dropped_peer_fails_the_others_without_a_hang() {
    let long = Duration::from_secs(20);
    let (peers, token) = (peers(3), GroupToken([5; 32]));
    let joins: Vec<_> = (0..3)
        .map(|r| spawn_rank(r, &peers, &token, config(long)))
        .collect();
    let mut ranks: Vec<_> = joins
        .into_iter()
        .map(|h| h.join().unwrap().unwrap())
        .collect();
    let dropped = ranks.pop().unwrap();
    let started = Instant::now();
    let workers: Vec<_> = ranks
        .into_iter()
        .map(|mut c| thread::spawn(move || c.all_reduce_sum(&mut vec![1.0; 100_000])))
        .collect();
    thread::sleep(Duration::from_millis(20));
    drop(dropped);
    for w in workers {
        let err = w.join().unwrap().unwrap_err();
        assert!(
            matches!(
                err,
                CollectiveError::PeerClosed { .. } | CollectiveError::Aborted { .. }
            ),
            "{err:?}"
        );
    }
    assert!(started.elapsed() < MARGIN);
}

#[test]
fn mismatched_calls_are_refused() {
    let results = on_ranks(2, |mut c| {
        let mut data = vec![0.0; 2 + c.rank().0 as usize];
        c.all_reduce_sum(&mut data)
    });
    assert!(
        results
            .iter()
            .any(|r| matches!(r, Err(CollectiveError::BadLength { .. }))),
        "{results:?}"
    );
    assert!(results.iter().all(Result::is_err), "{results:?}");
}
