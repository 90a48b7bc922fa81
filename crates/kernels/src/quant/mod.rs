//! GGML block formats: byte layouts, dequantization, and the scalar reference dot product.
//!
//! This module owns the meaning of the bytes of a weight row in every [`DType`]: the layouts
//! of Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS exactly
//! as GGML defines them (`ggml-common.h`, and gguf-py's `quants.py`, which the fixture tests
//! compare against bit for bit), the float types F32, F16 and BF16 seen as one-value
//! blocks, and Tessera's FP8 blocks ([`fp8`]).
//!
//! - [`dequantize_row`]: one stored row to f32.
//! - [`dot_row`]: one stored row · an f32 vector, block by block ([`dot_rows`]: · several
//!   vectors, each block dequantized once for all). This is the plain scalar
//!   reference that the SIMD kernels are tested against: it accumulates in f64, so its own
//!   rounding error is far below any f32 kernel's.
//! - Per-format block functions and layout constants, public so SIMD kernels reuse them:
//!   [`float`], [`q8_0`], [`q4`] (Q4_0, Q4_1), [`q5`] (Q5_0, Q5_1), [`k_quants`] (Q4_K,
//!   Q5_K, Q6_K), [`k_quants_small`] (Q2_K, Q3_K), [`iq4`] (IQ4_NL, IQ4_XS), [`fp8`].
//!
//! Nothing here allocates.

pub mod float;
pub mod fp8;
pub mod iq4;
pub mod k_quants;
pub mod k_quants_small;
pub mod q4;
pub mod q5;
pub mod q8_0;

pub use fp8::dequantize_block_f8_e4m3;
pub use iq4::{dequantize_block_iq4_nl, dequantize_block_iq4_xs};
pub use k_quants::{dequantize_block_q4_k, dequantize_block_q5_k, dequantize_block_q6_k};
pub use k_quants_small::{dequantize_block_q2_k, dequantize_block_q3_k};
pub use q4::{dequantize_block_q4_0, dequantize_block_q4_1};
pub use q5::{dequantize_block_q5_0, dequantize_block_q5_1};
pub use q8_0::{dequantize_block_q8_0, quantize_block_q8_0, quantize_row_q8_0};

use crate::DType;
use crate::error::KernelError;

/// Dequantizes one stored row of `dtype` into `dst`; `dst.len()` is the number of values.
///
/// Fails when `dst.len()` is not a whole number of blocks or when `src` is not exactly the
/// row's size in bytes.
pub fn dequantize_row(dtype: DType, src: &[u8], dst: &mut [f32]) -> Result<(), KernelError> {
    check_row_bytes(dtype, src.len(), dst.len(), "dequantize_row source")?;
    match dtype {
        DType::F32 => dequantize_blocks(src, dst, float::dequantize_block_f32),
        DType::F16 => dequantize_blocks(src, dst, float::dequantize_block_f16),
        DType::BF16 => dequantize_blocks(src, dst, float::dequantize_block_bf16),
        DType::Q8_0 => dequantize_blocks(src, dst, dequantize_block_q8_0),
        DType::Q4_0 => dequantize_blocks(src, dst, dequantize_block_q4_0),
        DType::Q4_1 => dequantize_blocks(src, dst, dequantize_block_q4_1),
        DType::Q4K => dequantize_blocks(src, dst, dequantize_block_q4_k),
        DType::Q6K => dequantize_blocks(src, dst, dequantize_block_q6_k),
        DType::Q5_0 => dequantize_blocks(src, dst, dequantize_block_q5_0),
        DType::Q5_1 => dequantize_blocks(src, dst, dequantize_block_q5_1),
        DType::Q5K => dequantize_blocks(src, dst, dequantize_block_q5_k),
        DType::Q3K => dequantize_blocks(src, dst, dequantize_block_q3_k),
        DType::Q2K => dequantize_blocks(src, dst, dequantize_block_q2_k),
        DType::IQ4NL => dequantize_blocks(src, dst, dequantize_block_iq4_nl),
        DType::IQ4XS => dequantize_blocks(src, dst, dequantize_block_iq4_xs),
        DType::F8E4M3 => dequantize_blocks(src, dst, dequantize_block_f8_e4m3),
    }
    Ok(())
}

/// The dot product of one stored row of `dtype` with `x` (`x.len()` values).
///
/// Dequantizes one block at a time into a stack buffer and accumulates the products in f64
/// in index order; the result is rounded to f32 once at the end.
pub fn dot_row(dtype: DType, src: &[u8], x: &[f32]) -> Result<f32, KernelError> {
    dot_rows(dtype, src, [x]).map(|[v]| v)
}

/// [`dot_row`] of one stored row with each of `T` vectors, dequantizing each block once for
/// all of them. Each result is the same bits as `dot_row` of that vector alone.
pub fn dot_rows<const T: usize>(
    dtype: DType,
    src: &[u8],
    xs: [&[f32]; T],
) -> Result<[f32; T], KernelError> {
    for x in xs {
        check_row_bytes(dtype, src.len(), x.len(), "dot_row source")?;
    }
    let sums = match dtype {
        DType::F32 => dot_blocks(src, xs, float::dequantize_block_f32),
        DType::F16 => dot_blocks(src, xs, float::dequantize_block_f16),
        DType::BF16 => dot_blocks(src, xs, float::dequantize_block_bf16),
        DType::Q8_0 => dot_blocks(src, xs, dequantize_block_q8_0),
        DType::Q4_0 => dot_blocks(src, xs, dequantize_block_q4_0),
        DType::Q4_1 => dot_blocks(src, xs, dequantize_block_q4_1),
        DType::Q4K => dot_blocks(src, xs, dequantize_block_q4_k),
        DType::Q6K => dot_blocks(src, xs, dequantize_block_q6_k),
        DType::Q5_0 => dot_blocks(src, xs, dequantize_block_q5_0),
        DType::Q5_1 => dot_blocks(src, xs, dequantize_block_q5_1),
        DType::Q5K => dot_blocks(src, xs, dequantize_block_q5_k),
        DType::Q3K => dot_blocks(src, xs, dequantize_block_q3_k),
        DType::Q2K => dot_blocks(src, xs, dequantize_block_q2_k),
        DType::IQ4NL => dot_blocks(src, xs, dequantize_block_iq4_nl),
        DType::IQ4XS => dot_blocks(src, xs, dequantize_block_iq4_xs),
        DType::F8E4M3 => dot_blocks(src, xs, dequantize_block_f8_e4m3),
    };
    Ok(sums.map(|sum| sum as f32))
}

/// The byte offsets, in one block of `dtype`, of its f16 scale fields (`d`, and `m` or
/// `dmin` where the format has one); empty for the float types and FP8 (whose f32 scale
/// [`fp8::make_finite`] sets). Every other byte of a
/// quantized block is quant bits or packed sub-block scales, for which any value is valid:
/// tests fill blocks with random bytes and put finite scales at these offsets.
pub const fn f16_scale_offsets(dtype: DType) -> &'static [usize] {
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 | DType::F8E4M3 => &[],
        DType::Q8_0 | DType::Q4_0 | DType::Q5_0 | DType::IQ4NL | DType::IQ4XS => &[0],
        DType::Q4_1 | DType::Q5_1 | DType::Q4K | DType::Q5K => &[0, 2],
        DType::Q6K => &[k_quants::Q6_K_D_OFFSET],
        DType::Q3K => &[k_quants_small::Q3_K_D_OFFSET],
        DType::Q2K => &[
            k_quants_small::Q2_K_D_OFFSET,
            k_quants_small::Q2_K_D_OFFSET + 2,
        ],
    }
}

/// Checks that `actual_bytes` is the size of a row of `cols` values of `dtype`.
fn check_row_bytes(
    dtype: DType,
    actual_bytes: usize,
    cols: usize,
    what: &'static str,
) -> Result<(), KernelError> {
    let expected = dtype.row_bytes(cols)?;
    if actual_bytes != expected {
        return Err(KernelError::ByteLength {
            what,
            expected,
            actual: actual_bytes,
        });
    }
    Ok(())
}

/// Applies a block dequantizer to every block of a row whose sizes were already checked.
fn dequantize_blocks<const B: usize, const E: usize>(
    src: &[u8],
    dst: &mut [f32],
    block: impl Fn(&[u8; B], &mut [f32; E]),
) {
    let (blocks, _) = src.as_chunks::<B>();
    let (outs, _) = dst.as_chunks_mut::<E>();
    for (b, out) in blocks.iter().zip(outs) {
        block(b, out);
    }
}

/// Dequantizes block by block and accumulates `w·x` in f64, in index order, for each `x`.
fn dot_blocks<const B: usize, const E: usize, const T: usize>(
    src: &[u8],
    xs: [&[f32]; T],
    block: impl Fn(&[u8; B], &mut [f32; E]),
) -> [f64; T] {
    let (blocks, _) = src.as_chunks::<B>();
    let xs = xs.map(|x| x.as_chunks::<E>().0);
    let mut w = [0.0f32; E];
    let mut sums = [0.0f64; T];
    for (i, b) in blocks.iter().enumerate() {
        block(b, &mut w);
        for (sum, x) in sums.iter_mut().zip(&xs) {
            for (wi, xi) in w.iter().zip(&x[i]) {
                *sum += f64::from(*wi) * f64::from(*xi);
            }
        }
    }
    sums
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// Random bytes for a row of `dtype`, with finite f16 scale fields and finite floats so
    /// that every value is finite.
    fn random_row(rng: &mut ChaCha8Rng, dtype: DType, cols: usize) -> Vec<u8> {
        let n_bytes = dtype.row_bytes(cols).unwrap();
        let mut row: Vec<u8> = (0..n_bytes).map(|_| rng.random()).collect();
        let finite_f16 = |rng: &mut ChaCha8Rng| {
            half::f16::from_f32(rng.random_range(-2.0f32..2.0)).to_le_bytes()
        };
        let f16_fields: &[usize] = match dtype {
            DType::F32 => {
                for v in row.chunks_exact_mut(4) {
                    v.copy_from_slice(&rng.random_range(-4.0f32..4.0).to_le_bytes());
                }
                &[]
            }
            DType::F16 => &[0],
            DType::BF16 => {
                for v in row.chunks_exact_mut(2) {
                    let x = half::bf16::from_f32(rng.random_range(-4.0f32..4.0));
                    v.copy_from_slice(&x.to_le_bytes());
                }
                &[]
            }
            DType::F8E4M3 => {
                for block in row.chunks_exact_mut(dtype.block_bytes()) {
                    fp8::make_finite(block, rng.random_range(-0.01f32..0.01));
                }
                &[]
            }
            _ => f16_scale_offsets(dtype),
        };
        for block in row.chunks_exact_mut(dtype.block_bytes()) {
            for &off in f16_fields {
                block[off..off + 2].copy_from_slice(&finite_f16(rng));
            }
        }
        row
    }

    #[test]
    fn dot_row_matches_dequantize_then_dot_for_every_type() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let cols = 512;
        let x: Vec<f32> = (0..cols).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        for dtype in DType::ALL {
            let row = random_row(&mut rng, dtype, cols);
            let mut w = vec![0.0f32; cols];
            dequantize_row(dtype, &row, &mut w).unwrap();
            assert!(w.iter().all(|v| v.is_finite()), "{dtype}");
            let want: f64 = w
                .iter()
                .zip(&x)
                .map(|(a, b)| f64::from(*a) * f64::from(*b))
                .sum();
            let scale: f64 = w
                .iter()
                .zip(&x)
                .map(|(a, b)| f64::from((a * b).abs()))
                .sum();
            let got = dot_row(dtype, &row, &x).unwrap();
            assert!(scale > 0.0, "{dtype}: all-zero row is a useless test");
            assert!(
                (f64::from(got) - want).abs() <= 1e-6 * scale,
                "{dtype}: dot_row {got} vs {want}"
            );
        }
    }

    #[test]
    fn float_rows_dequantize_to_their_values() {
        let values = [1.5f32, -0.0, 3.0e-5, -65504.0];
        let mut f32_row = Vec::new();
        let mut f16_row = Vec::new();
        let mut bf16_row = Vec::new();
        for v in values {
            f32_row.extend_from_slice(&v.to_le_bytes());
            f16_row.extend_from_slice(&half::f16::from_f32(v).to_le_bytes());
            bf16_row.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes());
        }
        let mut out = [0.0f32; 4];
        dequantize_row(DType::F32, &f32_row, &mut out).unwrap();
        assert_eq!(out.map(f32::to_bits), values.map(f32::to_bits));
        dequantize_row(DType::F16, &f16_row, &mut out).unwrap();
        assert_eq!(out, values.map(|v| half::f16::from_f32(v).to_f32()));
        dequantize_row(DType::BF16, &bf16_row, &mut out).unwrap();
        assert_eq!(out, values.map(|v| half::bf16::from_f32(v).to_f32()));
    }

    #[test]
    fn wrong_lengths_are_errors() {
        let mut dst = [0.0f32; 64];
        for dtype in DType::ALL {
            let cols = dtype.block_elems().max(64);
            let mut dst_full = vec![0.0f32; cols];
            let good = dtype.row_bytes(cols).unwrap();
            let src = vec![0u8; good + 1];
            let err = dequantize_row(dtype, &src, &mut dst_full).unwrap_err();
            assert_eq!(
                err,
                KernelError::ByteLength {
                    what: "dequantize_row source",
                    expected: good,
                    actual: good + 1
                }
            );
            let err = dot_row(dtype, &src[..good - 1], &dst_full).unwrap_err();
            assert!(
                matches!(err, KernelError::ByteLength { .. }),
                "{dtype}: {err}"
            );
        }
        assert!(matches!(
            dequantize_row(DType::Q4K, &[0u8; 144], &mut dst),
            Err(KernelError::PartialBlock {
                cols: 64,
                block_elems: 256,
                ..
            })
        ));
    }

    #[test]
    fn empty_rows_are_fine() {
        for dtype in DType::ALL {
            dequantize_row(dtype, &[], &mut []).unwrap();
            assert_eq!(dot_row(dtype, &[], &[]).unwrap(), 0.0);
        }
    }

    #[test]
    fn quantize_row_q8_0_round_trips_through_dot_row() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let x: Vec<f32> = (0..256).map(|_| rng.random_range(-3.0f32..3.0)).collect();
        let mut q = vec![0u8; DType::Q8_0.row_bytes(256).unwrap()];
        quantize_row_q8_0(&x, &mut q).unwrap();
        let mut y = vec![0.0f32; 256];
        dequantize_row(DType::Q8_0, &q, &mut y).unwrap();
        for (a, b) in x.iter().zip(&y) {
            // max |x| < 3 so the step is < 3/127; the error is at most half a step plus the
            // f16 rounding of the scale.
            assert!((a - b).abs() < 0.013, "{a} vs {b}");
        }
    }
}
