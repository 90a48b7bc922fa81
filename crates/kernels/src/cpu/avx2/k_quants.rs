//! AVX2 row-dots of the 256-value types Q4_K, Q5_K, Q6_K, Q3_K, Q2_K and IQ4_XS, on the
//! helpers and the contract of the parent module.
//!
//! A block is taken as 8 chunks of 32 values, each unpacked into 4 × 8 floats in registers
//! and added into the running totals like one 32-value block of Q8_0 (`accumulate_block`,
//! chunk `c` of block `i` at index `8i + c`); chunks alternate between the two sets of
//! accumulators. Where one scale covers the chunk it multiplies the chunk's sum; where the
//! chunk spans two 16-value sub-blocks or has a minimum, the weights are scaled in registers
//! and the chunk's sum is added as it is.

use std::arch::x86_64::*;

use super::{
    accumulate_block, f16_at, f16_pair, finish, iq4_table, load16, nibble_words, unpack_iq4,
    widen_32, widen_i8,
};
use crate::quant::iq4::{BLOCK_IQ4_XS_BYTES, IQ4_XS_QS_OFFSET, iq4_xs_scale};
use crate::quant::k_quants::{
    BLOCK_Q4_K_BYTES, BLOCK_Q5_K_BYTES, BLOCK_Q6_K_BYTES, K_SCALE_SIZE, Q4_K_QS_OFFSET,
    Q4_K_SCALES_OFFSET, Q5_K_QH_OFFSET, Q5_K_QS_OFFSET, Q6_K_D_OFFSET, Q6_K_QH_OFFSET,
    Q6_K_SCALES_OFFSET, q4_k_scales_mins,
};
use crate::quant::k_quants_small::{
    BLOCK_Q2_K_BYTES, BLOCK_Q3_K_BYTES, Q2_K_D_OFFSET, Q2_K_QS_OFFSET, Q3_K_D_OFFSET,
    Q3_K_QS_OFFSET, q3_k_scales_all,
};

/// Σ over the 256-value blocks of a row, chunk by chunk: `prepare(block)` once per block
/// (its scales), then for each chunk `c` in 0..8, `chunk(block, &prepared, c)` gives the
/// chunk's 32 values as 4 × 8 floats and the scale of their dot with `x`. Chunks alternate
/// between two sets of accumulators, two at a time so that the choice is static.
///
/// # Safety
/// Needs AVX2, FMA and F16C; `w.len() == x.len() / 256 * BYTES` for every `x`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_chunks<const BYTES: usize, const T: usize, P>(
    w: &[u8],
    xs: [&[f32]; T],
    prepare: impl Fn(&[u8; BYTES]) -> P,
    chunk: impl Fn(&[u8; BYTES], &P, usize) -> Chunk,
) -> [f32; T] {
    // SAFETY: same features and row length (the caller's contract).
    unsafe {
        dot_chunk_pairs::<BYTES, T, P>(
            w,
            xs,
            prepare,
            #[inline(always)]
            |block, prepared, c| [chunk(block, prepared, c), chunk(block, prepared, c + 1)],
        )
    }
}

/// A chunk's 32 values as 4 × 8 floats, and the scale of their dot with `x`.
type Chunk = ([__m256; 4], __m256);

/// [`dot_chunks`] with chunks `c` and `c + 1` (`c` even) given by one call of `pair`, for
/// the types whose two chunks come from the same bytes.
///
/// # Safety
/// As [`dot_chunks`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_chunk_pairs<const BYTES: usize, const T: usize, P>(
    w: &[u8],
    xs: [&[f32]; T],
    prepare: impl Fn(&[u8; BYTES]) -> P,
    pair: impl Fn(&[u8; BYTES], &P, usize) -> [Chunk; 2],
) -> [f32; T] {
    let mut totals = [[_mm256_setzero_ps(); T]; 2];
    let (blocks, _) = w.as_chunks::<BYTES>();
    for (i, block) in blocks.iter().enumerate() {
        let prepared = prepare(block);
        for c in (0..8).step_by(2) {
            let [(q0, scale0), (q1, scale1)] = pair(block, &prepared, c);
            // SAFETY: (8i + c + 1)·32 + 32 <= x.len() by the row length.
            unsafe {
                accumulate_block(&mut totals[0], &q0, scale0, &xs, 8 * i + c);
                accumulate_block(&mut totals[1], &q1, scale1, &xs, 8 * i + c + 1);
            }
        }
    }
    finish(totals)
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
    let [(d0, m0), (d1, m1)] = halves;
    scale_min_lanes(
        q,
        [
            (_mm256_set1_ps(d0), _mm256_set1_ps(m0)),
            (_mm256_set1_ps(d1), _mm256_set1_ps(m1)),
        ],
    )
}

/// [`scale_min`] with each half's `d` and `m` already in every lane.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn scale_min_lanes(q: [__m256; 4], halves: [(__m256, __m256); 2]) -> [__m256; 4] {
    let [(d0, m0), (d1, m1)] = halves;
    [
        _mm256_fmsub_ps(d0, q[0], m0),
        _mm256_fmsub_ps(d0, q[1], m0),
        _mm256_fmsub_ps(d1, q[2], m1),
        _mm256_fmsub_ps(d1, q[3], m1),
    ]
}

/// The sub-block scales of a Q4_K or Q5_K block as `(d·sc, dmin·m)` per sub-block, as
/// [`crate::quant::k_quants::scale_min_pairs`] gives them (the same products of the same
/// values, so the same bits): `d` and `dmin` converted together, the 6-bit scales and
/// minimums unpacked four to a word, each set multiplied in one register.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scales_mins(block: &[u8]) -> ScalesMins {
    let packed: &[u8; K_SCALE_SIZE] = (block[Q4_K_SCALES_OFFSET..][..K_SCALE_SIZE])
        .try_into()
        .expect("12 scale bytes");
    let (sc, m) = q4_k_scales_mins(packed);
    let d_dmin = f16_pair(block, 0);
    let d = _mm256_broadcastss_ps(d_dmin);
    let dmin = _mm256_broadcastss_ps(_mm_movehdup_ps(d_dmin));
    ScalesMins {
        scales: _mm256_mul_ps(d, bytes_as_floats(sc)),
        mins: _mm256_mul_ps(dmin, bytes_as_floats(m)),
    }
}

/// The 8 bytes of `bytes` (little-endian) as 8 floats.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn bytes_as_floats(bytes: u64) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(bytes as i64)))
}

/// A Q4_K or Q5_K block's `d·sc` and `dmin·m`, sub-block `j` in lane `j`.
#[derive(Clone, Copy)]
struct ScalesMins {
    scales: __m256,
    mins: __m256,
}

impl ScalesMins {
    /// Sub-block `j`'s scale and minimum, each in every lane.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn pair(&self, j: usize) -> (__m256, __m256) {
        let lane = _mm256_set1_epi32(j as i32);
        (
            _mm256_permutevar8x32_ps(self.scales, lane),
            _mm256_permutevar8x32_ps(self.mins, lane),
        )
    }
}

/// Q5_K row: the Q4_K layout plus a fifth bit per quant; value = (d·sc)·q − dmin·m.
///
/// # Safety
/// Needs AVX2, FMA and F16C; `w.len() == x.len() / 256 * 176` for every `x`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q5_k<const T: usize>(w: &[u8], xs: [&[f32]; T]) -> [f32; T] {
    let (one, low) = (_mm256_set1_ps(1.0), _mm256_set1_epi8(0x0f));
    let four = _mm256_set1_epi8(0x10); // bit 4
    // SAFETY: same features and row length (the caller's contract).
    unsafe {
        dot_chunks::<BLOCK_Q5_K_BYTES, T, _>(
            w,
            xs,
            #[inline(always)]
            |block| (scales_mins(block), load32(block, Q5_K_QH_OFFSET)),
            // Chunk c: the low (c even) or high (c odd) nibbles of qs[32·(c/2)..], bit c of qh.
            #[inline(always)]
            |block, (pairs, qh), c| {
                let nibbles = load32(block, Q5_K_QS_OFFSET + 32 * (c / 2));
                let nibbles = match c % 2 {
                    0 => nibbles,
                    _ => _mm256_srli_epi16::<4>(nibbles),
                };
                let high = _mm256_and_si256(bit_set(*qh, c), four);
                let q = _mm256_or_si256(_mm256_and_si256(nibbles, low), high);
                (scale_min_lanes(widen_256(q), [pairs.pair(c); 2]), one)
            },
        )
    }
}

/// Q4_K row: value = (d·sc)·q − dmin·m with 4-bit `q`, 32-value sub-blocks: Q5_K without
/// the high bits.
///
/// # Safety
/// Needs AVX2, FMA and F16C; `w.len() == x.len() / 256 * 144` for every `x`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q4_k<const T: usize>(w: &[u8], xs: [&[f32]; T]) -> [f32; T] {
    let (one, low) = (_mm256_set1_ps(1.0), _mm256_set1_epi8(0x0f));
    // SAFETY: same features and row length (the caller's contract).
    unsafe {
        dot_chunk_pairs::<BLOCK_Q4_K_BYTES, T, _>(
            w,
            xs,
            #[inline(always)]
            |block| scales_mins(block),
            // Chunks c and c + 1: the low and the high nibbles of qs[32·(c/2)..].
            #[inline(always)]
            |block, pairs, c| {
                let at = Q4_K_QS_OFFSET + 16 * c;
                let [lo, hi] = if T == 1 {
                    nibbles_as_floats(block, at)
                } else {
                    let nibbles = load32(block, at);
                    let high = _mm256_srli_epi16::<4>(nibbles);
                    [
                        widen_256(_mm256_and_si256(nibbles, low)),
                        widen_256(_mm256_and_si256(high, low)),
                    ]
                };
                [
                    (scale_min_lanes(lo, [pairs.pair(c); 2]), one),
                    (scale_min_lanes(hi, [pairs.pair(c + 1); 2]), one),
                ]
            },
        )
    }
}

/// The low and the high nibbles of the 32 bytes at `block[at..]` as 4 × 8 floats each, in
/// byte order: [`super::nibble_words`] of each 16 bytes (no byte shuffles), as
/// [`super::unpack_nibbles`] takes them for one vector.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn nibbles_as_floats(block: &[u8], at: usize) -> [[__m256; 4]; 2] {
    let [a0, b0, c0, d0] = nibble_words(block, at);
    let [a1, b1, c1, d1] = nibble_words(block, at + 16);
    let (lo, hi) = ([a0, b0, a1, b1], [c0, d0, c1, d1]);
    let mut out = [[_mm256_setzero_ps(); 4]; 2];
    for k in 0..4 {
        out[0][k] = _mm256_cvtepi32_ps(lo[k]);
        out[1][k] = _mm256_cvtepi32_ps(hi[k]);
    }
    out
}

/// Q6_K row: value = (d·sc)·(q − 32) with 6-bit `q` (4 low bits from `ql`, 2 high bits from
/// `qh`) and signed 8-bit `sc` per 16-value sub-block.
///
/// # Safety
/// Needs AVX2, FMA and F16C; `w.len() == x.len() / 256 * 210` for every `x`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q6_k<const T: usize>(w: &[u8], xs: [&[f32]; T]) -> [f32; T] {
    let (one, low, offset) = (
        _mm256_set1_ps(1.0),
        _mm256_set1_epi8(0x0f),
        _mm256_set1_epi8(32),
    );
    // SAFETY: same features and row length (the caller's contract).
    unsafe {
        dot_chunks::<BLOCK_Q6_K_BYTES, T, _>(
            w,
            xs,
            #[inline(always)]
            |block| f16_at(block, Q6_K_D_OFFSET),
            // Chunk c = 4h + k (h: which 128 values, k: which 32 of them): the low (k < 2)
            // or high nibbles of ql[64h + 32·(k mod 2)..], bits 2k.. of qh[32h..]; its two
            // halves scaled by sc[8h + 2k] and sc[8h + 2k + 1].
            #[inline(always)]
            |block, d, c| {
                let (h, k) = (c / 4, c % 4);
                let ql = load32(block, 64 * h + 32 * (k % 2));
                let nibbles = match k {
                    0 | 1 => ql,
                    _ => _mm256_srli_epi16::<4>(ql),
                };
                let qh = load32(block, Q6_K_QH_OFFSET + 32 * h);
                let high = _mm256_slli_epi16::<4>(two_bits(qh, k));
                let q = _mm256_or_si256(_mm256_and_si256(nibbles, low), high);
                let q = widen_256(_mm256_sub_epi8(q, offset));
                let sc = |i: usize| f32::from(block[Q6_K_SCALES_OFFSET + 8 * h + 2 * k + i] as i8);
                (scale_min(q, [(d * sc(0), 0.0), (d * sc(1), 0.0)]), one)
            },
        )
    }
}

/// Q2_K row: value = (d·sc)·q − dmin·m with 2-bit `q`, 16-value sub-blocks, against
/// vectors in the lane order of `interleave_q2_k` (`dot.rs`).
///
/// With 4 values to a sub-block, each chunk's values are looked up rather than converted:
/// `vpermilps` picks from a table of `d·sc·q − dmin·m` for q = 0..4 (lanes 0..4 for one
/// sub-block, 4..8 for the next) by the low 2 bits of each 32-bit lane, so shifting the
/// chunk's 32 bytes right by `8k + 2j` gives the values of bytes `4i + k` in lane `i`.
///
/// # Safety
/// Needs AVX2, FMA and F16C; `w.len() == x.len() / 256 * 84` for every `x`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q2_k<const T: usize>(w: &[u8], xs: [&[f32]; T]) -> [f32; T] {
    let one = _mm256_set1_ps(1.0);
    // SAFETY: same features and row length (the caller's contract).
    unsafe {
        dot_chunks::<BLOCK_Q2_K_BYTES, T, _>(
            w,
            xs,
            #[inline(always)]
            |block| q2_k_tables(block),
            // Chunk c = 4h + j: bits 2j.. of qs[32h..]; sub-blocks 2c and 2c + 1.
            #[inline(always)]
            |block, tables, c| {
                let qs = load32(block, Q2_K_QS_OFFSET + 32 * (c / 4));
                let lanes = |k: usize| {
                    let shift = _mm_cvtsi32_si128((8 * k + 2 * (c % 4)) as i32);
                    _mm256_permutevar_ps(tables[c], _mm256_srl_epi32(qs, shift))
                };
                ([lanes(0), lanes(1), lanes(2), lanes(3)], one)
            },
        )
    }
}

/// A Q2_K block's 8 lookup tables, one per chunk of 32 values: for chunk `c`, lanes `q` and
/// `4 + q` hold `(d·sc)·q − dmin·m` of sub-blocks `2c` and `2c + 1`, made as
/// [`crate::quant::k_quants_small::q2_k_scales`] and the dequantization make them.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q2_k_tables(block: &[u8; BLOCK_Q2_K_BYTES]) -> [__m256; 8] {
    let (packed, low) = (load16(block, 0), _mm_set1_epi8(0x0f));
    let scales = _mm_and_si128(packed, low);
    let mins = _mm_and_si128(_mm_srli_epi16::<4>(packed), low);
    let d = _mm256_set1_ps(f16_at(block, Q2_K_D_OFFSET));
    let dmin = _mm256_set1_ps(f16_at(block, Q2_K_D_OFFSET + 2));
    // Sub-blocks 0..8 and 8..16.
    let halves = [scales, _mm_srli_si128::<8>(scales)].map(|v| _mm256_mul_ps(d, widen_i8(v)));
    let minimums = [mins, _mm_srli_si128::<8>(mins)].map(|v| _mm256_mul_ps(dmin, widen_i8(v)));
    let steps = _mm256_setr_ps(0.0, 1.0, 2.0, 3.0, 0.0, 1.0, 2.0, 3.0);
    std::array::from_fn(|c| {
        let s = (2 * (c % 4)) as i32;
        let pick = _mm256_setr_epi32(s, s, s, s, s + 1, s + 1, s + 1, s + 1);
        let scale = _mm256_permutevar8x32_ps(halves[c / 4], pick);
        let minimum = _mm256_permutevar8x32_ps(minimums[c / 4], pick);
        _mm256_fmsub_ps(scale, steps, minimum)
    })
}

/// Q3_K row: value = d·(sc − 32)·q with `q` the 2 low bits minus 4 unless the `hmask` bit is
/// set, 16-value sub-blocks.
///
/// # Safety
/// Needs AVX2, FMA and F16C; `w.len() == x.len() / 256 * 110` for every `x`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q3_k<const T: usize>(w: &[u8], xs: [&[f32]; T]) -> [f32; T] {
    let (one, four) = (_mm256_set1_ps(1.0), _mm256_set1_epi8(4));
    // SAFETY: same features and row length (the caller's contract).
    unsafe {
        dot_chunks::<BLOCK_Q3_K_BYTES, T, _>(
            w,
            xs,
            #[inline(always)]
            |block| (q3_k_scales(block), load32(block, 0)),
            // Chunk c = 4h + j: bits 2j.. of qs[32h..], bit c of hmask; sub-blocks 2c, 2c + 1.
            #[inline(always)]
            |block, (scales, hmask), c| {
                let qs = load32(block, Q3_K_QS_OFFSET + 32 * (c / 4));
                let minus = _mm256_andnot_si256(bit_set(*hmask, c), four);
                let q = widen_256(_mm256_sub_epi8(two_bits(qs, c % 4), minus));
                let halves = [(scales[2 * c], 0.0), (scales[2 * c + 1], 0.0)];
                (scale_min(q, halves), one)
            },
        )
    }
}

/// A Q3_K block's 16 sub-block scales `d·(sc − 32)`, the same products as
/// [`crate::quant::k_quants_small::q3_k_scales`]: the scales unpacked eight to a word
/// ([`q3_k_scales_all`]), then widened and multiplied eight at a time. (The scalar form,
/// called once per block, took an eighth of this kernel's time.)
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q3_k_scales(block: &[u8; BLOCK_Q3_K_BYTES]) -> [f32; 16] {
    let sc = q3_k_scales_all(block);
    // SAFETY: `sc` is 16 bytes.
    let sc = unsafe { _mm_loadu_si128(sc.as_ptr().cast()) };
    let d = _mm256_set1_ps(f16_at(block, Q3_K_D_OFFSET));
    let [low, high] = [sc, _mm_srli_si128::<8>(sc)].map(|v| _mm256_mul_ps(d, widen_i8(v)));
    let mut out = [0.0; 16];
    let (first, second) = out.split_at_mut(8);
    // SAFETY: each half of `out` holds 8 floats.
    unsafe {
        _mm256_storeu_ps(first.as_mut_ptr(), low);
        _mm256_storeu_ps(second.as_mut_ptr(), high);
    }
    out
}

/// IQ4_XS row: value = d·(sc − 32)·LEVELS[q], 32-value sub-blocks laid out as IQ4_NL blocks.
///
/// # Safety
/// Needs AVX2, FMA and F16C; `w.len() == x.len() / 256 * 136` for every `x`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_iq4_xs<const T: usize>(w: &[u8], xs: [&[f32]; T]) -> [f32; T] {
    let table = iq4_table();
    // SAFETY: same features and row length (the caller's contract).
    unsafe {
        dot_chunks::<BLOCK_IQ4_XS_BYTES, T, _>(
            w,
            xs,
            #[inline(always)]
            |block| f16_at(block, 0),
            #[inline(always)]
            |block, d, s| {
                let q = unpack_iq4(load16(block, IQ4_XS_QS_OFFSET + 16 * s), table);
                (q, _mm256_set1_ps(d * f32::from(iq4_xs_scale(s, block))))
            },
        )
    }
}
