//! AVX2 + FMA + F16C row-dot products (x86-64-v3).
//!
//! Every function here is `unsafe` only because it needs those CPU features; callers in
//! `dot.rs` check [`super::Features`] first and have already checked the slice lengths
//! (`w.len() == dtype.row_bytes(x.len())`). Loads are unaligned and stay inside the slices.

use std::arch::x86_64::*;

/// Sums the 8 lanes of `v`.
#[target_feature(enable = "avx2,fma")]
fn hsum(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps::<1>(v);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
    _mm_cvtss_f32(s)
}

/// The little-endian f16 at `bytes[at..at + 2]`, converted with F16C.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn f16_at(bytes: &[u8], at: usize) -> f32 {
    let bits = u16::from_le_bytes([bytes[at], bytes[at + 1]]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}

/// Loads 8 floats from `x[at..at + 8]`.
///
/// # Safety
/// Needs AVX; `at + 8 <= x.len()`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn load8(x: &[f32], at: usize) -> __m256 {
    debug_assert!(at + 8 <= x.len());
    // SAFETY: the caller guarantees `at + 8 <= x.len()`.
    unsafe { _mm256_loadu_ps(x.as_ptr().add(at)) }
}

/// Σ a·b for two f32 slices of equal length.
///
/// # Safety
/// Needs AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i + 32 <= n {
        for (k, acc) in acc.iter_mut().enumerate() {
            // SAFETY: i + 32 <= n bounds both slices.
            *acc = unsafe { _mm256_fmadd_ps(load8(a, i + 8 * k), load8(b, i + 8 * k), *acc) };
        }
        i += 32;
    }
    while i + 8 <= n {
        // SAFETY: i + 8 <= n bounds both slices.
        acc[0] = unsafe { _mm256_fmadd_ps(load8(a, i), load8(b, i), acc[0]) };
        i += 8;
    }
    let sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let mut total = hsum(sum);
    for j in i..n {
        total += a[j] * b[j];
    }
    total
}

/// Σ w·x for a row of f16 (`w` holds `2 · x.len()` bytes; `x.len()` a multiple of 8).
///
/// # Safety
/// Needs AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_f16(w: &[u8], x: &[f32]) -> f32 {
    let mut acc0 = _mm256_setzero_ps();
    let mut acc1 = _mm256_setzero_ps();
    let mut i = 0;
    while i + 16 <= x.len() {
        // SAFETY: 2·(i + 16) <= w.len() and i + 16 <= x.len().
        unsafe {
            let h0 = _mm_loadu_si128(w.as_ptr().add(2 * i).cast());
            let h1 = _mm_loadu_si128(w.as_ptr().add(2 * i + 16).cast());
            acc0 = _mm256_fmadd_ps(_mm256_cvtph_ps(h0), load8(x, i), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_cvtph_ps(h1), load8(x, i + 8), acc1);
        }
        i += 16;
    }
    let mut total = hsum(_mm256_add_ps(acc0, acc1));
    for (j, xj) in x.iter().enumerate().skip(i) {
        total += f16_at(w, 2 * j) * xj;
    }
    total
}

/// Σ w·x for a row of bf16.
///
/// # Safety
/// Needs AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_bf16(w: &[u8], x: &[f32]) -> f32 {
    let mut acc0 = _mm256_setzero_ps();
    let mut acc1 = _mm256_setzero_ps();
    let mut i = 0;
    while i + 16 <= x.len() {
        // SAFETY: 2·(i + 16) <= w.len() and i + 16 <= x.len().
        unsafe {
            let h0 = _mm_loadu_si128(w.as_ptr().add(2 * i).cast());
            let h1 = _mm_loadu_si128(w.as_ptr().add(2 * i + 16).cast());
            let f0 = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h0)));
            let f1 = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h1)));
            acc0 = _mm256_fmadd_ps(f0, load8(x, i), acc0);
            acc1 = _mm256_fmadd_ps(f1, load8(x, i + 8), acc1);
        }
        i += 16;
    }
    let mut total = hsum(_mm256_add_ps(acc0, acc1));
    for j in i..x.len() {
        let bits = u16::from_le_bytes([w[2 * j], w[2 * j + 1]]);
        total += half::bf16::from_bits(bits).to_f32() * x[j];
    }
    total
}

/// Q8_0 row: blocks of (f16 d, 32 × i8).
///
/// # Safety
/// Needs AVX2 and FMA; `w.len() == x.len() / 32 * 34`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q8_0(w: &[u8], x: &[f32]) -> f32 {
    let mut totals = [_mm256_setzero_ps(); 2];
    for (b, block) in w.chunks_exact(34).enumerate() {
        let xb = b * 32;
        // SAFETY: bytes 2..34 are inside the block; xb + 32 <= x.len().
        let acc = unsafe {
            let q = [0, 1, 2, 3].map(|k| {
                let bytes = _mm_loadl_epi64(block.as_ptr().add(2 + 8 * k).cast());
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes))
            });
            let even = _mm256_fmadd_ps(q[2], load8(x, xb + 16), _mm256_mul_ps(q[0], load8(x, xb)));
            let odd = _mm256_fmadd_ps(
                q[3],
                load8(x, xb + 24),
                _mm256_mul_ps(q[1], load8(x, xb + 8)),
            );
            _mm256_add_ps(even, odd)
        };
        // Alternate accumulators so consecutive blocks do not wait on each other.
        totals[b & 1] = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(block, 0)), acc, totals[b & 1]);
    }
    hsum(_mm256_add_ps(totals[0], totals[1]))
}

/// Unpacks 16 bytes of nibbles: low nibbles are elements 0..16, high nibbles 16..32.
/// Returns the products with `x[xb..xb + 32]` summed into one vector.
///
/// # Safety
/// Needs AVX2 and FMA; `xb + 32 <= x.len()`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn nibble_dot(qs: __m128i, offset: __m128i, x: &[f32], xb: usize) -> __m256 {
    let mask = _mm_set1_epi8(0x0f);
    let lo = _mm_sub_epi8(_mm_and_si128(qs, mask), offset);
    let hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16::<4>(qs), mask), offset);
    let q = [lo, _mm_srli_si128::<8>(lo), hi, _mm_srli_si128::<8>(hi)]
        .map(|part| _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part)));
    // Two short chains instead of one of four FMAs: the block's latency halves.
    // SAFETY: the caller guarantees xb + 32 <= x.len().
    unsafe {
        let even = _mm256_fmadd_ps(q[2], load8(x, xb + 16), _mm256_mul_ps(q[0], load8(x, xb)));
        let odd = _mm256_fmadd_ps(
            q[3],
            load8(x, xb + 24),
            _mm256_mul_ps(q[1], load8(x, xb + 8)),
        );
        _mm256_add_ps(even, odd)
    }
}

/// Q4_0 row: blocks of (f16 d, 16 bytes of nibbles); value = d·(q − 8).
///
/// # Safety
/// Needs AVX2 and FMA; `w.len() == x.len() / 32 * 18`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q4_0(w: &[u8], x: &[f32]) -> f32 {
    let eight = _mm_set1_epi8(8);
    let mut totals = [_mm256_setzero_ps(); 2];
    for (b, block) in w.chunks_exact(18).enumerate() {
        // SAFETY: bytes 2..18 are inside the block; b·32 + 32 <= x.len().
        let acc = unsafe {
            let qs = _mm_loadu_si128(block.as_ptr().add(2).cast());
            nibble_dot(qs, eight, x, b * 32)
        };
        totals[b & 1] = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(block, 0)), acc, totals[b & 1]);
    }
    hsum(_mm256_add_ps(totals[0], totals[1]))
}

/// Q4_1 row: blocks of (f16 d, f16 m, 16 bytes of nibbles); value = d·q + m.
/// `block_sums[b]` is Σ x over block `b`, so the min term costs one multiply per block.
///
/// # Safety
/// Needs AVX2 and FMA; `w.len() == x.len() / 32 * 20`, `block_sums.len() == x.len() / 32`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q4_1(w: &[u8], x: &[f32], block_sums: &[f32]) -> f32 {
    let zero = _mm_setzero_si128();
    let mut totals = [_mm256_setzero_ps(); 2];
    let mut mins = [0.0f32; 2];
    for ((b, block), sum) in w.chunks_exact(20).enumerate().zip(block_sums) {
        // SAFETY: bytes 4..20 are inside the block; b·32 + 32 <= x.len().
        let acc = unsafe {
            let qs = _mm_loadu_si128(block.as_ptr().add(4).cast());
            nibble_dot(qs, zero, x, b * 32)
        };
        totals[b & 1] = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(block, 0)), acc, totals[b & 1]);
        mins[b & 1] += f16_at(block, 2) * sum;
    }
    hsum(_mm256_add_ps(totals[0], totals[1])) + mins[0] + mins[1]
}
