//! Decode-shaped matvec throughput per weight type, reported as GB/s of weights streamed
//! (criterion's bytes throughput = the matrix's stored size). Shapes are SmolLM2-135M's
//! MLP (1536 × 576) and a Llama-7B-sized projection (4096 × 4096).
//!
//! Run: `cargo bench -p tessera-kernels --bench matvec` (single thread unless
//! `RAYON_NUM_THREADS` says otherwise).

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tessera_kernels::DType;
use tessera_kernels::matmul::{Input, MatRef, Precision, matmul, matmul_in, matmul_input_wide};
use tessera_kernels::quant::{f16_scale_offsets, fp8};

fn random_matrix(dtype: DType, rows: usize, cols: usize) -> Vec<u8> {
    let mut rng = StdRng::seed_from_u64(7);
    let mut data = vec![0u8; rows * dtype.row_bytes(cols).expect("whole blocks")];
    rng.fill(&mut data[..]);
    // Keep every scale a small finite f16 / every float finite: clear the exponent's top bits.
    let step = dtype.block_bytes();
    for chunk in data.chunks_exact_mut(step) {
        let last = chunk.len() - 1;
        match dtype {
            DType::F32 => chunk[last] &= 0x3f,
            DType::F16 | DType::BF16 => chunk[last] &= 0x3b,
            DType::F8E4M3 => fp8::make_finite(chunk, 0.01),
            _ => {
                for &at in f16_scale_offsets(dtype) {
                    chunk[at + 1] &= 0x1f;
                }
            }
        }
    }
    data
}

fn bench_matvec(c: &mut Criterion) {
    let mut group = c.benchmark_group("matvec");
    for (rows, cols) in [(1536usize, 576usize), (4096, 4096)] {
        for dtype in DType::ALL {
            // Rows are whole blocks: no 256-value types (K-quants, IQ4_XS) at 576 columns.
            if !cols.is_multiple_of(dtype.block_elems()) {
                continue;
            }
            let data = random_matrix(dtype, rows, cols);
            let w = MatRef::new(dtype, rows, cols, &data).expect("sizes match");
            let x: Vec<f32> = (0..cols).map(|i| (i % 17) as f32 / 17.0 - 0.5).collect();
            let mut y = vec![0.0; rows];
            group.throughput(Throughput::Bytes(data.len() as u64));
            group.bench_with_input(
                BenchmarkId::new(dtype.name(), format!("{rows}x{cols}")),
                &(),
                |b, _| b.iter(|| matmul(&w, &x, &mut y).expect("sizes match")),
            );
            // The `fast` precision (8-bit activations), where the type has its kernel.
            if Precision::Fast.quantizes(dtype, cols) {
                group.bench_with_input(
                    BenchmarkId::new(format!("{}-fast", dtype.name()), format!("{rows}x{cols}")),
                    &(),
                    |b, _| {
                        b.iter(|| matmul_in(&w, &x, &mut y, Precision::Fast).expect("sizes match"))
                    },
                );
                // Summed in f64, as a row-parallel projection (o, down) is in `fast`.
                let mut wide = vec![0.0f64; rows];
                group.bench_with_input(
                    BenchmarkId::new(
                        format!("{}-fast-wide", dtype.name()),
                        format!("{rows}x{cols}"),
                    ),
                    &(),
                    |b, _| {
                        b.iter(|| {
                            let input = Input::new(&x, Precision::Fast);
                            matmul_input_wide(&w, &input, &mut wide).expect("sizes match")
                        })
                    },
                );
            }
        }
    }
    group.finish();
}

criterion_group!(benches, bench_matvec);
criterion_main!(benches);
