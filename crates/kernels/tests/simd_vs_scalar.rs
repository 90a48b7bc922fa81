//! Every SIMD row-dot and the threaded matmul against the scalar references, for every
//! dtype, on random rows. Tolerance: relative 1e-5 of Σ|w·x| (f32 reassociation only).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tessera_kernels::DType;
use tessera_kernels::cpu::{Features, RowDot};
use tessera_kernels::matmul::{MatRef, matmul, matmul_reference};
use tessera_kernels::quant::{dequantize_row, dot_row, fp8};

mod common;
use common::random_rows;

/// The SIMD row-dot (AVX2 where the CPU has it) and the scalar reference against the f64 dot
/// of the dequantized row, for every dtype, on rows of 1, 2, 3, 8 and 17 blocks (odd counts
/// leave the last block of a pair alone). Tolerances, relative to Σ|w·x|: 1e-6 for the
/// scalar path (f64 sums, one rounding), 1e-5 for SIMD (f32 sums in another order).
#[test]
fn row_dot_simd_and_scalar_match_dequantize_then_dot() {
    if !Features::get().avx2 {
        eprintln!("this CPU has no AVX2: the SIMD side runs the scalar path");
    }
    let mut rng = StdRng::seed_from_u64(1);
    for dtype in DType::ALL {
        // Float types get 31-value "blocks", so that the SIMD tails are covered too.
        let block = if dtype.is_quantized() {
            dtype.block_elems()
        } else {
            31
        };
        for blocks in [1, 2, 3, 8, 17] {
            let cols = block * blocks;
            let row = random_rows(&mut rng, dtype, 1, cols);
            let x: Vec<f32> = (0..cols).map(|_| rng.random_range(-2.0..2.0)).collect();
            let mut w = vec![0.0; cols];
            dequantize_row(dtype, &row, &mut w).unwrap();
            let products = w.iter().zip(&x).map(|(a, b)| f64::from(*a) * f64::from(*b));
            let want: f64 = products.clone().sum();
            let scale: f64 = products.map(f64::abs).sum::<f64>().max(1e-3);
            let scalar = f64::from(dot_row(dtype, &row, &x).unwrap());
            let simd = f64::from(RowDot::new(&x, dtype).dot(dtype, &row).unwrap());
            assert!(
                (scalar - want).abs() <= 1e-6 * scale,
                "{dtype} cols {cols}: scalar {scalar} vs dequantized {want}"
            );
            assert!(
                (simd - want).abs() <= 1e-5 * scale,
                "{dtype} cols {cols}: simd {simd} vs dequantized {want} (scalar {scalar})"
            );
        }
    }
}

#[test]
fn row_dot_rejects_wrong_lengths() {
    let x = vec![0.0; 64];
    assert!(
        RowDot::new(&x, DType::Q4_0)
            .dot(DType::Q4_0, &[0u8; 35])
            .is_err()
    );
    assert!(
        RowDot::new(&x[..40], DType::Q8_0)
            .dot(DType::Q8_0, &[0u8; 34])
            .is_err()
    );
}

#[test]
fn threaded_matmul_matches_reference_for_one_and_many_tokens() {
    let mut rng = StdRng::seed_from_u64(2);
    let (rows, cols) = (200, 256);
    for dtype in DType::ALL {
        let data = random_rows(&mut rng, dtype, rows, cols);
        let w = MatRef::new(dtype, rows, cols, &data).unwrap();
        for n in [1, 5] {
            let xs: Vec<f32> = (0..n * cols).map(|_| rng.random_range(-1.0..1.0)).collect();
            let (mut got, mut want) = (vec![0.0; n * rows], vec![0.0; n * rows]);
            matmul(&w, &xs, &mut got).unwrap();
            matmul_reference(&w, &xs, &mut want).unwrap();
            for (a, b) in got.iter().zip(&want) {
                assert!(
                    (a - b).abs() <= 1e-4 * b.abs().max(1.0),
                    "{dtype} n {n}: {a} vs {b}"
                );
            }
        }
    }
}

/// Every e4m3fn code through the SIMD row-dot: a block of 32 copies of the code at scale
/// 0.5, dotted with a one-hot vector, is exactly half the code's value (and NaN for the two
/// NaN codes), as the scalar path gives. (-0 sums to 0: zeros compare equal.)
#[test]
fn every_fp8_code_dots_to_its_value() {
    let dtype = DType::F8E4M3;
    let mut x = vec![0.0f32; 32];
    x[0] = 1.0;
    let dot = RowDot::new(&x, dtype);
    for q in 0..=255u8 {
        let mut row = vec![0u8; dtype.row_bytes(32).unwrap()];
        fp8::pack_row(&[q; 32], 0.5, &mut row).unwrap();
        let want = 0.5 * fp8::E4M3[q as usize];
        for (path, got) in [
            ("simd", dot.dot(dtype, &row).unwrap()),
            ("scalar", dot_row(dtype, &row, &x).unwrap()),
        ] {
            assert!(
                got == want || (got.is_nan() && want.is_nan()),
                "{path}: code {q:#04x} gives {got}, not {want}"
            );
        }
    }
}
