//! The dequantizing matvecs of decode (`dequant_matmul.cu`) under the CPU emulation,
//! against the dequantized rows' dot products in f32, within the GPU test's 1e-4
//! (`gpu.rs`, `quantized_matvecs_match_the_cpu_dot_products`). The FP8, Q5_0, Q5_K and
//! Q6_K ones have not run on a GPU.

use rand::SeedableRng as _;
use rand::rngs::StdRng;
use tessera_kernels::DType;
use tessera_kernels::quant::dequantize_row;

use super::common::random_rows;
use super::{compiled, drive, f32s, within};

/// Q8_0, Q4_K, FP8, Q5_0, Q5_K and Q6_K rows (random blocks under moderate scales), 37
/// rows (a block's last warps idle) of 512 and 2,048 columns, 1 and 3 tokens.
#[test]
fn the_quantized_matvecs_emulated_are_the_dequantized_dots() {
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = compiled("matvec_main.cpp", dir.path()) else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(61);
    let types = [
        DType::Q8_0,
        DType::Q4K,
        DType::F8E4M3,
        DType::Q5_0,
        DType::Q5K,
        DType::Q6K,
    ];
    for (kernel, dtype) in types.into_iter().enumerate() {
        for (rows, cols, tokens) in [(37, 512, 3), (37, 2048, 1)] {
            let w = random_rows(&mut rng, dtype, rows, cols);
            let x = super::bf16_values(&mut rng, cols * tokens, 1.0);
            let row_bytes = w.len() / rows;
            let mut input = Vec::new();
            for word in [kernel, rows, cols, tokens, row_bytes] {
                input.extend((word as u32).to_le_bytes());
            }
            input.extend(&w);
            x.iter().for_each(|v| input.extend(v.to_le_bytes()));
            let got = f32s(&drive(&exe, dir.path(), &input));
            let mut want = Vec::with_capacity(rows * tokens);
            let mut row = vec![0.0f32; cols];
            for xt in x.chunks(cols) {
                for r in 0..rows {
                    dequantize_row(dtype, &w[r * row_bytes..][..row_bytes], &mut row).unwrap();
                    want.push(row.iter().zip(xt).map(|(a, b)| a * b).sum::<f32>());
                }
            }
            let what = format!("matvec {dtype} {rows}×{cols}, {tokens} tokens");
            let worst = within(&what, &got, &want, 1e-4);
            assert!(want.iter().any(|y| y.abs() > 0.1), "{what}: the draw");
            eprintln!("{what}: worst {worst:.2e} from the dequantized dots");
        }
    }
}
