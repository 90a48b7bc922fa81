//! The scalar reference of the `fast` precision's row dots, which every SIMD path equals to
//! the bit (the arithmetic is stated in [`super`]'s documentation): a weight row read one
//! 32-value sub-block at a time, its integer sums with the vector's 8-bit values, scaled
//! and added into the four chains.

use super::{BLOCK, Q8Row, Sum, supports};
use crate::quant::float::f16_le_to_f32;
use crate::quant::iq4::{IQ4_LEVELS, IQ4_NL_QS_OFFSET, IQ4_XS_QS_OFFSET, iq4_xs_scale};
use crate::quant::k_quants::{
    Q4_K_QS_OFFSET, Q5_K_QH_OFFSET, Q5_K_QS_OFFSET, Q6_K_D_OFFSET, Q6_K_QH_OFFSET,
    Q6_K_SCALES_OFFSET, scale_min_pairs,
};
use crate::quant::k_quants_small::{
    Q2_K_D_OFFSET, Q2_K_QS_OFFSET, Q3_K_D_OFFSET, Q3_K_QS_OFFSET, q3_k_scales_all,
};
use crate::{DType, KernelError};

/// The chain that block `b` of a row of `blocks` goes into: `b mod 4` in the row's whole
/// quads; the blocks after the last whole quad take the chains of their places among the
/// row's last 4 blocks (block `blocks - 1` chain 3), when the row has 4 blocks or more.
pub fn chain(b: usize, blocks: usize) -> usize {
    if b < blocks / 4 * 4 || blocks < 4 {
        b % 4
    } else {
        b + 4 - blocks
    }
}

/// The total of four chains, in the one order every path adds them.
pub fn add_chains<S: Sum>(c: [S; 4]) -> S {
    (c[0] + c[2]) + (c[1] + c[3])
}

/// The scalar reference: `row` (whole blocks of `dtype`, one 32-value block per scale of
/// `x`) dotted with quantized vector `x`.
pub fn dot_reference(dtype: DType, row: &[u8], x: Q8Row<'_>) -> Result<f32, KernelError> {
    dot_reference_in(dtype, row, x)
}

/// [`dot_reference`] summed in `S` ([`Sum`]).
pub fn dot_reference_in<S: Sum>(dtype: DType, row: &[u8], x: Q8Row<'_>) -> Result<S, KernelError> {
    let values = dtype.block_elems();
    let bytes = dtype.block_bytes();
    let expected = x.d.len() * BLOCK / values * bytes;
    if !supports(dtype) || row.len() != expected || !(x.d.len() * BLOCK).is_multiple_of(values) {
        return Err(KernelError::ByteLength {
            what: "an 8-bit-activation weight row (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, \
                   Q4_K, Q5_K, Q6_K, IQ4_NL or IQ4_XS)",
            expected,
            actual: row.len(),
        });
    }
    let mut chains = [S::default(); 4];
    let mut mins = [S::default(); 4];
    for b in 0..x.d.len() {
        let per = values / BLOCK;
        let block = &row[b / per * bytes..][..bytes];
        let (w, dw, min) = sub_block(dtype, block, b % per);
        let xq = &x.qs[b * BLOCK..][..BLOCK];
        // Rounded once in `S` (exact in f64).
        let factor = S::from_f32(dw) * S::from_f32(x.d[b]);
        // |sum| < 2^24 (Q6_K's at most 32·32·127·128; the others' below 2^20): exact in f32.
        let sum: i32 = (0..BLOCK).map(|i| w[i] * i32::from(xq[i])).sum();
        let c = chain(b, x.d.len());
        chains[c] = S::mul_add(factor, S::from_f32(sum as f32), chains[c]);
        match min {
            Min::None => {}
            Min::Block(m) => {
                mins[c] = S::mul_add(S::from_f32(m), S::from_f32(x.dsum[b]), mins[c]);
            }
            // Q2_K: Σ_h m_h·Σ_{i∈h} q_x, exact, under the factor dmin·d_x.
            Min::Halves(dmin, m) => {
                let sum = m[0] * x.hsum[2 * b] + m[1] * x.hsum[2 * b + 1];
                let factor = S::from_f32(dmin) * S::from_f32(x.d[b]);
                mins[c] = S::mul_add(factor, S::from_f32(sum as f32), mins[c]);
            }
        }
    }
    let (total, mins) = (add_chains(chains), add_chains(mins));
    Ok(match dtype {
        DType::Q4_1 | DType::Q5_1 => total + mins,
        DType::Q2K | DType::Q4K | DType::Q5K => total - mins,
        _ => total,
    })
}

/// The min term of a sub-block.
enum Min {
    None,
    /// Its factor, times the vector's `d·Σq` of the block: Q4_1's and Q5_1's `m` (added),
    /// Q4_K's and Q5_K's `dmin·m` (taken away).
    Block(f32),
    /// Q2_K's: `dmin` and the 4-bit mins of its two 16-value halves (taken away).
    Halves(f32, [i32; 2]),
}

/// Sub-block `j` (32 values) of a weight block: its integer values (Q6_K's, Q3_K's and
/// Q2_K's times their 16-value sub-blocks' scales), its scale and its min term. Only for
/// the types [`supports`] names.
fn sub_block(dtype: DType, block: &[u8], j: usize) -> ([i32; 32], f32, Min) {
    let d = f16_le_to_f32([block[0], block[1]]);
    let nibble = |qs: &[u8], i: usize| i32::from(if i < 16 { qs[i] & 15 } else { qs[i - 16] >> 4 });
    let level = |q: i32| i32::from(IQ4_LEVELS[q as usize]);
    match dtype {
        DType::Q8_0 => (
            std::array::from_fn(|i| i32::from(block[2 + i] as i8)),
            d,
            Min::None,
        ),
        DType::Q4_0 => (
            std::array::from_fn(|i| nibble(&block[2..], i) - 8),
            d,
            Min::None,
        ),
        DType::Q4_1 => {
            let m = f16_le_to_f32([block[2], block[3]]);
            (
                std::array::from_fn(|i| nibble(&block[4..], i)),
                d,
                Min::Block(m),
            )
        }
        // The fifth bit of value i is bit i of the little-endian word before the nibbles.
        DType::Q5_0 => {
            let high = u32::from_le_bytes([block[2], block[3], block[4], block[5]]);
            let q = |i: usize| nibble(&block[6..], i) | (((high >> i) & 1) << 4) as i32;
            (std::array::from_fn(|i| q(i) - 16), d, Min::None)
        }
        DType::Q5_1 => {
            let m = f16_le_to_f32([block[2], block[3]]);
            let high = u32::from_le_bytes([block[4], block[5], block[6], block[7]]);
            let q = |i: usize| nibble(&block[8..], i) | (((high >> i) & 1) << 4) as i32;
            (std::array::from_fn(q), d, Min::Block(m))
        }
        // Q6_K: sub-block j = 4h + k is the low (k < 2) or high nibbles of
        // ql[64h + 32·(k mod 2)..] with bits 2k.. of qh[32h..] above them, value q − 32;
        // its halves are scaled by sc[8h + 2k] and sc[8h + 2k + 1], in the integers.
        DType::Q6K => {
            let (h, k) = (j / 4, j % 4);
            let ql = &block[64 * h + 32 * (k % 2)..][..32];
            let qh = &block[Q6_K_QH_OFFSET + 32 * h..][..32];
            let sc = |i: usize| i32::from(block[Q6_K_SCALES_OFFSET + 8 * h + 2 * k + i / 16] as i8);
            let q = |i: usize| {
                let low = (ql[i] >> (4 * (k / 2))) & 15;
                let high = (qh[i] >> (2 * k)) & 3;
                i32::from(low | (high << 4)) - 32
            };
            let d = f16_le_to_f32([block[Q6_K_D_OFFSET], block[Q6_K_D_OFFSET + 1]]);
            (std::array::from_fn(|i| q(i) * sc(i)), d, Min::None)
        }
        // Q2_K: sub-block j = 4h + k is bits 2k.. of qs[32h..]; its halves' 4-bit scales
        // (the low nibbles of bytes 8h + 2k and 8h + 2k + 1) multiply them in the integers,
        // under `d`, and their mins (the high nibbles) are its min term, under `dmin`.
        DType::Q2K => {
            let (h, k) = (j / 4, j % 4);
            let qs = &block[Q2_K_QS_OFFSET + 32 * h..][..32];
            let sc = [block[8 * h + 2 * k], block[8 * h + 2 * k + 1]];
            let q = |i: usize| i32::from((qs[i] >> (2 * k)) & 3) * i32::from(sc[i / 16] & 0x0f);
            let at = Q2_K_D_OFFSET;
            let (d, dmin) = (
                f16_le_to_f32([block[at], block[at + 1]]),
                f16_le_to_f32([block[at + 2], block[at + 3]]),
            );
            let mins = sc.map(|s| i32::from(s >> 4));
            (std::array::from_fn(q), d, Min::Halves(dmin, mins))
        }
        // Q3_K: sub-block j = 4h + k is bits 2k.. of qs[32h..], less 4 where bit j of
        // hmask[i] is clear; its halves are scaled by sc[2j] and sc[2j + 1] (signed, 6-bit),
        // in the integers, and `d` is its factor.
        DType::Q3K => {
            let (h, k) = (j / 4, j % 4);
            let qs = &block[Q3_K_QS_OFFSET + 32 * h..][..32];
            let sc = q3_k_scales_all(block.try_into().expect("a Q3_K block"));
            let q = |i: usize| {
                let low = i32::from((qs[i] >> (2 * k)) & 3);
                let high = (block[i] >> j) & 1;
                (low - if high == 0 { 4 } else { 0 }) * i32::from(sc[2 * j + i / 16])
            };
            let d = f16_le_to_f32([block[Q3_K_D_OFFSET], block[Q3_K_D_OFFSET + 1]]);
            (std::array::from_fn(q), d, Min::None)
        }
        // Q4_K and Q5_K: sub-blocks 2c and 2c + 1 are the low and high nibbles of 32
        // bytes; Q5_K's fifth bit of value i is bit j of qh[i].
        DType::Q4K | DType::Q5K => {
            let (ds, dm) = scale_min_pairs(block)[j];
            let five = dtype == DType::Q5K;
            let at = if five { Q5_K_QS_OFFSET } else { Q4_K_QS_OFFSET };
            let chunk = &block[at + 32 * (j / 2)..][..32];
            let shift = 4 * (j % 2);
            let high = |i: usize| {
                if five {
                    i32::from((block[Q5_K_QH_OFFSET + i] >> j) & 1) << 4
                } else {
                    0
                }
            };
            (
                std::array::from_fn(|i| i32::from((chunk[i] >> shift) & 15) | high(i)),
                ds,
                Min::Block(dm),
            )
        }
        // IQ4_NL and IQ4_XS: the levels of the nibbles, laid out as Q4_0's; IQ4_XS's
        // sub-block j reads qs[16j..] under the scale d·(sc_j − 32).
        DType::IQ4NL => {
            let qs = &block[IQ4_NL_QS_OFFSET..];
            (std::array::from_fn(|i| level(nibble(qs, i))), d, Min::None)
        }
        DType::IQ4XS => {
            let qs = &block[IQ4_XS_QS_OFFSET + 16 * j..];
            let scale = d * f32::from(iq4_xs_scale(j, block));
            (
                std::array::from_fn(|i| level(nibble(qs, i))),
                scale,
                Min::None,
            )
        }
        other => unreachable!("{other:?} has no 8-bit-activation kernel (checked by `supports`)"),
    }
}
