//! Q8_0: blocks of 32 values stored as one f16 scale and 32 signed bytes, `x = d·q`.
//!
//! Layout of one 34-byte block (GGML `block_q8_0`):
//!
//! | bytes  | field | meaning                      |
//! |--------|-------|------------------------------|
//! | 0..2   | `d`   | f16 scale, little-endian     |
//! | 2..34  | `qs`  | 32 × i8, value `i` at `2 + i`|

use super::float::f16_le_to_f32;
use crate::error::KernelError;

/// Values in one Q8_0 block.
pub const QK8_0: usize = 32;
/// Bytes of one Q8_0 block.
pub const BLOCK_Q8_0_BYTES: usize = 34;
/// Byte offset of the f16 scale `d`.
pub const Q8_0_D_OFFSET: usize = 0;
/// Byte offset of the 32 signed quants.
pub const Q8_0_QS_OFFSET: usize = 2;

/// Dequantizes one Q8_0 block: `out[i] = d · qs[i]`.
#[inline]
pub fn dequantize_block_q8_0(block: &[u8; BLOCK_Q8_0_BYTES], out: &mut [f32; QK8_0]) {
    let d = f16_le_to_f32([block[0], block[1]]);
    for (o, &q) in out.iter_mut().zip(&block[Q8_0_QS_OFFSET..]) {
        *o = d * f32::from(q as i8);
    }
}

/// Quantizes 32 values to one Q8_0 block the way GGML's reference quantizer does:
/// `d = max|x| / 127` (stored as f16, rounded to nearest even), `q = round(x / d)` with ties
/// away from zero, computed as `x · (1/d)` in f32.
pub fn quantize_block_q8_0(x: &[f32; QK8_0], out: &mut [u8; BLOCK_Q8_0_BYTES]) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out[..Q8_0_QS_OFFSET].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
    for (o, &v) in out[Q8_0_QS_OFFSET..].iter_mut().zip(x) {
        // `f32::round` rounds half away from zero like C's `roundf`; the value lies in
        // [-127, 127] for finite input, and `as` saturates (NaN → 0) otherwise.
        *o = ((v * id).round() as i8) as u8;
    }
}

/// Quantizes a row of f32 values into Q8_0 blocks (see [`quantize_block_q8_0`]).
///
/// `x.len()` must be a multiple of 32 and `dst.len()` must be the matching row size.
pub fn quantize_row_q8_0(x: &[f32], dst: &mut [u8]) -> Result<(), KernelError> {
    let expected = crate::DType::Q8_0.row_bytes(x.len())?;
    if dst.len() != expected {
        return Err(KernelError::ByteLength {
            what: "quantize_row_q8_0 destination",
            expected,
            actual: dst.len(),
        });
    }
    let (xs, _) = x.as_chunks::<QK8_0>();
    let (blocks, _) = dst.as_chunks_mut::<BLOCK_Q8_0_BYTES>();
    for (xb, block) in xs.iter().zip(blocks) {
        quantize_block_q8_0(xb, block);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dequantizes_a_hand_built_block() {
        let mut block = [0u8; BLOCK_Q8_0_BYTES];
        block[..2].copy_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
        block[2] = 4; // 2.0
        block[3] = (-128i8) as u8; // -64.0
        block[33] = 127; // 63.5
        let mut out = [f32::NAN; QK8_0];
        dequantize_block_q8_0(&block, &mut out);
        assert_eq!(out[0], 2.0);
        assert_eq!(out[1], -64.0);
        assert_eq!(out[2], 0.0);
        assert_eq!(out[31], 63.5);
    }

    #[test]
    fn quantize_then_dequantize_is_within_half_a_step() {
        let x: [f32; QK8_0] = std::array::from_fn(|i| (i as f32 - 13.3) * 0.37);
        let mut block = [0u8; BLOCK_Q8_0_BYTES];
        quantize_block_q8_0(&x, &mut block);
        let mut y = [0.0f32; QK8_0];
        dequantize_block_q8_0(&block, &mut y);
        let d = f16_le_to_f32([block[0], block[1]]);
        assert!(d > 0.0);
        for (a, b) in x.iter().zip(&y) {
            assert!((a - b).abs() <= d * 0.5 + 1e-3, "{a} vs {b} (d = {d})");
        }
        // The largest magnitude maps to ±127.
        assert_eq!(
            block[2..].iter().map(|&q| (q as i8).unsigned_abs()).max(),
            Some(127)
        );
    }

    #[test]
    fn ties_round_away_from_zero() {
        // amax = 127 gives d = 1 and id = 1, so x = 2.5 must become 3 and -2.5 must become -3.
        let mut x = [0.0f32; QK8_0];
        x[0] = 127.0;
        x[1] = 2.5;
        x[2] = -2.5;
        let mut block = [0u8; BLOCK_Q8_0_BYTES];
        quantize_block_q8_0(&x, &mut block);
        assert_eq!(block[3] as i8, 3);
        assert_eq!(block[4] as i8, -3);
    }

    #[test]
    fn zero_block_has_zero_scale() {
        let mut block = [0xffu8; BLOCK_Q8_0_BYTES];
        quantize_block_q8_0(&[0.0; QK8_0], &mut block);
        assert!(block.iter().all(|&b| b == 0));
    }

    #[test]
    fn row_length_is_checked() {
        let x = [1.0f32; 64];
        let mut short = [0u8; 67];
        assert!(matches!(
            quantize_row_q8_0(&x, &mut short),
            Err(KernelError::ByteLength {
                expected: 68,
                actual: 67,
                ..
            })
        ));
        let mut ok = [0u8; 68];
        assert_eq!(quantize_row_q8_0(&x, &mut ok), Ok(()));
        assert!(matches!(
            quantize_row_q8_0(&x[..40], &mut ok),
            Err(KernelError::PartialBlock { cols: 40, .. })
        ));
    }
}
