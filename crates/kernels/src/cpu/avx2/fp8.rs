//! The AVX2 row-dot of FP8 (e4m3fn) blocks, on the helpers and the contract of the parent
//! module. A code widens through f16: moved into f16's layout (sign to bit 15, exponent and
//! mantissa up 7 bits), it reads as its value · 2^-8 exactly, subnormals included, because
//! f16's exponent bias is 15 where e4m3fn's is 7; the block's scale carries the 2^8 back.

use std::arch::x86_64::*;

use super::{accumulate_block, finish, for_each_block_pair, load16};
use crate::quant::fp8::{F8_E4M3_BLOCK_BYTES, block_scale};

/// 16 e4m3fn codes as the f16 bits of value · 2^-8; a NaN code (S.1111.111) becomes an
/// f16 NaN.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn e4m3_as_f16(codes: __m128i) -> __m256i {
    let wide = _mm256_cvtepu8_epi16(codes);
    let magnitude = _mm256_and_si256(wide, _mm256_set1_epi16(0x7f));
    let sign = _mm256_slli_epi16::<8>(_mm256_and_si256(wide, _mm256_set1_epi16(0x80)));
    let bits = _mm256_or_si256(sign, _mm256_slli_epi16::<7>(magnitude));
    let nan = _mm256_cmpeq_epi16(magnitude, _mm256_set1_epi16(0x7f));
    _mm256_or_si256(bits, _mm256_and_si256(nan, _mm256_set1_epi16(0x7c00)))
}

/// A block's 32 codes as 4 × 8 floats, each its value · 2^-8.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn unpack(block: &[u8; F8_E4M3_BLOCK_BYTES]) -> [__m256; 4] {
    let lo = e4m3_as_f16(load16(block, 4));
    let hi = e4m3_as_f16(load16(block, 20));
    [
        _mm256_cvtph_ps(_mm256_castsi256_si128(lo)),
        _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(lo)),
        _mm256_cvtph_ps(_mm256_castsi256_si128(hi)),
        _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(hi)),
    ]
}

/// FP8 row: blocks of (f32 s, 32 × e4m3fn); value = s·e4m3(q).
///
/// # Safety
/// Needs AVX2, FMA and F16C; `w.len() == x.len() / 32 * 36` for every `x`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_f8_e4m3<const T: usize>(w: &[u8], xs: [&[f32]; T]) -> [f32; T] {
    let mut totals = [[_mm256_setzero_ps(); T]; 2];
    for_each_block_pair::<F8_E4M3_BLOCK_BYTES>(
        w,
        #[inline(always)]
        |block, b, parity| {
            let q = unpack(block);
            // Exact: a power of two (a scale near f32's largest would overflow, and no
            // checkpoint's is).
            let d = _mm256_set1_ps(block_scale(block) * 256.0);
            // SAFETY: b·32 + 32 <= x.len() by the row length.
            unsafe { accumulate_block(&mut totals[parity], &q, d, &xs, b) };
        },
    );
    finish(totals)
}
