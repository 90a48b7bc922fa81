//! The bf16 GEMV of small decode batches (`gemv.cu`) under the CPU emulation, against its
//! twin as the GPU test holds it (`gemv_case`): the bf16 products summed in f32 in column
//! order, within the GPU test's 1e-4 (relative, at least 1 in the denominator).

use std::path::Path;

use rand::SeedableRng as _;
use rand::rngs::StdRng;

use super::{bf16_values, compiled, drive, f32s, within};

/// `ys[t, r] = Σ_c W[r, c] · xs[t, c]`, each sum in f32 in column order.
fn twin(w: &[f32], xs: &[f32], (rows, cols): (usize, usize)) -> Vec<f32> {
    let mut ys = Vec::with_capacity(xs.len() / cols * rows);
    for x in xs.chunks(cols) {
        for row in w.chunks(cols) {
            ys.push(row.iter().zip(x).fold(0.0f32, |s, (a, b)| s + a * b));
        }
    }
    ys
}

/// The emulated GEMV of `tokens` rows of `xs` from `offset` on (`emu/gemv_main.cpp`).
fn run(exe: &Path, dir: &Path, w: &[f32], xs: &[f32], shape: [usize; 4]) -> Vec<f32> {
    let [rows, cols, tokens, offset] = shape;
    let mut input: Vec<u8> = Vec::new();
    shape
        .iter()
        .for_each(|&x| input.extend((x as u32).to_le_bytes()));
    let bits = w.iter().chain(&xs[..offset + tokens * cols]);
    bits.for_each(|&x| input.extend(half::bf16::from_f32(x).to_bits().to_le_bytes()));
    let bytes = drive(exe, dir, &input);
    assert_eq!(bytes.len(), tokens * rows * 4, "the emulator's output");
    f32s(&bytes)
}

/// 1 to 8 tokens on three shapes: whole 16-byte loads over 2,048 and 8,192 columns (rows
/// odd, so a block's second row is past the matrix), 577 columns (the 2-byte path), and an
/// input that starts 2 bytes past an alignment (the 2-byte path for aligned columns).
#[test]
fn the_gemv_emulated_is_its_twin() {
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = compiled("gemv_main.cpp", dir.path()) else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(53);
    for (rows, cols, offset) in [(37, 2048, 0), (9, 8192, 0), (101, 577, 0), (21, 2048, 1)] {
        let w = bf16_values(&mut rng, rows * cols, 0.1);
        let xs = bf16_values(&mut rng, offset + 8 * cols, 1.0);
        let want = twin(&w, &xs[offset..], (rows, cols));
        for tokens in 1..=8 {
            let got = run(&exe, dir.path(), &w, &xs, [rows, cols, tokens, offset]);
            let what = format!("gemv {rows}×{cols}, {tokens} tokens, offset {offset}");
            within(&what, &got, &want[..tokens * rows], 1e-4);
        }
        // Sanity of the draw: the sums are not all near zero.
        assert!(want.iter().any(|y| y.abs() > 0.1), "{rows}×{cols}");
    }
}
