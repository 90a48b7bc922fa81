//! AVX2 row-dots of the 256-value types Q5_K, Q3_K, Q2_K and IQ4_XS, on the helpers and the
//! contract of the parent module.
//!
//! A block is taken as 8 chunks of 32 values, each unpacked into 4 × 8 floats in registers
//! and added into the running totals like one 32-value block of Q8_0 (`accumulate_block`,
//! chunk `c` of block `i` at index `8i + c`); chunks alternate between the two sets of
//! accumulators. Where one scale covers the chunk it multiplies the chunk's sum; where the
//! chunk spans two 16-value sub-blocks or has a minimum, the weights are scaled in registers
//! and the chunk's sum is added as it is.

use std::arch::x86_64::*;

use super::{accumulate_block, f16_at, finish, iq4_table, unpack_iq4, widen_32};
use crate::quant::iq4::{IQ4_XS_QS_OFFSET, iq4_xs_scale};
use crate::quant::k_quants::{BLOCK_Q5_K_BYTES, Q5_K_QH_OFFSET, Q5_K_QS_OFFSET, scale_min_pairs};
use crate::quant::k_quants_small::{
    BLOCK_Q2_K_BYTES, BLOCK_Q3_K_BYTES, Q2_K_QS_OFFSET, Q3_K_QS_OFFSET, q2_k_scales, q3_k_scales,
};

/// Calls `f(c, parity)` for the chunks `c` in `0..n` (`n` even) with `parity = c mod 2`, two
/// at a time so that the choice of accumulators is static.
#[inline(always)]
fn in_pairs(n: usize, mut f: impl FnMut(usize, usize)) {
    for c in (0..n).step_by(2) {
        f(c, 0);
        f(c + 1, 1);
    }
}

/// Loads `block[at..at + 32]`.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn load32(block: &[u8], at: usize) -> __m256i {
    let bytes = &block[at..at + 32];
    // SAFETY: `bytes` is 32 bytes (the slice above is bounds-checked).
    unsafe { _mm256_loadu_si256(bytes.as_ptr().cast()) }
}

/// 32 signed bytes as 4 × 8 floats, in byte order.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn widen_256(v: __m256i) -> [__m256; 4] {
    widen_32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v))
}

/// 0xff in each byte of `v` that has bit `bit` (0..8) set, else 0.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn bit_set(v: __m256i, bit: usize) -> __m256i {
    let mask = _mm256_set1_epi8((1u8 << bit) as i8);
    _mm256_cmpeq_epi8(_mm256_and_si256(v, mask), mask)
}

/// Bits `2j..2j + 2` of each byte of `v`.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn two_bits(v: __m256i, j: usize) -> __m256i {
    let shifted = _mm256_srl_epi16(v, _mm_cvtsi32_si128(2 * j as i32));
    _mm256_and_si256(shifted, _mm256_set1_epi8(0x03))
}

/// `(d·q − m)` of each lane, for 8-lane parts `q` with the scale `d` and minimum `m` given
/// per half (16 values) of the chunk.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn scale_min(q: [__m256; 4], halves: [(f32, f32); 2]) -> [__m256; 4] {
    let (d0, m0) = (_mm256_set1_ps(halves[0].0), _mm256_set1_ps(halves[0].1));
    let (d1, m1) = (_mm256_set1_ps(halves[1].0), _mm256_set1_ps(halves[1].1));
    [
        _mm256_fmsub_ps(d0, q[0], m0),
        _mm256_fmsub_ps(d0, q[1], m0),
        _mm256_fmsub_ps(d1, q[2], m1),
        _mm256_fmsub_ps(d1, q[3], m1),
    ]
}

/// Q5_K row: the Q4_K layout plus a fifth bit per quant; value = (d·sc)·q − dmin·m.
///
/// # Safety
/// Needs AVX2, FMA and F16C; `w.len() == x.len() / 256 * 176` for every `x`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q5_k<const T: usize>(w: &[u8], xs: [&[f32]; T]) -> [f32; T] {
    let one = _mm256_set1_ps(1.0);
    let low = _mm256_set1_epi8(0x0f);
    let four = _mm256_set1_epi8(0x10); // bit 4
    let mut totals = [[_mm256_setzero_ps(); T]; 2];
    let (blocks, _) = w.as_chunks::<BLOCK_Q5_K_BYTES>();
    for (i, block) in blocks.iter().enumerate() {
        let pairs = scale_min_pairs(block);
        let qh = load32(block, Q5_K_QH_OFFSET);
        let mut nibbles = _mm256_setzero_si256();
        // Sub-block c: the low (c even) or high (c odd) nibbles of qs[32·(c/2)..], bit c of qh.
        in_pairs(
            8,
            #[inline(always)]
            |c, parity| {
                if parity == 0 {
                    nibbles = load32(block, Q5_K_QS_OFFSET + 16 * c);
                }
                let nib = match parity {
                    0 => _mm256_and_si256(nibbles, low),
                    _ => _mm256_and_si256(_mm256_srli_epi16::<4>(nibbles), low),
                };
                let q = _mm256_or_si256(nib, _mm256_and_si256(bit_set(qh, c), four));
                let weights = scale_min(widen_256(q), [pairs[c]; 2]);
                // SAFETY: (8i + c)·32 + 32 <= x.len() by the row length.
                unsafe { accumulate_block(&mut totals[parity], &weights, one, &xs, 8 * i + c) };
            },
        );
    }
    finish(totals)
}

/// Q2_K row: value = (d·sc)·q − dmin·m with 2-bit `q`, 16-value sub-blocks.
///
/// # Safety
/// Needs AVX2, FMA and F16C; `w.len() == x.len() / 256 * 84` for every `x`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q2_k<const T: usize>(w: &[u8], xs: [&[f32]; T]) -> [f32; T] {
    let one = _mm256_set1_ps(1.0);
    let mut totals = [[_mm256_setzero_ps(); T]; 2];
    let (blocks, _) = w.as_chunks::<BLOCK_Q2_K_BYTES>();
    for (i, block) in blocks.iter().enumerate() {
        let scales = q2_k_scales(block);
        for h in 0..2 {
            let qs = load32(block, Q2_K_QS_OFFSET + 32 * h);
            // Chunk 4h + j: bits 2j.. of qs[32h..]; sub-blocks 8h + 2j and 8h + 2j + 1.
            in_pairs(
                4,
                #[inline(always)]
                |j, parity| {
                    let c = 4 * h + j;
                    let q = widen_256(two_bits(qs, j));
                    let weights = scale_min(q, [scales[2 * c], scales[2 * c + 1]]);
                    // SAFETY: (8i + c)·32 + 32 <= x.len() by the row length.
                    unsafe { accumulate_block(&mut totals[parity], &weights, one, &xs, 8 * i + c) };
                },
            );
        }
    }
    finish(totals)
}

/// Q3_K row: value = d·(sc − 32)·q with `q` the 2 low bits minus 4 unless the `hmask` bit is
/// set, 16-value sub-blocks.
///
/// # Safety
/// Needs AVX2, FMA and F16C; `w.len() == x.len() / 256 * 110` for every `x`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q3_k<const T: usize>(w: &[u8], xs: [&[f32]; T]) -> [f32; T] {
    let one = _mm256_set1_ps(1.0);
    let four = _mm256_set1_epi8(4);
    let mut totals = [[_mm256_setzero_ps(); T]; 2];
    let (blocks, _) = w.as_chunks::<BLOCK_Q3_K_BYTES>();
    for (i, block) in blocks.iter().enumerate() {
        let scales = q3_k_scales(block);
        let hmask = load32(block, 0);
        for h in 0..2 {
            let qs = load32(block, Q3_K_QS_OFFSET + 32 * h);
            // Chunk c = 4h + j: bits 2j.. of qs[32h..], bit c of hmask.
            in_pairs(
                4,
                #[inline(always)]
                |j, parity| {
                    let c = 4 * h + j;
                    let minus = _mm256_andnot_si256(bit_set(hmask, c), four);
                    let q = widen_256(_mm256_sub_epi8(two_bits(qs, j), minus));
                    let halves = [(scales[2 * c], 0.0), (scales[2 * c + 1], 0.0)];
                    let weights = scale_min(q, halves);
                    // SAFETY: (8i + c)·32 + 32 <= x.len() by the row length.
                    unsafe { accumulate_block(&mut totals[parity], &weights, one, &xs, 8 * i + c) };
                },
            );
        }
    }
    finish(totals)
}

/// IQ4_XS row: value = d·(sc − 32)·LEVELS[q], 32-value sub-blocks laid out as IQ4_NL blocks.
///
/// # Safety
/// Needs AVX2, FMA and F16C; `w.len() == x.len() / 256 * 136` for every `x`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_iq4_xs<const T: usize>(w: &[u8], xs: [&[f32]; T]) -> [f32; T] {
    let table = iq4_table();
    let mut totals = [[_mm256_setzero_ps(); T]; 2];
    let (blocks, _) = w.as_chunks::<136>();
    for (i, block) in blocks.iter().enumerate() {
        let d = f16_at(block, 0);
        in_pairs(
            8,
            #[inline(always)]
            |s, parity| {
                let at = IQ4_XS_QS_OFFSET + 16 * s;
                let nibbles = &block[at..at + 16];
                // SAFETY: `nibbles` is 16 bytes (the slice above is bounds-checked).
                let qs = unsafe { _mm_loadu_si128(nibbles.as_ptr().cast()) };
                let q = unpack_iq4(qs, table);
                let dl = _mm256_set1_ps(d * f32::from(iq4_xs_scale(s, block)));
                // SAFETY: (8i + s)·32 + 32 <= x.len() by the row length.
                unsafe { accumulate_block(&mut totals[parity], &q, dl, &xs, 8 * i + s) };
            },
        );
    }
    finish(totals)
}
