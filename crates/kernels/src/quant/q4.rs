//! Q4_0 and Q4_1: blocks of 32 values stored as 4-bit quants plus an f16 scale (and, for
//! Q4_1, an f16 minimum).
//!
//! The 16 quant bytes hold value `i` in the low nibble of byte `i` and value `i + 16` in the
//! high nibble of byte `i` (not interleaved pairs).
//!
//! Q4_0, 18 bytes (GGML `block_q4_0`), `x = d·(q − 8)`:
//!
//! | bytes | field | meaning                  |
//! |-------|-------|--------------------------|
//! | 0..2  | `d`   | f16 scale                |
//! | 2..18 | `qs`  | 32 × 4-bit quants        |
//!
//! Q4_1, 20 bytes (GGML `block_q4_1`), `x = d·q + m`:
//!
//! | bytes | field | meaning                  |
//! |-------|-------|--------------------------|
//! | 0..2  | `d`   | f16 scale                |
//! | 2..4  | `m`   | f16 minimum              |
//! | 4..20 | `qs`  | 32 × 4-bit quants        |

use super::float::f16_le_to_f32;

/// Values in one Q4_0 or Q4_1 block.
pub const QK4: usize = 32;
/// Bytes of one Q4_0 block.
pub const BLOCK_Q4_0_BYTES: usize = 18;
/// Byte offset of the Q4_0 quants.
pub const Q4_0_QS_OFFSET: usize = 2;
/// Bytes of one Q4_1 block.
pub const BLOCK_Q4_1_BYTES: usize = 20;
/// Byte offset of the Q4_1 f16 minimum `m`.
pub const Q4_1_M_OFFSET: usize = 2;
/// Byte offset of the Q4_1 quants.
pub const Q4_1_QS_OFFSET: usize = 4;
/// Bytes of packed nibbles in a Q4_0 or Q4_1 block.
pub const Q4_QS_BYTES: usize = QK4 / 2;

/// Dequantizes one Q4_0 block: `out[i] = d · (q[i] − 8)`.
#[inline]
pub fn dequantize_block_q4_0(block: &[u8; BLOCK_Q4_0_BYTES], out: &mut [f32; QK4]) {
    let d = f16_le_to_f32([block[0], block[1]]);
    let (lo, hi) = out.split_at_mut(Q4_QS_BYTES);
    for ((l, h), &byte) in lo.iter_mut().zip(hi).zip(&block[Q4_0_QS_OFFSET..]) {
        *l = d * f32::from((byte & 0x0f) as i8 - 8);
        *h = d * f32::from((byte >> 4) as i8 - 8);
    }
}

/// Dequantizes one Q4_1 block: `out[i] = d · q[i] + m`.
#[inline]
pub fn dequantize_block_q4_1(block: &[u8; BLOCK_Q4_1_BYTES], out: &mut [f32; QK4]) {
    let d = f16_le_to_f32([block[0], block[1]]);
    let m = f16_le_to_f32([block[2], block[3]]);
    let (lo, hi) = out.split_at_mut(Q4_QS_BYTES);
    for ((l, h), &byte) in lo.iter_mut().zip(hi).zip(&block[Q4_1_QS_OFFSET..]) {
        // Multiply then add, each rounded, as GGML's reference does (no fused multiply-add).
        *l = d * f32::from(byte & 0x0f) + m;
        *h = d * f32::from(byte >> 4) + m;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;

    #[test]
    fn q4_0_low_nibbles_first_then_high() {
        let mut block = [0u8; BLOCK_Q4_0_BYTES];
        block[..2].copy_from_slice(&f16::from_f32(2.0).to_le_bytes());
        block[2] = 0xf0; // value 0: q = 0 → -16; value 16: q = 15 → 14
        block[3] = 0x98; // value 1: q = 8 → 0; value 17: q = 9 → 2
        block[17] = 0x01; // value 15: q = 1 → -14; value 31: q = 0 → -16
        let mut out = [f32::NAN; QK4];
        dequantize_block_q4_0(&block, &mut out);
        assert_eq!(out[0], -16.0);
        assert_eq!(out[16], 14.0);
        assert_eq!(out[1], 0.0);
        assert_eq!(out[17], 2.0);
        assert_eq!(out[15], -14.0);
        assert_eq!(out[31], -16.0);
        assert_eq!(out[2], -16.0); // byte 0x00 → q = 0
    }

    #[test]
    fn q4_1_adds_the_minimum() {
        let mut block = [0u8; BLOCK_Q4_1_BYTES];
        block[..2].copy_from_slice(&f16::from_f32(0.25).to_le_bytes());
        block[2..4].copy_from_slice(&f16::from_f32(-1.0).to_le_bytes());
        block[4] = 0x4f; // value 0: q = 15 → 2.75; value 16: q = 4 → 0.0
        block[19] = 0x20; // value 15: q = 0 → -1.0; value 31: q = 2 → -0.5
        let mut out = [f32::NAN; QK4];
        dequantize_block_q4_1(&block, &mut out);
        assert_eq!(out[0], 2.75);
        assert_eq!(out[16], 0.0);
        assert_eq!(out[15], -1.0);
        assert_eq!(out[31], -0.5);
    }
}
