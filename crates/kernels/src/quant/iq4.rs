//! IQ4_NL and IQ4_XS: 4-bit indices into one fixed table of 16 non-linear levels
//! ([`IQ4_LEVELS`]), times a scale.
//!
//! IQ4_NL, 18 bytes (GGML `block_iq4_nl`), 32 values, `x = d·LEVELS[q]`; the nibbles are laid
//! out as in Q4_0 (value `i` in the low nibble of byte `i`, value `i + 16` in the high one):
//!
//! | bytes | field | meaning                   |
//! |-------|-------|---------------------------|
//! | 0..2  | `d`   | f16 scale                 |
//! | 2..18 | `qs`  | 32 × 4-bit indices        |
//!
//! IQ4_XS, 136 bytes (GGML `block_iq4_xs`), 256 values in 8 sub-blocks of 32, each with a
//! 6-bit scale `sc` stored plus 32; `x = (d·(sc − 32))·LEVELS[q]`. Sub-block `s` reads
//! `qs[16s..16s + 16]`, laid out as one IQ4_NL block's nibbles.
//!
//! | bytes  | field      | meaning                                                  |
//! |--------|------------|----------------------------------------------------------|
//! | 0..2   | `d`        | f16 super-block scale                                    |
//! | 2..4   | `scales_h` | u16: bits `2s..2s+2` are the high 2 bits of `sc`         |
//! | 4..8   | `scales_l` | low 4 bits of `sc`: nibble `s mod 2` of byte `s / 2`     |
//! | 8..136 | `qs`       | 256 × 4-bit indices                                      |

use super::float::f16_le_to_f32;
use super::k_quants::QK_K;
use super::q4::{Q4_QS_BYTES, QK4};

/// The 16 levels a 4-bit IQ4 index stands for (GGML's `kvalues_iq4nl`).
pub const IQ4_LEVELS: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// Values in one IQ4_NL block.
pub const QK4_NL: usize = QK4;
/// Bytes of one IQ4_NL block.
pub const BLOCK_IQ4_NL_BYTES: usize = 18;
/// Byte offset of the IQ4_NL indices.
pub const IQ4_NL_QS_OFFSET: usize = 2;

/// Bytes of one IQ4_XS block.
pub const BLOCK_IQ4_XS_BYTES: usize = 136;
/// Byte offset of the IQ4_XS high scale bits (`scales_h`).
pub const IQ4_XS_SCALES_H_OFFSET: usize = 2;
/// Byte offset of the IQ4_XS low scale bits (`scales_l`).
pub const IQ4_XS_SCALES_L_OFFSET: usize = 4;
/// Byte offset of the IQ4_XS indices.
pub const IQ4_XS_QS_OFFSET: usize = 8;
/// Values in one IQ4_XS sub-block.
pub const IQ4_XS_SUB_BLOCK: usize = 32;

/// The signed scale `sc − 32` of IQ4_XS sub-block `s` (0..8).
#[inline]
pub fn iq4_xs_scale(s: usize, block: &[u8]) -> i8 {
    let h_at = IQ4_XS_SCALES_H_OFFSET;
    let scales_h = u16::from_le_bytes([block[h_at], block[h_at + 1]]);
    let low = (block[IQ4_XS_SCALES_L_OFFSET + s / 2] >> (4 * (s % 2))) & 0x0f;
    let high = ((scales_h >> (2 * s)) & 0x03) as u8;
    (low | (high << 4)) as i8 - 32
}

/// `out[i] = d · LEVELS[q[i]]` for the 32 values whose indices are the 16 bytes `qs`.
#[inline]
fn dequantize_levels(d: f32, qs: &[u8], out: &mut [f32]) {
    let (lo, hi) = out.split_at_mut(Q4_QS_BYTES);
    for ((l, h), &byte) in lo.iter_mut().zip(hi).zip(qs) {
        *l = d * f32::from(IQ4_LEVELS[usize::from(byte & 0x0f)]);
        *h = d * f32::from(IQ4_LEVELS[usize::from(byte >> 4)]);
    }
}

/// Dequantizes one IQ4_NL block.
#[inline]
pub fn dequantize_block_iq4_nl(block: &[u8; BLOCK_IQ4_NL_BYTES], out: &mut [f32; QK4_NL]) {
    let d = f16_le_to_f32([block[0], block[1]]);
    dequantize_levels(d, &block[IQ4_NL_QS_OFFSET..], out);
}

/// Dequantizes one IQ4_XS block.
#[inline]
pub fn dequantize_block_iq4_xs(block: &[u8; BLOCK_IQ4_XS_BYTES], out: &mut [f32; QK_K]) {
    let d = f16_le_to_f32([block[0], block[1]]);
    let qs = block[IQ4_XS_QS_OFFSET..].chunks_exact(Q4_QS_BYTES);
    for (s, (qs, out)) in qs.zip(out.chunks_exact_mut(IQ4_XS_SUB_BLOCK)).enumerate() {
        let dl = d * f32::from(iq4_xs_scale(s, block));
        dequantize_levels(dl, qs, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;

    #[test]
    fn iq4_nl_low_nibbles_first_then_high() {
        let mut block = [0u8; BLOCK_IQ4_NL_BYTES];
        block[..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        block[2] = 0xf8; // value 0: level 8 = 1; value 16: level 15 = 113
        block[17] = 0x07; // value 15: level 7 = -10; value 31: level 0 = -127
        let mut out = [f32::NAN; QK4_NL];
        dequantize_block_iq4_nl(&block, &mut out);
        assert_eq!(out[0], 0.5);
        assert_eq!(out[16], 56.5);
        assert_eq!(out[15], -5.0);
        assert_eq!(out[31], -63.5);
    }

    #[test]
    fn iq4_xs_scales_and_sub_blocks() {
        let mut block = [0u8; BLOCK_IQ4_XS_BYTES];
        block[..2].copy_from_slice(&f16::from_f32(0.25).to_le_bytes());
        // Sub-block 0: sc = 0x21 = 33 → 1; sub-block 7: sc = 0x3f = 63 → 31;
        // sub-block 2: sc = 0x05 → -27. All others: sc = 0 → -32.
        let scales_h: u16 = 0b10 | (0b11 << 14);
        block[2..4].copy_from_slice(&scales_h.to_le_bytes());
        block[4] = 0x01;
        block[5] = 0x05;
        block[7] = 0xf0;
        block[8] = 0x9f; // sub-block 0, value 0: level 15 = 113; value 16: level 9 = 13
        block[8 + 16 * 7 + 15] = 0x08; // sub-block 7, value 15: level 8 = 1
        block[8 + 32] = 0x08; // sub-block 2, value 0: level 8 = 1
        let mut out = [f32::NAN; QK_K];
        dequantize_block_iq4_xs(&block, &mut out);
        assert_eq!(out[0], 0.25 * 113.0);
        assert_eq!(out[16], 0.25 * 13.0);
        assert_eq!(out[7 * 32 + 15], 0.25 * 31.0);
        assert_eq!(out[64], 0.25 * -27.0);
        assert_eq!(out[32], 0.25 * -32.0 * -127.0); // sub-block 1, level 0
    }
}
