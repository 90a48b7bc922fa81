//! What the collective backends' tests share: settings, inputs, and the checks against a
//! sequential reference that every backend must pass. Each backend's test file runs them
//! through its own `on_ranks` (ranks as threads).

#![allow(dead_code)] // each test file uses its own subset

use std::net::TcpListener;
use std::thread;
use std::time::Duration;

use tessera_comm::collective::CollectiveConfig;
use tessera_comm::collective::tcp::TcpRing;
use tessera_comm::{Collective, CollectiveError, GroupToken};
use tessera_topology::Rank;

pub const SHORT: Duration = Duration::from_millis(300);
/// Slack for a loaded 2-core test machine on top of a deadline.
pub const MARGIN: Duration = Duration::from_millis(1500);

/// Lengths with remainders and one larger than a shared-memory slot.
pub const SIZES: [usize; 5] = [1, 7, 1000, 1001, (1 << 20) + 3];

pub fn config(deadline: Duration) -> CollectiveConfig {
    CollectiveConfig {
        deadline,
        ..CollectiveConfig::default()
    }
}

/// `world` loopback addresses with ports the OS just handed out.
pub fn loopback_peers(world: usize) -> Vec<String> {
    let listeners: Vec<_> = (0..world)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    listeners
        .iter()
        .map(|l| l.local_addr().unwrap().to_string())
        .collect()
}

/// Integer-valued data: every summation order gives the exact sum.
pub fn input(rank: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((i * 7 + rank * 13) % 101) as f32 - 50.0)
        .collect()
}

pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// What one rank runs in a check.
pub type Body<T> = Box<dyn Fn(&mut dyn Collective) -> T + Send + Sync>;

/// Every rank gets the exact sum, for world sizes 2–4 and every length of [`SIZES`].
pub fn all_reduce_matches_the_reference(run: impl Fn(usize, Body<Vec<f32>>) -> Vec<Vec<f32>>) {
    for world in [2, 3, 4] {
        for len in SIZES {
            let results = run(
                world,
                Box::new(move |c| {
                    let mut data = input(c.rank().0 as usize, len);
                    c.all_reduce_sum(&mut data).unwrap();
                    data
                }),
            );
            let mut expected = vec![0.0f32; len];
            for r in 0..world {
                expected
                    .iter_mut()
                    .zip(input(r, len))
                    .for_each(|(e, x)| *e += x);
            }
            for (r, got) in results.iter().enumerate() {
                assert!(got == &expected, "world {world} len {len} rank {r}");
            }
        }
    }
}

/// The f64 all-reduce: every rank gets the rank-order sum to the bit, for values no f32
/// holds (and a NaN's payload, an infinity), world sizes 2–4 and every length of
/// [`SIZES`].
pub fn all_reduce_f64_adds_in_rank_order(run: impl Fn(usize, Body<Vec<f64>>) -> Vec<Vec<f64>>) {
    let input = |rank: usize, len: usize| -> Vec<f64> {
        (0..len)
            .map(|i| match (i + rank) % 5 {
                0 => f64::from_bits(0x7ff8_0000_dead_beef),
                1 if rank == 1 => f64::INFINITY,
                _ => (1.0 + (i * 31 + rank * 7) as f64 * 1e-12) * 10f64.powi(rank as i32 * 9 - 9),
            })
            .collect()
    };
    for world in [2, 3, 4] {
        for len in SIZES {
            let results = run(
                world,
                Box::new(move |c| {
                    let mut data = input(c.rank().0 as usize, len);
                    c.all_reduce_sum_f64(&mut data).unwrap();
                    data
                }),
            );
            let inputs: Vec<Vec<f64>> = (0..world).map(|r| input(r, len)).collect();
            let expected: Vec<u64> = (0..len)
                .map(|i| (inputs.iter()).fold(0.0, |sum, x| sum + x[i]).to_bits())
                .collect();
            for (r, got) in results.iter().enumerate() {
                let got: Vec<u64> = got.iter().map(|v| v.to_bits()).collect();
                assert!(got == expected, "world {world} len {len} rank {r}");
            }
        }
    }
}

/// All-gather concatenates in rank order, broadcast copies the last rank's bytes, and
/// each call is counted once.
pub fn all_gather_and_broadcast_match_the_reference(
    run: impl Fn(usize, Body<(Vec<f32>, Vec<u8>, u64)>) -> Vec<(Vec<f32>, Vec<u8>, u64)>,
) {
    for world in [2, 3, 4] {
        for len in SIZES {
            let results = run(
                world,
                Box::new(move |c| {
                    let r = c.rank().0 as usize;
                    let mut out = vec![0.0; len * world];
                    c.all_gather(&input(r, len), &mut out).unwrap();
                    let mut bytes = vec![r as u8; len];
                    c.broadcast(&mut bytes, Rank(world as u32 - 1)).unwrap();
                    c.barrier().unwrap();
                    (out, bytes, c.stats().calls)
                }),
            );
            let expected: Vec<f32> = (0..world).flat_map(|r| input(r, len)).collect();
            for (out, bytes, calls) in results {
                assert!(out == expected, "world {world} len {len}");
                assert!(bytes.iter().all(|&b| b as usize == world - 1));
                assert_eq!(calls, 3);
            }
        }
    }
}

/// Runs `body` on `world` ranks, each a thread that first makes its communicator with
/// `join(rank)`; the results in rank order.
pub fn run_ranks<C, T>(
    world: usize,
    join: impl Fn(Rank) -> C + Send + Sync + 'static,
    body: impl Fn(C) -> T + Send + Sync + 'static,
) -> Vec<T>
where
    T: Send + 'static,
{
    let shared = std::sync::Arc::new((join, body));
    let handles: Vec<_> = (0..world)
        .map(|r| {
            let shared = std::sync::Arc::clone(&shared);
            thread::spawn(move || {
                let (join, body) = &*shared;
                body(join(Rank(r as u32)))
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank"))
        .collect()
}

/// Rank `r` joining the TCP ring of `peers` with `token`, in a thread of its own.
pub fn spawn_rank(
    r: u32,
    peers: &[String],
    token: &GroupToken,
    config: CollectiveConfig,
) -> thread::JoinHandle<Result<TcpRing, CollectiveError>> {
    let (peers, token) = (peers.to_vec(), token.clone());
    thread::spawn(move || TcpRing::connect(Rank(r), &peers, &token, config))
}
