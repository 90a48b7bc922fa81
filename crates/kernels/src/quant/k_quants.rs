//! K-quants Q4_K, Q5_K and Q6_K: super-blocks of 256 values with per-sub-block scales
//! (Q2_K and Q3_K are in [`super::k_quants_small`]).
//!
//! Q4_K, 144 bytes (GGML `block_q4_K`): 8 sub-blocks of 32 values, each with a 6-bit scale
//! `sc` and 6-bit minimum `m`; `x = (d·sc)·q − (dmin·m)` with 4-bit `q`.
//!
//! | bytes   | field    | meaning                                              |
//! |---------|----------|------------------------------------------------------|
//! | 0..2    | `d`      | f16 super-block scale of the sub-block scales        |
//! | 2..4    | `dmin`   | f16 super-block scale of the sub-block minimums      |
//! | 4..16   | `scales` | 8 × (6-bit sc, 6-bit m), packed (see [`q4_k_scale_min`]) |
//! | 16..144 | `qs`     | 256 × 4-bit quants                                   |
//!
//! The quants come in 4 chunks of 32 bytes; chunk `c` holds sub-block `2c` in its low
//! nibbles and sub-block `2c + 1` in its high nibbles.
//!
//! Q5_K, 176 bytes (GGML `block_q5_K`): Q4_K with a fifth bit per quant,
//! `x = (d·sc)·q − (dmin·m)` with 5-bit `q`.
//!
//! | bytes   | field    | meaning                                          |
//! |---------|----------|--------------------------------------------------|
//! | 0..2    | `d`      | f16 super-block scale of the sub-block scales    |
//! | 2..4    | `dmin`   | f16 super-block scale of the sub-block minimums  |
//! | 4..16   | `scales` | packed as in Q4_K                                |
//! | 16..48  | `qh`     | bit 4 of the quants                              |
//! | 48..176 | `qs`     | 256 × low 4 bits, laid out as in Q4_K            |
//!
//! Value `l` (0..32) of sub-block `s` takes bit `s` of `qh[l]` as its bit 4.
//!
//! Q6_K, 210 bytes (GGML `block_q6_K`): 16 sub-blocks of 16 values with signed 8-bit scales;
//! `x = (d·sc)·(q − 32)` with 6-bit `q` split into 4 low bits (`ql`) and 2 high bits (`qh`).
//!
//! | bytes    | field    | meaning                       |
//! |----------|----------|-------------------------------|
//! | 0..128   | `ql`     | low 4 bits of the quants      |
//! | 128..192 | `qh`     | high 2 bits of the quants     |
//! | 192..208 | `scales` | 16 × i8 sub-block scales      |
//! | 208..210 | `d`      | f16 super-block scale         |
//!
//! The block is two halves of 128 values; half `h` uses `ql[64h..64h+64]`,
//! `qh[32h..32h+32]` and `scales[8h..8h+8]`. Within a half, value `32k + l` (`k` in 0..4,
//! `l` in 0..32) takes the low (k = 0, 1) or high (k = 2, 3) nibble of `ql[l + 32·(k mod 2)]`,
//! bits `2k..2k+2` of `qh[l]`, and scale `scales[2k + l/16]`.

use super::float::f16_le_to_f32;

/// Values in one K-quant super-block.
pub const QK_K: usize = 256;

/// Bytes of one Q4_K block.
pub const BLOCK_Q4_K_BYTES: usize = 144;
/// Byte offset of the Q4_K f16 `dmin`.
pub const Q4_K_DMIN_OFFSET: usize = 2;
/// Byte offset of the packed Q4_K sub-block scales and minimums.
pub const Q4_K_SCALES_OFFSET: usize = 4;
/// Bytes of the packed Q4_K sub-block scales and minimums.
pub const K_SCALE_SIZE: usize = 12;
/// Byte offset of the Q4_K quants.
pub const Q4_K_QS_OFFSET: usize = 16;
/// Values in one Q4_K sub-block.
pub const Q4_K_SUB_BLOCK: usize = 32;

/// Bytes of one Q5_K block.
pub const BLOCK_Q5_K_BYTES: usize = 176;
/// Byte offset of the Q5_K high bits.
pub const Q5_K_QH_OFFSET: usize = 16;
/// Byte offset of the Q5_K low 4 bits of the quants.
pub const Q5_K_QS_OFFSET: usize = 48;

/// Bytes of one Q6_K block.
pub const BLOCK_Q6_K_BYTES: usize = 210;
/// Byte offset of the Q6_K high bits.
pub const Q6_K_QH_OFFSET: usize = 128;
/// Byte offset of the Q6_K signed sub-block scales.
pub const Q6_K_SCALES_OFFSET: usize = 192;
/// Byte offset of the Q6_K f16 super-block scale `d`.
pub const Q6_K_D_OFFSET: usize = 208;
/// Values in one Q6_K sub-block.
pub const Q6_K_SUB_BLOCK: usize = 16;

/// The 6-bit scale and minimum of Q4_K sub-block `j` (0..8) from the 12 packed bytes.
///
/// Bytes 0..4 hold the low 6 bits of the scales of sub-blocks 0..4, bytes 4..8 the low 6 bits
/// of their minimums; the top 2 bits of those 8 bytes are the high bits of sub-blocks 4..8,
/// whose low 4 bits sit in bytes 8..12 (scale in the low nibble, minimum in the high one).
/// Indices past 7 are taken modulo 8.
#[inline]
pub fn q4_k_scale_min(j: usize, scales: &[u8; K_SCALE_SIZE]) -> (u8, u8) {
    let j = j % 8;
    if j < 4 {
        (scales[j] & 0x3f, scales[j + 4] & 0x3f)
    } else {
        let sc = (scales[j + 4] & 0x0f) | ((scales[j - 4] >> 6) << 4);
        let m = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4);
        (sc, m)
    }
}

/// The 8 scales and the 8 minimums of a Q4_K block as the bytes of two little-endian
/// words (sub-block `j` in byte `j`): [`q4_k_scale_min`] for every `j` at once, four
/// sub-blocks to a 32-bit word.
#[inline]
pub fn q4_k_scales_mins(scales: &[u8; K_SCALE_SIZE]) -> (u64, u64) {
    let word = |at: usize| {
        u32::from_le_bytes([scales[at], scales[at + 1], scales[at + 2], scales[at + 3]])
    };
    let (low_scales, low_mins, high) = (word(0), word(4), word(8));
    // Sub-blocks 4..8: 4 low bits from bytes 8..12, the top 2 bits of bytes 0..8 as bits 4, 5.
    let high_scales = (high & 0x0f0f_0f0f) | ((low_scales >> 2) & 0x3030_3030);
    let high_mins = ((high >> 4) & 0x0f0f_0f0f) | ((low_mins >> 2) & 0x3030_3030);
    let join = |low: u32, high: u32| u64::from(low & 0x3f3f_3f3f) | (u64::from(high) << 32);
    (join(low_scales, high_scales), join(low_mins, high_mins))
}

/// Dequantizes one Q4_K block.
#[inline]
pub fn dequantize_block_q4_k(block: &[u8; BLOCK_Q4_K_BYTES], out: &mut [f32; QK_K]) {
    dequantize_scale_min_block::<false>(block, &block[Q4_K_QS_OFFSET..], &[0; 32], out);
}

/// Dequantizes one Q5_K block.
#[inline]
pub fn dequantize_block_q5_k(block: &[u8; BLOCK_Q5_K_BYTES], out: &mut [f32; QK_K]) {
    let mut qh = [0u8; 32];
    qh.copy_from_slice(&block[Q5_K_QH_OFFSET..Q5_K_QS_OFFSET]);
    dequantize_scale_min_block::<true>(block, &block[Q5_K_QS_OFFSET..], &qh, out);
}

/// The sub-block scales of a Q4_K or Q5_K block as f32 pairs `(d·sc, dmin·m)`, from the
/// block's first 16 bytes.
#[inline]
pub fn scale_min_pairs(block: &[u8]) -> [(f32, f32); 8] {
    let d = f16_le_to_f32([block[0], block[1]]);
    let dmin = f16_le_to_f32([block[2], block[3]]);
    let mut scales = [0u8; K_SCALE_SIZE];
    scales.copy_from_slice(&block[Q4_K_SCALES_OFFSET..Q4_K_QS_OFFSET]);
    std::array::from_fn(|j| {
        let (sc, m) = q4_k_scale_min(j, &scales);
        (d * f32::from(sc), dmin * f32::from(m))
    })
}

/// Q4_K and Q5_K: `(d·sc)·q − (dmin·m)` for each of the 8 sub-blocks, with the 4 low bits of
/// `q` from the 128 nibble bytes `qs` and, if `FIVE_BITS` (Q5_K), bit 4 from the 32 bytes
/// `qh`. A constant rather than a run-time flag: the Q4_K loop stays as fast as without it.
#[inline]
fn dequantize_scale_min_block<const FIVE_BITS: bool>(
    block: &[u8],
    qs: &[u8],
    qh: &[u8; 32],
    out: &mut [f32; QK_K],
) {
    let pairs = scale_min_pairs(block);
    // Each 32-byte chunk of quants feeds two sub-blocks of 32 values: 64 outputs.
    for (c, (chunk, out64)) in qs
        .chunks_exact(32)
        .zip(out.chunks_exact_mut(64))
        .enumerate()
    {
        let (d_lo, min_lo) = pairs[2 * c];
        let (d_hi, min_hi) = pairs[2 * c + 1];
        let (lo, hi) = out64.split_at_mut(Q4_K_SUB_BLOCK);
        for (((o_lo, o_hi), &byte), &h) in lo.iter_mut().zip(hi).zip(chunk).zip(qh) {
            let (bit_lo, bit_hi) = match FIVE_BITS {
                true => (((h >> (2 * c)) & 1) << 4, ((h >> (2 * c + 1)) & 1) << 4),
                false => (0, 0),
            };
            *o_lo = d_lo * f32::from((byte & 0x0f) | bit_lo) - min_lo;
            *o_hi = d_hi * f32::from((byte >> 4) | bit_hi) - min_hi;
        }
    }
}

/// Dequantizes one Q6_K block.
#[inline]
pub fn dequantize_block_q6_k(block: &[u8; BLOCK_Q6_K_BYTES], out: &mut [f32; QK_K]) {
    let d = f16_le_to_f32([block[Q6_K_D_OFFSET], block[Q6_K_D_OFFSET + 1]]);
    let ql_all = &block[..Q6_K_QH_OFFSET];
    let qh_all = &block[Q6_K_QH_OFFSET..Q6_K_SCALES_OFFSET];
    let sc_all = &block[Q6_K_SCALES_OFFSET..Q6_K_D_OFFSET];
    let halves = ql_all
        .chunks_exact(64)
        .zip(qh_all.chunks_exact(32))
        .zip(sc_all.chunks_exact(8))
        .zip(out.chunks_exact_mut(128));
    for (((ql, qh), sc), y) in halves {
        for l in 0..32 {
            let is = l / 16;
            let q1 = (ql[l] & 0x0f) | ((qh[l] & 0x03) << 4);
            let q2 = (ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 0x03) << 4);
            let q3 = (ql[l] >> 4) | (((qh[l] >> 4) & 0x03) << 4);
            let q4 = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 0x03) << 4);
            for (k, q) in [q1, q2, q3, q4].into_iter().enumerate() {
                // (d·sc)·q, in this order, as GGML's reference computes it.
                let scale = d * f32::from(sc[is + 2 * k] as i8);
                y[32 * k + l] = scale * f32::from(q as i8 - 32);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;

    #[test]
    fn all_scales_and_mins_at_once_are_each_sub_blocks() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..1000 {
            let mut scales = [0u8; K_SCALE_SIZE];
            for b in &mut scales {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1);
                *b = (state >> 56) as u8;
            }
            let (sc, m) = q4_k_scales_mins(&scales);
            for j in 0..8 {
                let want = q4_k_scale_min(j, &scales);
                assert_eq!(
                    ((sc >> (8 * j)) as u8, (m >> (8 * j)) as u8),
                    want,
                    "{scales:?} {j}"
                );
            }
        }
    }

    /// Packs eight 6-bit (scale, min) pairs the way GGML's Q4_K quantizer does.
    fn pack_scales(sc: [u8; 8], m: [u8; 8]) -> [u8; K_SCALE_SIZE] {
        let mut out = [0u8; K_SCALE_SIZE];
        for j in 0..8 {
            if j < 4 {
                out[j] = sc[j];
                out[j + 4] = m[j];
            } else {
                out[j + 4] = (sc[j] & 0x0f) | ((m[j] & 0x0f) << 4);
                out[j - 4] |= (sc[j] >> 4) << 6;
                out[j] |= (m[j] >> 4) << 6;
            }
        }
        out
    }

    #[test]
    fn scale_min_unpacks_what_ggml_packs() {
        let sc = [0, 63, 17, 42, 63, 1, 32, 48];
        let m = [63, 0, 5, 33, 16, 62, 31, 15];
        let packed = pack_scales(sc, m);
        for j in 0..8 {
            assert_eq!(q4_k_scale_min(j, &packed), (sc[j], m[j]), "sub-block {j}");
        }
    }

    /// The scale fields of the hand-built Q4_K and Q5_K blocks: d = 0.5, dmin = 0.25,
    /// sc = [1, 2, 3, 4, 5, 6, 7, 40], m = [0, 4, 0, 0, 0, 0, 0, 20].
    fn put_scales(block: &mut [u8]) {
        block[..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        block[2..4].copy_from_slice(&f16::from_f32(0.25).to_le_bytes());
        let sc = [1, 2, 3, 4, 5, 6, 7, 40];
        let m = [0, 4, 0, 0, 0, 0, 0, 20];
        block[4..16].copy_from_slice(&pack_scales(sc, m));
    }

    #[test]
    fn q4_k_hand_built_block() {
        let mut block = [0u8; BLOCK_Q4_K_BYTES];
        put_scales(&mut block);
        block[16] = 0x3a; // value 0: q = 10, sub-block 0; value 32: q = 3, sub-block 1
        block[143] = 0xf0; // value 223: q = 0, sub-block 6; value 255: q = 15, sub-block 7
        let mut out = [f32::NAN; QK_K];
        dequantize_block_q4_k(&block, &mut out);
        assert_eq!(out[0], 0.5 * 1.0 * 10.0);
        assert_eq!(out[32], 0.5 * 2.0 * 3.0 - 0.25 * 4.0);
        assert_eq!(out[33], -1.0); // q = 0 in sub-block 1
        assert_eq!(out[223], 0.0);
        assert_eq!(out[255], 0.5 * 40.0 * 15.0 - 0.25 * 20.0);
    }

    #[test]
    fn q5_k_high_bits_pick_the_sub_block_bit() {
        let mut block = [0u8; BLOCK_Q5_K_BYTES];
        put_scales(&mut block);
        // qh[0]: bit 0 for value 0 (sub-block 0), bit 7 for value 224 (sub-block 7);
        // qh[5]: bit 1 for value 32 + 5 (sub-block 1).
        block[16] = 0b1000_0001;
        block[21] = 0b0000_0010;
        block[48] = 0x3a; // value 0: low 4 bits 10; value 32: 3
        block[48 + 96] = 0xf0; // value 192: low 4 bits 0 (sub-block 6); value 224: 15
        let mut out = [f32::NAN; QK_K];
        dequantize_block_q5_k(&block, &mut out);
        assert_eq!(out[0], 0.5 * 1.0 * 26.0);
        assert_eq!(out[32], 0.5 * 2.0 * 3.0 - 0.25 * 4.0);
        assert_eq!(out[37], 0.5 * 2.0 * 16.0 - 0.25 * 4.0);
        assert_eq!(out[192], 0.0);
        assert_eq!(out[224], 0.5 * 40.0 * 31.0 - 0.25 * 20.0);
        assert_eq!(out[225], -5.0); // q = 0 in sub-block 7
    }

    #[test]
    fn q6_k_hand_built_block() {
        let mut block = [0u8; BLOCK_Q6_K_BYTES];
        block[208..210].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        for (i, s) in block[192..208].iter_mut().enumerate() {
            *s = (i as i8 - 8) as u8; // scales -8..8
        }
        // Value 0: low nibble of ql[0], bits 0..2 of qh[0]; value 64: high nibble of ql[0],
        // bits 4..6 of qh[0].
        block[0] = 0x5f; // q(0) low 4 bits = 15, q(64) low 4 bits = 5
        block[128] = 0b0010_0011; // q(0) high = 3 → 63; q(64) high = 2 → 37
        // Value 160 (half 1, k = 1, l = 0): low nibble of ql[64 + 32], bits 2..4 of qh[32].
        block[96] = 0x01;
        block[160] = 0b0000_0100;
        let mut out = [f32::NAN; QK_K];
        dequantize_block_q6_k(&block, &mut out);
        assert_eq!(out[0], 0.5 * -8.0 * (63.0 - 32.0)); // scale index 0
        assert_eq!(out[64], 0.5 * -4.0 * (37.0 - 32.0)); // scale index 4
        assert_eq!(out[160], 0.5 * 2.0 * (17.0 - 32.0)); // scale index 8 + 2 = 10 → 2
        assert_eq!(out[1], 0.5 * -8.0 * -32.0); // all-zero quant
    }
}
