//! The shared-memory collective with ranks as threads: results against a sequential
//! reference, identical bits on every rank, deadlines, authentication and dropped peers.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use tessera_comm::collective::connect::connect;
use tessera_comm::collective::shm::ShmCollective;
use tessera_comm::collective::{CollectiveConfig, Op};
use tessera_comm::proto::{Bootstrap, Epoch};
use tessera_comm::{Collective, CollectiveError, GroupToken};
use tessera_topology::Rank;

use common::{MARGIN, SHORT, bits, config};

/// Small, so that the 1 Mi-element payloads below also exercise chunking.
const CAPACITY_ELEMS: usize = 64 * 1024;
fn unique_name(tag: &str) -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("tessera-test-{tag}-{}-{n}", std::process::id())
}

/// Runs `body` on one thread per rank, each with its own communicator.
fn on_ranks<T: Send + 'static>(
    world: usize,
    body: impl Fn(ShmCollective) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let name = unique_name("ops");
    let token = GroupToken([3; 32]);
    common::run_ranks(
        world,
        move |rank| {
            let deadline = config(Duration::from_secs(10));
            ShmCollective::join(&name, rank, world, &token, CAPACITY_ELEMS, deadline).expect("join")
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
fn all_reduce_adds_in_rank_order_with_identical_bits() {
    // Values whose sum depends on the order of addition, one-round and two-round sizes.
    for len in [5, 100_003] {
        let results = on_ranks(3, move |mut c| {
            let r = c.rank().0 as f32;
            let mut data: Vec<f32> = (0..len)
                .map(|i| [1e8 * (1.0 - r), 1.0 + r, 0.1 * r + i as f32 * 1e-3][i % 3])
                .collect();
            let once = {
                let mut d = data.clone();
                c.all_reduce_sum(&mut d).unwrap();
                d
            };
            for _ in 0..5 {
                c.all_reduce_sum(&mut data).unwrap();
                data.iter_mut().for_each(|x| *x /= 3.0);
            }
            (once, data)
        });
        for (once, data) in &results[1..] {
            assert_eq!(bits(once), bits(&results[0].0));
            assert_eq!(bits(data), bits(&results[0].1));
        }
        // ((1e8 + 0) + -1e8) in rank order.
        assert_eq!(results[0].0[0], (1e8f32 + 0.0) + -1e8);
        assert_eq!(results[0].0[1], 6.0);
    }
}

#[test]
fn all_gather_and_broadcast_match_the_reference() {
    common::all_gather_and_broadcast_match_the_reference(|world, body| {
        on_ranks(world, move |mut c| body(&mut c))
    });
}

#[test]
fn a_missing_rank_times_out_by_name_and_aborts_the_group() {
    let name = unique_name("timeout");
    let token = GroupToken([1; 32]);
    let joins: Vec<_> = (0..3u32)
        .map(|r| {
            let (name, token) = (name.clone(), token.clone());
            thread::spawn(move || {
                ShmCollective::join(&name, Rank(r), 3, &token, 1024, config(SHORT)).unwrap()
            })
        })
        .collect();
    let mut ranks: Vec<_> = joins.into_iter().map(|h| h.join().unwrap()).collect();
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
    assert!(
        errors.iter().any(|e| matches!(
            e,
            CollectiveError::Timeout {
                op: Op::AllReduce,
                missing: Rank(2),
                ..
            }
        )),
        "{errors:?}"
    );
    assert!(
        errors.iter().all(|e| matches!(
            e,
            CollectiveError::Timeout { .. } | CollectiveError::Aborted { .. }
        )),
        "{errors:?}"
    );
    // Whoever saw it first, every rank blames the one that did not arrive.
    assert!(
        errors.iter().all(|e| e.culprit() == Some(Rank(2))),
        "{errors:?}"
    );
    let started = Instant::now();
    let err = late.barrier().unwrap_err();
    assert!(
        matches!(
            err,
            CollectiveError::Aborted {
                op: Op::Barrier,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(started.elapsed() < SHORT);
}

#[test]
fn a_wrong_token_is_unauthenticated() {
    let name = unique_name("token");
    let good = {
        let name = name.clone();
        thread::spawn(move || {
            ShmCollective::join(&name, Rank(0), 2, &GroupToken([1; 32]), 64, config(SHORT))
        })
    };
    let bad = ShmCollective::join(&name, Rank(1), 2, &GroupToken([2; 32]), 64, config(SHORT));
    assert!(
        matches!(
            &bad,
            Err(CollectiveError::Unauthenticated { op: Op::Connect, peer: Rank(0), reason })
                if reason.contains("another group token")
        ),
        "{bad:?}"
    );
    let good = good.join().unwrap();
    assert!(
        matches!(
            good,
            Err(CollectiveError::Timeout {
                op: Op::Connect,
                missing: Rank(1),
                ..
            })
        ),
        "{good:?}"
    );
}

#[test]
fn a_dropped_peer_fails_the_others_without_waiting_for_the_deadline() {
    let long = Duration::from_secs(20);
    let name = unique_name("drop");
    let token = GroupToken([5; 32]);
    let peer = {
        let (name, token) = (name.clone(), token.clone());
        thread::spawn(move || {
            let mut c = ShmCollective::join(&name, Rank(1), 2, &token, 64, config(long)).unwrap();
            c.all_reduce_sum(&mut [1.0; 100]).unwrap();
            // Dropped mid-way: rank 0 makes a second call.
        })
    };
    let mut c = ShmCollective::join(&name, Rank(0), 2, &token, 64, config(long)).unwrap();
    let mut data = [2.0; 100];
    c.all_reduce_sum(&mut data).unwrap();
    assert_eq!(data, [3.0; 100]);
    peer.join().unwrap();
    let started = Instant::now();
    let err = c.all_reduce_sum(&mut data).unwrap_err();
    assert_eq!(
        err,
        CollectiveError::PeerClosed {
            op: Op::AllReduce,
            peer: Rank(1)
        }
    );
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

#[test]
fn connect_picks_the_backend_from_the_bootstrap() {
    let token = GroupToken([9; 32]);
    let mut solo = connect(
        &Bootstrap::Solo,
        Rank(0),
        1,
        &token,
        CollectiveConfig::default(),
    )
    .unwrap();
    let mut data = [1.5];
    solo.all_reduce_sum(&mut data).unwrap();
    assert_eq!(data, [1.5]);
    assert!(
        connect(
            &Bootstrap::Solo,
            Rank(0),
            2,
            &token,
            CollectiveConfig::default()
        )
        .is_err()
    );

    let bootstrap = Bootstrap::Shm {
        name: unique_name("connect"),
    };
    let other = {
        let (bootstrap, token) = (bootstrap.clone(), token.clone());
        thread::spawn(move || {
            let mut c =
                connect(&bootstrap, Rank(1), 2, &token, CollectiveConfig::default()).unwrap();
            let mut data = [2.0f32; 3];
            c.all_reduce_sum(&mut data).unwrap();
            data
        })
    };
    let mut c = connect(&bootstrap, Rank(0), 2, &token, CollectiveConfig::default()).unwrap();
    let mut data = [1.0f32; 3];
    c.all_reduce_sum(&mut data).unwrap();
    assert_eq!(data, [3.0; 3]);
    assert_eq!(other.join().unwrap(), [3.0; 3]);
}

/// Two clusters on one host may both have a group `g` in epoch 1: their segments must not
/// meet (seen failing with the name made of the group and the epoch only: one group's
/// rank 1 found the other's segment, "another group token").
#[test]
fn groups_named_alike_on_one_host_never_meet_and_leave_no_segment() {
    let groups: Vec<(Bootstrap, GroupToken)> = (0..2u8)
        .map(|g| (Bootstrap::shm("g", Epoch(1)), GroupToken([g + 1; 32])))
        .collect();
    assert_ne!(groups[0].0, groups[1].0);
    let join = |rank: u32, (bootstrap, token): &(Bootstrap, GroupToken)| {
        let (bootstrap, token) = (bootstrap.clone(), token.clone());
        thread::spawn(move || {
            let mut c = connect(&bootstrap, Rank(rank), 2, &token, config(SHORT))?;
            let mut data = [1.0f32 + rank as f32];
            c.all_reduce_sum(&mut data)?;
            Ok::<_, CollectiveError>((c, data[0]))
        })
    };
    // Both rank 0s create their segment before either rank 1 looks for one.
    let first: Vec<_> = groups.iter().map(|g| join(0, g)).collect();
    thread::sleep(Duration::from_millis(100));
    let second: Vec<_> = groups.iter().map(|g| join(1, g)).collect();
    let joined: Vec<_> = first
        .into_iter()
        .chain(second)
        .map(|h| h.join().unwrap().expect("every rank joins its own group"))
        .collect();
    assert!(joined.iter().all(|(_, sum)| *sum == 3.0));
    for (bootstrap, _) in &groups {
        let Bootstrap::Shm { name } = bootstrap else {
            unreachable!()
        };
        let path = std::path::Path::new("/dev/shm").join(name);
        assert!(!path.exists(), "{path:?} is removed once every rank joined");
    }
}
