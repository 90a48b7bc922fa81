//! Q5_0 and Q5_1: blocks of 32 values stored as 5-bit quants (4 low bits as nibbles plus a
//! 32-bit word of high bits) and an f16 scale (and, for Q5_1, an f16 minimum).
//!
//! The nibbles are laid out as in Q4_0 (value `i` in the low nibble of byte `i`, value
//! `i + 16` in the high nibble); bit `i` of the little-endian high-bit word `qh` is bit 4 of
//! value `i`.
//!
//! Q5_0, 22 bytes (GGML `block_q5_0`), `x = d·(q − 16)`:
//!
//! | bytes | field | meaning                      |
//! |-------|-------|------------------------------|
//! | 0..2  | `d`   | f16 scale                    |
//! | 2..6  | `qh`  | u32, bit 4 of each quant     |
//! | 6..22 | `qs`  | 32 × low 4 bits              |
//!
//! Q5_1, 24 bytes (GGML `block_q5_1`), `x = d·q + m`:
//!
//! | bytes | field | meaning                      |
//! |-------|-------|------------------------------|
//! | 0..2  | `d`   | f16 scale                    |
//! | 2..4  | `m`   | f16 minimum                  |
//! | 4..8  | `qh`  | u32, bit 4 of each quant     |
//! | 8..24 | `qs`  | 32 × low 4 bits              |

use super::float::f16_le_to_f32;
use super::q4::{Q4_QS_BYTES, QK4};

/// Values in one Q5_0 or Q5_1 block.
pub const QK5: usize = QK4;
/// Bytes of one Q5_0 block.
pub const BLOCK_Q5_0_BYTES: usize = 22;
/// Byte offset of the Q5_0 high bits.
pub const Q5_0_QH_OFFSET: usize = 2;
/// Byte offset of the Q5_0 low nibbles.
pub const Q5_0_QS_OFFSET: usize = 6;
/// Bytes of one Q5_1 block.
pub const BLOCK_Q5_1_BYTES: usize = 24;
/// Byte offset of the Q5_1 f16 minimum `m`.
pub const Q5_1_M_OFFSET: usize = 2;
/// Byte offset of the Q5_1 high bits.
pub const Q5_1_QH_OFFSET: usize = 4;
/// Byte offset of the Q5_1 low nibbles.
pub const Q5_1_QS_OFFSET: usize = 8;

/// The 32 unsigned 5-bit quants of a block, in value order, from its high-bit word and its
/// 16 bytes of nibbles (which start at `qh_at + 4`).
#[inline]
fn quants_q5(block: &[u8], qh_at: usize) -> [u8; QK5] {
    let qh = u32::from_le_bytes([
        block[qh_at],
        block[qh_at + 1],
        block[qh_at + 2],
        block[qh_at + 3],
    ]);
    let qs = &block[qh_at + 4..qh_at + 4 + Q4_QS_BYTES];
    let mut q = [0u8; QK5];
    for (i, &byte) in qs.iter().enumerate() {
        let high = |bit: usize| (((qh >> bit) & 1) as u8) << 4;
        q[i] = (byte & 0x0f) | high(i);
        q[i + Q4_QS_BYTES] = (byte >> 4) | high(i + Q4_QS_BYTES);
    }
    q
}

/// Dequantizes one Q5_0 block: `out[i] = d · (q[i] − 16)`.
#[inline]
pub fn dequantize_block_q5_0(block: &[u8; BLOCK_Q5_0_BYTES], out: &mut [f32; QK5]) {
    let d = f16_le_to_f32([block[0], block[1]]);
    for (o, q) in out.iter_mut().zip(quants_q5(block, Q5_0_QH_OFFSET)) {
        *o = d * f32::from(q as i8 - 16);
    }
}

/// Dequantizes one Q5_1 block: `out[i] = d · q[i] + m`.
#[inline]
pub fn dequantize_block_q5_1(block: &[u8; BLOCK_Q5_1_BYTES], out: &mut [f32; QK5]) {
    let d = f16_le_to_f32([block[0], block[1]]);
    let m = f16_le_to_f32([block[2], block[3]]);
    for (o, q) in out.iter_mut().zip(quants_q5(block, Q5_1_QH_OFFSET)) {
        // Multiply then add, each rounded, as in Q4_1.
        *o = d * f32::from(q) + m;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;

    #[test]
    fn q5_0_high_bits_follow_value_order() {
        let mut block = [0u8; BLOCK_Q5_0_BYTES];
        block[..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        // High bits of values 0, 17 and 31.
        block[2..6].copy_from_slice(&(1u32 | 1 << 17 | 1 << 31).to_le_bytes());
        block[6] = 0x3f; // value 0: q = 15 | 16 = 31 → 7.5; value 16: q = 3 → -6.5
        block[7] = 0x20; // value 1: q = 0 → -8; value 17: q = 2 | 16 = 18 → 1
        block[21] = 0xf0; // value 15: q = 0 → -8; value 31: q = 15 | 16 = 31 → 7.5
        let mut out = [f32::NAN; QK5];
        dequantize_block_q5_0(&block, &mut out);
        assert_eq!(out[0], 7.5);
        assert_eq!(out[16], -6.5);
        assert_eq!(out[1], -8.0);
        assert_eq!(out[17], 1.0);
        assert_eq!(out[15], -8.0);
        assert_eq!(out[31], 7.5);
    }

    #[test]
    fn q5_1_adds_the_minimum() {
        let mut block = [0u8; BLOCK_Q5_1_BYTES];
        block[..2].copy_from_slice(&f16::from_f32(0.25).to_le_bytes());
        block[2..4].copy_from_slice(&f16::from_f32(-1.0).to_le_bytes());
        block[4..8].copy_from_slice(&(1u32 << 16).to_le_bytes());
        block[8] = 0x4f; // value 0: q = 15 → 2.75; value 16: q = 4 | 16 = 20 → 4.0
        let mut out = [f32::NAN; QK5];
        dequantize_block_q5_1(&block, &mut out);
        assert_eq!(out[0], 2.75);
        assert_eq!(out[16], 4.0);
        assert_eq!(out[1], -1.0);
    }
}
