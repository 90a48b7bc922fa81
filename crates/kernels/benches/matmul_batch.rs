//! Batched matmul (continuous batching: n activation vectors through one projection) against
//! two baselines, for SmolLM2-135M-sized projections (1536 × 576 and 576 × 1536) in Q4_1 and
//! F32, n = 1, 8, 32, 256:
//!
//! - `matmul`: the batch-invariant kernel ([`tessera_kernels::matmul::matmul`]).
//! - `n_matvecs`: n separate n = 1 calls, what batching must beat.
//! - `gemm`: the former n > 1 path — dequantize the matrix to f32, then the `gemm` crate's
//!   cache-blocked product. Faster for large n on f32 weights, but its results depend on n.
//!
//! Throughput is in multiply-adds (n · rows · cols elements). Run:
//! `RAYON_NUM_THREADS=1 cargo bench -p tessera-kernels --bench matmul_batch`.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::time::Duration;
use tessera_kernels::DType;
use tessera_kernels::matmul::{MatRef, matmul};
use tessera_kernels::quant::dequantize_row;

/// Random stored rows with small finite scales (and finite floats).
fn random_matrix(dtype: DType, rows: usize, cols: usize) -> Vec<u8> {
    let mut rng = StdRng::seed_from_u64(7);
    let mut data = vec![0u8; rows * dtype.row_bytes(cols).expect("whole blocks")];
    rng.fill(&mut data[..]);
    for chunk in data.chunks_exact_mut(dtype.block_bytes()) {
        match dtype {
            DType::F32 => chunk[3] &= 0x3f,
            _ => {
                chunk[1] &= 0x1f;
                chunk[3] &= 0x1f;
            }
        }
    }
    data
}

/// The former `n > 1` path: the whole matrix dequantized to f32, then one `gemm` call.
fn dequantize_gemm(w: &MatRef<'_>, xs: &[f32], ys: &mut [f32], tile: &mut [f32]) {
    let (rows, cols) = (w.rows(), w.cols());
    let n = xs.len() / cols;
    assert_eq!(tile.len(), rows * cols);
    assert_eq!(ys.len(), n * rows);
    for (r, row) in tile.chunks_exact_mut(cols).enumerate() {
        dequantize_row(w.dtype(), w.row(r), row).expect("sizes match");
    }
    let threads = rayon::current_num_threads();
    let parallelism = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: dst is `ys` (n × rows, row-major), lhs `xs` (n × cols, row-major), rhs the
    // tile transposed ((k, r) at r·cols + k, inside rows × cols); all sizes asserted above,
    // no overlap, `read_dst` false.
    unsafe {
        gemm::gemm(
            n,
            rows,
            cols,
            ys.as_mut_ptr(),
            1,
            rows as isize,
            false,
            xs.as_ptr(),
            1,
            cols as isize,
            tile.as_ptr(),
            cols as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
}

fn bench_matmul_batch(c: &mut Criterion) {
    let mut group = c.benchmark_group("matmul_batch");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    for (rows, cols) in [(1536, 576), (576, 1536)] {
        for dtype in [DType::Q4_1, DType::F32] {
            let data = random_matrix(dtype, rows, cols);
            let w = MatRef::new(dtype, rows, cols, &data).expect("sizes match");
            let mut tile = vec![0.0f32; rows * cols];
            for n in [1, 8, 32, 256] {
                let mut rng = StdRng::seed_from_u64(n as u64);
                let xs: Vec<f32> = (0..n * cols).map(|_| rng.random_range(-1.0..1.0)).collect();
                let mut ys = vec![0.0; n * rows];
                let id = |what: &str| BenchmarkId::new(format!("{dtype}/{rows}x{cols}/{what}"), n);
                group.throughput(Throughput::Elements((n * rows * cols) as u64));
                group.bench_function(id("matmul"), |b| {
                    b.iter(|| matmul(&w, &xs, &mut ys).expect("sizes match"))
                });
                if n > 1 {
                    group.bench_function(id("n_matvecs"), |b| {
                        b.iter(|| {
                            for (x, y) in xs.chunks_exact(cols).zip(ys.chunks_exact_mut(rows)) {
                                matmul(&w, x, y).expect("sizes match");
                            }
                        })
                    });
                }
                group.bench_function(id("gemm"), |b| {
                    b.iter(|| dequantize_gemm(&w, &xs, &mut ys, &mut tile))
                });
            }
        }
    }
    group.finish();
}

criterion_group!(benches, bench_matmul_batch);
criterion_main!(benches);
