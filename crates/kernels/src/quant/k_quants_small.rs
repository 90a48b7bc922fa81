//! K-quants Q2_K and Q3_K: super-blocks of 256 values in 16 sub-blocks of 16, with 2 bits
//! of each quant packed four to a byte.
//!
//! Both lay out their 2-bit fields `qs` (64 bytes) the same way: the block is two halves of
//! 128 values; value `128h + 32j + l` (`j` in 0..4, `l` in 0..32) is bits `2j..2j+2` of
//! `qs[32h + l]` and belongs to sub-block `8h + 2j + l/16` (see [`for_each_2bit`]).
//!
//! Q2_K, 84 bytes (GGML `block_q2_K`), `x = (d·sc)·q − (dmin·m)` with 2-bit `q`:
//!
//! | bytes  | field    | meaning                                                  |
//! |--------|----------|----------------------------------------------------------|
//! | 0..16  | `scales` | per sub-block: 4-bit `sc` (low nibble), 4-bit `m` (high) |
//! | 16..80 | `qs`     | 256 × 2-bit quants                                       |
//! | 80..82 | `d`      | f16 super-block scale of the sub-block scales            |
//! | 82..84 | `dmin`   | f16 super-block scale of the sub-block minimums          |
//!
//! Q3_K, 110 bytes (GGML `block_q3_K`), `x = (d·(sc − 32))·q` with `q` in −4..4: the 2 bits
//! of `qs`, minus 4 when the value's bit in `hmask` is clear.
//!
//! | bytes    | field    | meaning                                                  |
//! |----------|----------|----------------------------------------------------------|
//! | 0..32    | `hmask`  | value `32k + l` (`k` in 0..8): bit `k` of `hmask[l]`     |
//! | 32..96   | `qs`     | 256 × 2-bit low bits of the quants                       |
//! | 96..108  | `scales` | 16 × 6-bit sub-block scales, packed (see [`q3_k_scales_all`]) |
//! | 108..110 | `d`      | f16 super-block scale                                    |

use super::float::f16_le_to_f32;
use super::k_quants::QK_K;

/// Values in one Q2_K or Q3_K sub-block.
pub const K_SMALL_SUB_BLOCK: usize = 16;
/// Bytes of the 2-bit fields of a Q2_K or Q3_K block.
pub const K_2BIT_BYTES: usize = 64;

/// Bytes of one Q2_K block.
pub const BLOCK_Q2_K_BYTES: usize = 84;
/// Byte offset of the Q2_K quants.
pub const Q2_K_QS_OFFSET: usize = 16;
/// Byte offset of the Q2_K f16 `d` (`dmin` follows it).
pub const Q2_K_D_OFFSET: usize = 80;

/// Bytes of one Q3_K block.
pub const BLOCK_Q3_K_BYTES: usize = 110;
/// Byte offset of the Q3_K low 2 bits of the quants.
pub const Q3_K_QS_OFFSET: usize = 32;
/// Byte offset of the packed Q3_K scales.
pub const Q3_K_SCALES_OFFSET: usize = 96;
/// Byte offset of the Q3_K f16 `d`.
pub const Q3_K_D_OFFSET: usize = 108;

/// Calls `f(v, q, s)` for every value `v` of a block with its 2 bits `q` from `qs` and its
/// sub-block `s`, in value order.
#[inline]
pub fn for_each_2bit(qs: &[u8], mut f: impl FnMut(usize, u8, usize)) {
    for (h, half) in qs.chunks_exact(32).enumerate() {
        for j in 0..4 {
            for (l, &byte) in half.iter().enumerate() {
                let v = 128 * h + 32 * j + l;
                f(v, (byte >> (2 * j)) & 0x03, v / K_SMALL_SUB_BLOCK);
            }
        }
    }
}

/// The sub-block scales of a Q2_K block as f32 pairs `(d·sc, dmin·m)`.
#[inline]
pub fn q2_k_scales(block: &[u8; BLOCK_Q2_K_BYTES]) -> [(f32, f32); 16] {
    let d = f16_le_to_f32([block[Q2_K_D_OFFSET], block[Q2_K_D_OFFSET + 1]]);
    let dmin = f16_le_to_f32([block[Q2_K_D_OFFSET + 2], block[Q2_K_D_OFFSET + 3]]);
    std::array::from_fn(|s| {
        let byte = block[s];
        (d * f32::from(byte & 0x0f), dmin * f32::from(byte >> 4))
    })
}

/// The sub-block scales of a Q3_K block as f32 `d·(sc − 32)`.
#[inline]
pub fn q3_k_scales(block: &[u8; BLOCK_Q3_K_BYTES]) -> [f32; 16] {
    let d = f16_le_to_f32([block[Q3_K_D_OFFSET], block[Q3_K_D_OFFSET + 1]]);
    let sc = q3_k_scales_all(block);
    std::array::from_fn(|s| d * f32::from(sc[s]))
}

/// The signed scales of a Q3_K block's 16 sub-blocks, from its 12 packed scale bytes.
///
/// Sub-block `i`'s low 4 bits are the low nibble of byte `i` for `i < 8` and the high
/// nibble of byte `i − 8` after; its high 2 bits are bits `2·(i / 4)..` of byte
/// `8 + i mod 4`. The 6-bit value is stored plus 32. All 16 are unpacked at once, eight to
/// a 64-bit word.
#[inline]
pub fn q3_k_scales_all(block: &[u8; BLOCK_Q3_K_BYTES]) -> [i8; 16] {
    let (low, high) = block[Q3_K_SCALES_OFFSET..Q3_K_D_OFFSET].split_at(8);
    let low = u64::from_le_bytes(low.try_into().expect("8 bytes"));
    let high = u64::from(u32::from_le_bytes(high.try_into().expect("4 bytes")));
    let (nibbles, pairs) = (0x0f0f_0f0f_0f0f_0f0f, 0x0303_0303);
    // Sub-blocks 0..8 and 8..16: their 2 high bits as bytes, then the whole 6-bit values.
    let top = |k: u32| ((high >> (2 * k)) & pairs) | (((high >> (2 * k + 2)) & pairs) << 32);
    let first = (low & nibbles) | (top(0) << 4);
    let second = ((low >> 4) & nibbles) | (top(2) << 4);
    let bytes = [first.to_le_bytes(), second.to_le_bytes()];
    // Stored plus 32: 0..64, so the byte is the same as an i8.
    std::array::from_fn(|i| bytes[i / 8][i % 8] as i8 - 32)
}

/// The signed scale of Q3_K 16-value sub-block `i` from the 12 packed scale bytes, one at
/// a time as the layout defines it (see [`q3_k_scales_all`], which unpacks all 16 at once
/// and is tested against this).
#[inline]
pub fn q3_k_scale(i: usize, scales: &[u8; 12]) -> i8 {
    let low = if i < 8 {
        scales[i] & 0x0f
    } else {
        scales[i - 8] >> 4
    };
    let high = (scales[8 + i % 4] >> (2 * (i / 4))) & 0x03;
    (low | (high << 4)) as i8 - 32
}

/// The signed scales of Q3_K 16-value sub-blocks `2j` and `2j + 1` (the halves of 32-value
/// sub-block `j`, 0..8) from the 12 packed scale bytes: [`q3_k_scale`] of both, read as two
/// 16-bit words (the pair's low nibbles share bytes `2(j mod 4)..`, their high bits bytes
/// `8 + 2(j mod 2)..`).
#[inline]
pub fn q3_k_scale_pair(j: usize, scales: &[u8; 12]) -> (i8, i8) {
    let word = |at: usize| u16::from_le_bytes([scales[at], scales[at + 1]]);
    let low = (word(2 * (j % 4)) >> (4 * (j / 4))) & 0x0f0f;
    let high = (word(8 + 2 * (j % 2)) >> (2 * (j / 2))) & 0x0303;
    let [first, second] = (low | (high << 4)).to_le_bytes();
    (first as i8 - 32, second as i8 - 32)
}

/// Dequantizes one Q2_K block.
#[inline]
pub fn dequantize_block_q2_k(block: &[u8; BLOCK_Q2_K_BYTES], out: &mut [f32; QK_K]) {
    let scales = q2_k_scales(block);
    let qs = &block[Q2_K_QS_OFFSET..Q2_K_D_OFFSET];
    for_each_2bit(qs, |v, q, s| {
        let (dl, ml) = scales[s];
        out[v] = dl * f32::from(q) - ml;
    });
}

/// Dequantizes one Q3_K block.
#[inline]
pub fn dequantize_block_q3_k(block: &[u8; BLOCK_Q3_K_BYTES], out: &mut [f32; QK_K]) {
    let scales = q3_k_scales(block);
    let hmask = &block[..Q3_K_QS_OFFSET];
    let qs = &block[Q3_K_QS_OFFSET..Q3_K_SCALES_OFFSET];
    for_each_2bit(qs, |v, q, s| {
        let high = (hmask[v % 32] >> (v / 32)) & 1;
        // A clear high bit subtracts 4: q in -4..4.
        let q = q as i8 - if high == 0 { 4 } else { 0 };
        out[v] = scales[s] * f32::from(q);
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;

    /// A Q3_K block holding `packed` as its scales (and zeros elsewhere).
    fn block_with_scales(packed: [u8; 12]) -> [u8; BLOCK_Q3_K_BYTES] {
        let mut block = [0u8; BLOCK_Q3_K_BYTES];
        block[Q3_K_SCALES_OFFSET..Q3_K_D_OFFSET].copy_from_slice(&packed);
        block
    }

    /// Packs 16 signed 6-bit scales (−32..32) the way the Q3_K layout stores them.
    fn pack_q3_k_scales(sc: [i8; 16]) -> [u8; 12] {
        let mut out = [0u8; 12];
        for (i, &s) in sc.iter().enumerate() {
            let u = (s + 32) as u8;
            if i < 8 {
                out[i] |= u & 0x0f;
            } else {
                out[i - 8] |= (u & 0x0f) << 4;
            }
            out[8 + i % 4] |= (u >> 4) << (2 * (i / 4));
        }
        out
    }

    #[test]
    fn q3_k_scales_unpack_what_the_layout_packs() {
        let sc = [
            -32, 31, 0, 1, -1, 17, -17, 5, 30, -30, 9, -9, 2, -2, 15, -16,
        ];
        let packed = pack_q3_k_scales(sc);
        for (i, &s) in sc.iter().enumerate() {
            assert_eq!(q3_k_scale(i, &packed), s, "sub-block {i}");
        }
        assert_eq!(q3_k_scales_all(&block_with_scales(packed)), sc);
    }

    #[test]
    fn q3_k_scale_pairs_are_their_two_scales() {
        let mut state = 0x2545_f491_u32;
        for _ in 0..2000 {
            let packed: [u8; 12] = std::array::from_fn(|_| {
                state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (state >> 24) as u8
            });
            for j in 0..8 {
                let want = (q3_k_scale(2 * j, &packed), q3_k_scale(2 * j + 1, &packed));
                assert_eq!(q3_k_scale_pair(j, &packed), want, "{packed:?}, pair {j}");
            }
        }
    }

    #[test]
    fn all_q3_k_scales_at_once_are_each_sub_blocks() {
        // Every byte value in every position: 12 × 256 packings of random-ish bytes.
        let mut state = 0x9e37_79b9_u32;
        for at in 0..12 {
            for byte in 0..=255u8 {
                let mut packed = [0u8; 12];
                for b in &mut packed {
                    state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    *b = (state >> 24) as u8;
                }
                packed[at] = byte;
                let each: [i8; 16] = std::array::from_fn(|i| q3_k_scale(i, &packed));
                let all = q3_k_scales_all(&block_with_scales(packed));
                assert_eq!(all, each, "{packed:?}");
            }
        }
    }

    #[test]
    fn q2_k_hand_built_block() {
        let mut block = [0u8; BLOCK_Q2_K_BYTES];
        block[80..82].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        block[82..84].copy_from_slice(&f16::from_f32(0.25).to_le_bytes());
        block[0] = 0x12; // sub-block 0: sc = 2, m = 1
        block[3] = 0x30; // sub-block 3: sc = 0, m = 3
        block[6] = 0x07; // sub-block 6 (h = 0, j = 3): sc = 7, m = 0
        block[9] = 0x05; // sub-block 9 (h = 1, j = 0, l ≥ 16): sc = 5
        // qs[0]: value 0 (j = 0) gets 3, value 96 (j = 3) gets 2.
        block[16] = 0b1000_0011;
        // qs[32 + 16]: value 128 + 16 = 144 (sub-block 9) gets 1.
        block[16 + 48] = 0b0000_0001;
        let mut out = [f32::NAN; QK_K];
        dequantize_block_q2_k(&block, &mut out);
        assert_eq!(out[0], 0.5 * 2.0 * 3.0 - 0.25);
        assert_eq!(out[48], -0.75); // sub-block 3, q = 0
        assert_eq!(out[96], 0.5 * 7.0 * 2.0);
        assert_eq!(out[144], 0.5 * 5.0);
    }

    #[test]
    fn q3_k_hand_built_block() {
        let mut block = [0u8; BLOCK_Q3_K_BYTES];
        block[108..110].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        let mut sc = [0i8; 16];
        sc[0] = 3;
        sc[7] = -2;
        sc[15] = 10;
        block[96..108].copy_from_slice(&pack_q3_k_scales(sc));
        block[0] = 0b0000_0001; // value 0: high bit set
        block[31] = 0b1000_0000; // value 7·32 + 31 = 255: high bit set
        block[32] = 0b0000_0010; // value 0: q = 2
        block[32 + 63] = 0b1100_0000; // value 128 + 96 + 31 = 255: q = 3
        block[32 + 15] = 0b0100_0000; // value 96 + 15 = 111 (sub-block 6): q = 1 − 4
        let mut out = [f32::NAN; QK_K];
        dequantize_block_q3_k(&block, &mut out);
        assert_eq!(out[0], 0.5 * 3.0 * 2.0);
        assert_eq!(out[1], 0.5 * 3.0 * -4.0); // q = 0, high bit clear
        assert_eq!(out[255], 0.5 * 10.0 * 3.0);
        assert_eq!(out[127], 0.5 * -2.0 * -4.0); // sub-block 7
        assert_eq!(out[111], 0.0); // sub-block 6 has scale 0
    }
}
