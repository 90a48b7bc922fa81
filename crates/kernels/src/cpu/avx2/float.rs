//! The AVX2 row-dots of float rows (f32, f16, bf16), on the helpers and the contract of the
//! parent module.

use std::arch::x86_64::*;

use super::{f16_at, hsum, load8};

/// The length every `x` (and `a`) has at least: the products are taken over this many values.
fn common_len<const T: usize>(a: usize, xs: &[&[f32]; T]) -> usize {
    xs.iter().fold(a, |n, x| n.min(x.len()))
}

/// Σ a·x for each `x` in `xs`, over the shortest length.
///
/// # Safety
/// Needs AVX2 and FMA.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_f32<const T: usize>(a: &[f32], xs: [&[f32]; T]) -> [f32; T] {
    let n = common_len(a.len(), &xs);
    let mut acc = [[_mm256_setzero_ps(); 4]; T];
    let mut i = 0;
    while i + 32 <= n {
        for k in 0..4 {
            // SAFETY: i + 32 <= n bounds `a` and every `x`.
            let w = unsafe { load8(a, i + 8 * k) };
            for (acc, x) in acc.iter_mut().zip(&xs) {
                // SAFETY: as above.
                acc[k] = unsafe { _mm256_fmadd_ps(w, load8(x, i + 8 * k), acc[k]) };
            }
        }
        i += 32;
    }
    while i + 8 <= n {
        // SAFETY: i + 8 <= n bounds `a` and every `x`.
        let w = unsafe { load8(a, i) };
        for (acc, x) in acc.iter_mut().zip(&xs) {
            // SAFETY: as above.
            acc[0] = unsafe { _mm256_fmadd_ps(w, load8(x, i), acc[0]) };
        }
        i += 8;
    }
    let mut out = [0.0; T];
    for ((total, [a0, a1, a2, a3]), x) in out.iter_mut().zip(acc).zip(xs) {
        *total = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
        for j in i..n {
            *total += a[j] * x[j];
        }
    }
    out
}

/// Σ w·x for a row of 16-bit floats widened by `widen` (8 values from 16 bytes at a time).
///
/// # Safety
/// Needs AVX2, FMA and F16C; `w.len() >= 2 · n` for the common length `n` of the `xs`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_half<const T: usize>(
    w: &[u8],
    xs: [&[f32]; T],
    widen: impl Fn(__m128i) -> __m256,
    scalar: impl Fn(&[u8], usize) -> f32,
) -> [f32; T] {
    let n = common_len(w.len() / 2, &xs);
    let mut acc = [[_mm256_setzero_ps(); 2]; T];
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: 2·(i + 16) <= w.len().
        let (f0, f1) = unsafe {
            let h0 = _mm_loadu_si128(w.as_ptr().add(2 * i).cast());
            let h1 = _mm_loadu_si128(w.as_ptr().add(2 * i + 16).cast());
            (widen(h0), widen(h1))
        };
        for (acc, x) in acc.iter_mut().zip(&xs) {
            // SAFETY: i + 16 <= x.len().
            unsafe {
                acc[0] = _mm256_fmadd_ps(f0, load8(x, i), acc[0]);
                acc[1] = _mm256_fmadd_ps(f1, load8(x, i + 8), acc[1]);
            }
        }
        i += 16;
    }
    let mut out = [0.0; T];
    for ((total, [a0, a1]), x) in out.iter_mut().zip(acc).zip(xs) {
        *total = hsum(_mm256_add_ps(a0, a1));
        for (j, xj) in x.iter().enumerate().take(n).skip(i) {
            *total += scalar(w, 2 * j) * xj;
        }
    }
    out
}

/// Σ w·x for a row of f16 (`w` holds `2 · x.len()` bytes).
///
/// # Safety
/// Needs AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_f16<const T: usize>(w: &[u8], xs: [&[f32]; T]) -> [f32; T] {
    // SAFETY: same features; `w` covers the values (the caller's contract).
    unsafe { dot_half(w, xs, |h| _mm256_cvtph_ps(h), |w, at| f16_at(w, at)) }
}

/// Σ w·x for a row of bf16: a bf16 is the top half of an f32.
///
/// # Safety
/// Needs AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_bf16<const T: usize>(w: &[u8], xs: [&[f32]; T]) -> [f32; T] {
    // SAFETY: same features; `w` covers the values (the caller's contract).
    unsafe {
        dot_half(
            w,
            xs,
            |h| _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h))),
            |w, at| half::bf16::from_bits(u16::from_le_bytes([w[at], w[at + 1]])).to_f32(),
        )
    }
}
