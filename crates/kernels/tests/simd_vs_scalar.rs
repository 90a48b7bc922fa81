//! Every SIMD row-dot and the threaded matmul against the scalar references, for every
//! dtype, on random rows. Tolerance: relative 1e-5 of Σ|w·x| (f32 reassociation only).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tessera_kernels::DType;
use tessera_kernels::cpu::RowDot;
use tessera_kernels::matmul::{MatRef, matmul, matmul_reference};
use tessera_kernels::quant::{dequantize_row, dot_row};

mod common;
use common::random_rows;

#[test]
fn row_dot_matches_scalar_for_every_dtype() {
    let mut rng = StdRng::seed_from_u64(1);
    for dtype in DType::ALL {
        for cols in [256, 512, 1536] {
            let row = random_rows(&mut rng, dtype, 1, cols);
            let x: Vec<f32> = (0..cols).map(|_| rng.random_range(-2.0..2.0)).collect();
            let want = dot_row(dtype, &row, &x).unwrap();
            let got = RowDot::new(&x, dtype).dot(dtype, &row).unwrap();
            let mut w = vec![0.0; cols];
            dequantize_row(dtype, &row, &mut w).unwrap();
            let scale: f32 = w.iter().zip(&x).map(|(a, b)| (a * b).abs()).sum();
            assert!(
                (got - want).abs() <= 1e-5 * scale.max(1e-3),
                "{dtype} cols {cols}: simd {got} scalar {want}"
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
