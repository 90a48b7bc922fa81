//! All-reduce latency and bandwidth of the CPU collectives, ranks on threads of this
//! process: shared memory and the TCP ring over loopback, 2 and 4 ranks, 1 KiB … 16 MiB.
//!
//! The bench thread is rank 0. The other ranks loop: receive an iteration count by
//! broadcast from rank 0, run that many all-reduces, repeat; a count of 0 stops them. So a
//! measured batch is only all-reduces, and one broadcast per batch is not timed.
//!
//! Run: `cargo bench -p tessera-comm --bench collective`. On a machine with fewer cores
//! than ranks the figures include time the ranks wait for a core.

use std::hint::black_box;
use std::net::TcpListener;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use tessera_comm::collective::CollectiveConfig;
use tessera_comm::collective::connect::SHM_CAPACITY_ELEMS;
use tessera_comm::collective::shm::ShmCollective;
use tessera_comm::collective::tcp::TcpRing;
use tessera_comm::{Collective, GroupToken};
use tessera_topology::Rank;

const SIZES_BYTES: [usize; 4] = [1 << 10, 64 << 10, 1 << 20, 16 << 20];

fn config() -> CollectiveConfig {
    CollectiveConfig {
        deadline: Duration::from_secs(60),
        ..CollectiveConfig::default()
    }
}

#[derive(Clone, Copy, Debug)]
enum Backend {
    Shm,
    Tcp,
}

/// One communicator per rank, built on their own threads (joining blocks until all join).
fn group(backend: Backend, world: usize) -> Vec<Box<dyn Collective>> {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let token = GroupToken::random();
    let name = format!(
        "tessera-bench-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    );
    let peers: Vec<String> = {
        let listeners: Vec<_> = (0..world)
            .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind"))
            .collect();
        listeners
            .iter()
            .map(|l| l.local_addr().expect("addr").to_string())
            .collect()
    };
    let handles: Vec<_> = (0..world)
        .map(|r| {
            let (token, name, peers) = (token.clone(), name.clone(), peers.clone());
            thread::spawn(move || -> Box<dyn Collective> {
                let rank = Rank(r as u32);
                match backend {
                    Backend::Shm => Box::new(
                        ShmCollective::join(
                            &name,
                            rank,
                            world,
                            &token,
                            SHM_CAPACITY_ELEMS,
                            config(),
                        )
                        .expect("join"),
                    ),
                    Backend::Tcp => {
                        Box::new(TcpRing::connect(rank, &peers, &token, config()).expect("connect"))
                    }
                }
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank"))
        .collect()
}

/// The loop of a rank other than 0.
fn follow(mut c: Box<dyn Collective>, len: usize) {
    let mut data = vec![1.0f32; len];
    loop {
        let mut count = [0u8; 8];
        c.broadcast(&mut count, Rank(0)).expect("broadcast");
        let iters = u64::from_le_bytes(count);
        if iters == 0 {
            return;
        }
        for _ in 0..iters {
            c.all_reduce_sum(&mut data).expect("all-reduce");
        }
    }
}

fn bench_all_reduce(c: &mut Criterion) {
    let mut g = c.benchmark_group("all_reduce");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    for backend in [Backend::Shm, Backend::Tcp] {
        for world in [2, 4] {
            for bytes in SIZES_BYTES {
                let len = bytes / 4;
                let mut ranks = group(backend, world).into_iter();
                let mut lead = ranks.next().expect("rank 0");
                let followers: Vec<_> = ranks
                    .map(|c| thread::spawn(move || follow(c, len)))
                    .collect();
                let mut data = vec![1.0f32; len];
                g.throughput(Throughput::Bytes(bytes as u64));
                let id = BenchmarkId::new(format!("{backend:?}/{world}"), bytes);
                g.bench_function(id, |b| {
                    b.iter_custom(|iters| {
                        lead.broadcast(&mut iters.to_le_bytes(), Rank(0))
                            .expect("broadcast");
                        let started = Instant::now();
                        for _ in 0..iters {
                            lead.all_reduce_sum(black_box(&mut data))
                                .expect("all-reduce");
                        }
                        started.elapsed()
                    });
                });
                lead.broadcast(&mut 0u64.to_le_bytes(), Rank(0))
                    .expect("stop");
                followers
                    .into_iter()
                    .for_each(|f| f.join().expect("follower"));
            }
        }
    }
    g.finish();
}

criterion_group!(benches, bench_all_reduce);
criterion_main!(benches);
