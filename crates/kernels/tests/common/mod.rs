//! Test data shared by the integration tests: random weight rows and the batch-invariance
//! check that runs once per code path (AVX2 and scalar are separate test binaries, because
//! the path is chosen once per process).

#![allow(dead_code)] // each test binary uses its own part of this module

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tessera_kernels::DType;
use tessera_kernels::matmul::{MatRef, matmul, matmul_reference};
use tessera_kernels::quant::{dequantize_row, f16_scale_offsets, fp8};

/// Random stored rows of `dtype` with finite, moderate scales.
pub fn random_rows(rng: &mut StdRng, dtype: DType, rows: usize, cols: usize) -> Vec<u8> {
    let f16 = |v: f32| half::f16::from_f32(v).to_le_bytes();
    let row_bytes = dtype.row_bytes(cols).unwrap();
    let mut data = vec![0u8; rows * row_bytes];
    rng.fill(&mut data[..]);
    match dtype {
        DType::F32 => {
            for c in data.chunks_exact_mut(4) {
                c.copy_from_slice(&rng.random_range(-1.0f32..1.0).to_le_bytes());
            }
        }
        DType::F16 => {
            for c in data.chunks_exact_mut(2) {
                c.copy_from_slice(&f16(rng.random_range(-1.0..1.0)));
            }
        }
        DType::BF16 => {
            for c in data.chunks_exact_mut(2) {
                let v = half::bf16::from_f32(rng.random_range(-1.0..1.0));
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
        DType::F8E4M3 => {
            for block in data.chunks_exact_mut(dtype.block_bytes()) {
                fp8::make_finite(block, rng.random_range(0.0001..0.01));
            }
        }
        _ => {
            // Scale fields: d, and the min (or dmin) where the format has one.
            for block in data.chunks_exact_mut(dtype.block_bytes()) {
                let d = f16(rng.random_range(0.001..0.05));
                let m = f16(rng.random_range(-0.05..0.05));
                for (k, &at) in f16_scale_offsets(dtype).iter().enumerate() {
                    block[at..at + 2].copy_from_slice(if k == 0 { &d } else { &m });
                }
            }
        }
    }
    data
}

fn one_thread_pool() -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap()
}

/// A random case of `dtype`: rows, columns (whole blocks, up to 640 values; float types
/// any count, for SIMD tails), vectors (40 in case 0), the rows' bytes and the vectors.
fn random_case(
    rng: &mut StdRng,
    dtype: DType,
    case: usize,
) -> (usize, usize, usize, Vec<u8>, Vec<f32>) {
    let block = dtype.block_elems();
    let cols = block * rng.random_range(1..=(640 / block).max(2));
    let rows = rng.random_range(1..=70);
    let n = if case == 0 {
        40
    } else {
        rng.random_range(1..=40)
    };
    let data = random_rows(rng, dtype, rows, cols);
    let xs: Vec<f32> = (0..n * cols).map(|_| rng.random_range(-1.0..1.0)).collect();
    (rows, cols, n, data, xs)
}

/// `matmul` of random shapes and batches, for every dtype: each vector's result is the same
/// bits as the n = 1 product of that vector alone (computed on a one-thread pool, so with
/// another row split too), and within 1e-5 of Σ|w·x| of the f64 reference.
pub fn check_batch_invariance(seed: u64, cases_per_dtype: usize) {
    let mut rng = StdRng::seed_from_u64(seed);
    let one_thread = one_thread_pool();
    for dtype in DType::ALL {
        for case in 0..cases_per_dtype {
            let (rows, cols, n, data, xs) = random_case(&mut rng, dtype, case);
            let w = MatRef::new(dtype, rows, cols, &data).unwrap();
            let mut batched = vec![f32::NAN; n * rows];
            matmul(&w, &xs, &mut batched).unwrap();
            let mut want = vec![0.0; n * rows];
            matmul_reference(&w, &xs, &mut want).unwrap();
            let mut deq = vec![0.0; rows * cols];
            for (r, out) in deq.chunks_exact_mut(cols).enumerate() {
                dequantize_row(dtype, w.row(r), out).unwrap();
            }
            for (t, x) in xs.chunks_exact(cols).enumerate() {
                let mut alone = vec![f32::NAN; rows];
                one_thread.install(|| matmul(&w, x, &mut alone)).unwrap();
                let got = &batched[t * rows..(t + 1) * rows];
                for r in 0..rows {
                    let what = format!("{dtype} {rows}x{cols} n {n} vector {t} row {r}");
                    assert_eq!(
                        got[r].to_bits(),
                        alone[r].to_bits(),
                        "{what}: {} vs {}",
                        got[r],
                        alone[r]
                    );
                    let scale: f32 = deq[r * cols..(r + 1) * cols]
                        .iter()
                        .zip(x)
                        .map(|(a, b)| (a * b).abs())
                        .sum();
                    let reference = want[t * rows + r];
                    assert!(
                        (got[r] - reference).abs() <= 1e-5 * scale.max(1e-3),
                        "{what}: {} vs reference {reference}",
                        got[r]
                    );
                }
            }
        }
    }
}

/// [`check_batch_invariance`] in the `fast` precision, for every type with an 8-bit kernel:
/// each vector's result is the same bits batched or alone (on one thread), and the same
/// bits as the scalar reference of `cpu::int8` on the vector's 8-bit blocks; and within a
/// step of the 8-bit quantization of the exact product.
pub fn check_fast_batch_invariance(seed: u64, cases_per_dtype: usize) {
    use tessera_kernels::cpu::int8::{self, Q8Acts};
    use tessera_kernels::matmul::{Input, Precision, matmul_in, matmul_input};
    let mut rng = StdRng::seed_from_u64(seed);
    let one_thread = one_thread_pool();
    let dtypes = DType::ALL.into_iter().filter(|&d| int8::supports(d));
    for dtype in dtypes {
        for case in 0..cases_per_dtype {
            let (rows, cols, n, data, xs) = random_case(&mut rng, dtype, case);
            let w = MatRef::new(dtype, rows, cols, &data).unwrap();
            let mut batched = vec![f32::NAN; n * rows];
            matmul_in(&w, &xs, &mut batched, Precision::Fast).unwrap();
            // One input for two matmuls (as q, k and v share one): quantized once, the
            // same bits both times; a matmul of other columns on it is refused.
            let input = Input::new(&xs, Precision::Fast);
            for _ in 0..2 {
                let mut shared = vec![f32::NAN; n * rows];
                matmul_input(&w, &input, &mut shared).unwrap();
                assert!(
                    shared
                        .iter()
                        .zip(&batched)
                        .all(|(a, b)| a.to_bits() == b.to_bits())
                );
            }
            if cols > 32 && int8::supports(DType::Q8_0) {
                let other = MatRef::new(DType::Q8_0, 1, 32, &[0u8; 34]).unwrap();
                let mut y = vec![0.0; n * cols / 32];
                assert!(
                    matmul_input(&other, &input, &mut y).is_err(),
                    "{dtype} cols {cols}"
                );
            }
            drop(input);
            let mut exact = vec![f32::NAN; n * rows];
            matmul(&w, &xs, &mut exact).unwrap();
            for (t, x) in xs.chunks_exact(cols).enumerate() {
                let mut alone = vec![f32::NAN; rows];
                one_thread
                    .install(|| matmul_in(&w, x, &mut alone, Precision::Fast))
                    .unwrap();
                let acts = Q8Acts::quantize(x, cols).unwrap();
                for r in 0..rows {
                    let what = format!("{dtype} fast {rows}x{cols} n {n} vector {t} row {r}");
                    let got = batched[t * rows + r];
                    assert_eq!(
                        got.to_bits(),
                        alone[r].to_bits(),
                        "{what}: batched vs alone"
                    );
                    let reference = int8::dot_reference(dtype, w.row(r), acts.row(0)).unwrap();
                    assert_eq!(
                        got.to_bits(),
                        reference.to_bits(),
                        "{what}: vs the reference"
                    );
                    let mut deq = vec![0.0; cols];
                    dequantize_row(dtype, w.row(r), &mut deq).unwrap();
                    // Each activation moves by at most half a step: max|x| / 254 per block.
                    let bound: f32 = deq.iter().map(|v| v.abs()).sum::<f32>() / 254.0 * 1.01;
                    let diff = (got - exact[t * rows + r]).abs();
                    assert!(
                        diff <= bound + 1e-5,
                        "{what}: {got} vs exact {}",
                        exact[t * rows + r]
                    );
                }
            }
        }
    }
}

/// The worst of `got`'s errors from `want`, each relative to the wanted value (at least 1
/// in the denominator) and at most `tolerance`.
#[track_caller]
pub fn within(what: &str, got: &[f32], want: &[f32], tolerance: f32) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: values");
    let mut worst = 0.0f32;
    for (j, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs() / w.abs().max(1.0);
        assert!(
            err <= tolerance,
            "{what}[{j}]: {g} vs {w} (relative {err}, allowed {tolerance})"
        );
        worst = worst.max(err);
    }
    worst
}

/// The twin of `rmsnorm_residual_bf16` over `tokens` rows of `residual` (and `x`, added
/// first where given): the residual after the add, the bf16 output and the f32 one
/// (`fused::add_rms_norm_bf16`, row by row, eps 1e-5).
pub fn rmsnorm_bf16_twin(
    residual: &[f32],
    x: Option<&[f32]>,
    weight: &[f32],
) -> (Vec<f32>, Vec<u16>, Vec<f32>) {
    let hidden = weight.len();
    let mut res = residual.to_vec();
    let mut out16 = vec![0u16; residual.len()];
    let mut out32 = Vec::with_capacity(residual.len());
    for t in 0..residual.len() / hidden {
        let r = t * hidden..(t + 1) * hidden;
        out32.extend(tessera_kernels::fused::add_rms_norm_bf16(
            &mut res[r.clone()],
            x.map(|x| &x[r.clone()]),
            weight,
            1e-5,
            &mut out16[r],
        ));
    }
    (res, out16, out32)
}

/// Each bf16 of `got` is `want`'s or a neighbour (one unit in the last place); returns how
/// many were neighbours.
#[track_caller]
pub fn close_bf16(what: &str, got: &[u16], want: &[u16]) -> usize {
    assert_eq!(got.len(), want.len(), "{what}");
    // As a monotonic integer: negative values count down from zero.
    let ordered = |b: u16| {
        let m = i32::from(b & 0x7fff);
        if b & 0x8000 != 0 { -m } else { m }
    };
    let mut flipped = 0;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let d = (ordered(g) - ordered(w)).abs();
        assert!(d <= 1, "{what}[{i}]: bf16 {g:#06x} vs the twin's {w:#06x}");
        flipped += usize::from(d == 1);
    }
    eprintln!(
        "{what}: {} bf16 values, {flipped} rounded to the twin's neighbour",
        got.len()
    );
    flipped
}
