//! Block allocator operations per second: allocate + release of a sequence's blocks, and
//! admission of a prompt whose prefix is cached (hash the chain, take references).

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use tessera_shard::blocks::{BlockAllocator, BlockId};

fn allocator(c: &mut Criterion) {
    let mut g = c.benchmark_group("blocks");
    g.throughput(Throughput::Elements(64));
    let mut a = BlockAllocator::new(65_536, 16);
    g.bench_function("allocate+release 64 blocks", |b| {
        b.iter(|| {
            let blocks: Vec<BlockId> = (0..64).map(|_| a.allocate().expect("room")).collect();
            a.release(black_box(&blocks));
        });
    });
    // A 1,024-token prompt (64 full blocks) registered once, then looked up.
    let prompt: Vec<u32> = (0..1024).map(|t| t * 7 % 32_000).collect();
    let mut held = Vec::new();
    let mut parent = 0;
    for chunk in prompt.chunks_exact(16) {
        let b = a.allocate().expect("room");
        parent = a.register(b, parent, chunk);
        held.push(b);
    }
    g.bench_function("acquire_prefix of 64 cached blocks", |b| {
        b.iter(|| {
            let (blocks, _) = a.acquire_prefix(black_box(&prompt));
            assert_eq!(blocks.len(), 64);
            a.release(&blocks);
        });
    });
    g.finish();
}

criterion_group!(benches, allocator);
criterion_main!(benches);
