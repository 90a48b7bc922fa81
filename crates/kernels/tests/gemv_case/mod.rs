//! The bf16 GEMV of small decode batches (`gemv.cu`, `Ops::gemv_bf16`) against its CPU
//! twin and against cuBLAS (`Blas::gemm_bf16`) on the same inputs, part of the `gpu` test
//! binary. The twin multiplies the bf16 values as f32 (exact: 8-bit significands) and
//! sums them in f32 in column order; the kernel sums in another order, so the two differ
//! by rounding, which grows with the column count: weights of ±0.1 (a trained model's
//! scale) and activations of ±1 keep that under the cuBLAS test's 1e-4 (relative, at
//! least 1 in the denominator) for 8,192 columns, while a missed or doubled 8-column step
//! would be off by about 1e-1.

use rand::SeedableRng as _;
use rand::rngs::StdRng;
use tessera_kernels::cuda::{Blas, GEMV_MAX_TOKENS};

use super::{close, device, ops, random, rounded, to_bf16};

/// The tolerance of the comparisons, the cuBLAS GEMM test's.
const GEMV_TOLERANCE: f32 = 1e-4;

/// Llama-3.2-1B's projections at tp = 1 (hidden 2,048, 32 query heads and 8 KV heads of
/// 64, inter 8,192), rows × cols: q|k|v stacked, o, gate|up stacked, down, and 4,099 rows
/// of the LM head (its 128,256 would make a slow test; 4,099 is not a multiple of the 2
/// rows of a block); then 1,001 × 577, which takes the 2-byte path (577 columns are not
/// whole 16-byte loads).
const SHAPES: [(&str, usize, usize); 6] = [
    ("q|k|v", 3072, 2048),
    ("o", 2048, 2048),
    ("gate|up", 16384, 2048),
    ("down", 2048, 8192),
    ("lm-head slice", 4099, 2048),
    ("odd", 1001, 577),
];

/// `ys[t, r] = Σ_c W[r, c] · xs[t, c]` over bf16-rounded `w` and `xs` (as f32), each
/// sum in f32 in column order.
fn twin(w: &[f32], xs: &[f32], (rows, cols): (usize, usize)) -> Vec<f32> {
    let tokens = xs.len() / cols;
    let mut ys = vec![0.0f32; tokens * rows];
    for (t, x) in xs.chunks(cols).enumerate() {
        for (r, row) in w.chunks(cols).enumerate() {
            ys[t * rows + r] = row.iter().zip(x).fold(0.0f32, |s, (a, b)| s + a * b);
        }
    }
    ys
}

#[test]
fn gemv_matches_its_twin_and_cublas_on_the_llama_1b_projections() {
    let Some(dev) = device() else { return };
    let ops = ops(&dev);
    let blas = Blas::new(0, ops.stream().clone()).unwrap();
    let mut rng = StdRng::seed_from_u64(31);
    for (name, rows, cols) in SHAPES {
        let w = rounded(&random(&mut rng, rows * cols, 0.1));
        let xs = rounded(&random(&mut rng, GEMV_MAX_TOKENS * cols, 1.0));
        // A batch of t tokens is the first t rows: its sums are the first t of the twin's.
        let want = twin(&w, &xs, (rows, cols));
        let w_dev = ops.upload(&to_bf16(&w)).unwrap();
        let xs_dev = ops.upload(&to_bf16(&xs)).unwrap();
        for tokens in 1..=GEMV_MAX_TOKENS {
            let x = xs_dev.slice(..tokens * cols);
            let mut y = ops.alloc::<f32>(tokens * rows).unwrap();
            let before = ops.launches();
            ops.gemv_bf16(&mut y, &w_dev, &x, (rows, cols)).unwrap();
            assert_eq!(ops.launches(), before + 1, "one launch");
            let got = ops.download(&y).unwrap();
            let what = format!("gemv {name} {rows}×{cols}, {tokens} tokens");
            close(&what, &got, &want[..tokens * rows], GEMV_TOLERANCE);
            let mut by_cublas = ops.alloc::<f32>(tokens * rows).unwrap();
            blas.gemm_bf16(&ops, &mut by_cublas, &w_dev, &x, (rows, cols))
                .unwrap();
            let cublas = ops.download(&by_cublas).unwrap();
            close(&format!("{what} vs cuBLAS"), &got, &cublas, GEMV_TOLERANCE);
        }
    }
}

#[test]
fn gemv_takes_the_two_byte_path_for_an_unaligned_input_view() {
    let Some(dev) = device() else { return };
    let ops = ops(&dev);
    let mut rng = StdRng::seed_from_u64(32);
    let (rows, cols, tokens) = (2048, 2048, 3);
    let w = rounded(&random(&mut rng, rows * cols, 0.1));
    // One value in front: the view starts 2 bytes past a 16-byte boundary.
    let xs = rounded(&random(&mut rng, 1 + tokens * cols, 1.0));
    let want = twin(&w, &xs[1..], (rows, cols));
    let w_dev = ops.upload(&to_bf16(&w)).unwrap();
    let xs_dev = ops.upload(&to_bf16(&xs)).unwrap();
    let mut y = ops.alloc::<f32>(tokens * rows).unwrap();
    ops.gemv_bf16(&mut y, &w_dev, &xs_dev.slice(1..), (rows, cols))
        .unwrap();
    let got = ops.download(&y).unwrap();
    close("gemv, unaligned input", &got, &want, GEMV_TOLERANCE);
}

#[test]
fn gemv_refuses_a_wrong_shape_before_launching() {
    let Some(dev) = device() else { return };
    let ops = ops(&dev);
    let (rows, cols) = (16, 64);
    let w = ops.alloc::<u16>(rows * cols).unwrap();
    let mut y = ops.alloc::<f32>(9 * rows).unwrap();
    let xs = ops.alloc::<u16>(9 * cols).unwrap();
    let err = ops.gemv_bf16(&mut y, &w, &xs, (rows, cols)).unwrap_err();
    assert!(err.to_string().contains("9 tokens"), "{err}");
    let err = ops
        .gemv_bf16(&mut y, &w, &xs.slice(..2 * cols), (rows, cols))
        .unwrap_err();
    assert!(err.to_string().contains("projection output"), "{err}");
    assert_eq!(ops.launches(), 0);
}
