//! AVX2 + FMA + F16C row-dot products (x86-64-v3), each for `T` activation vectors at once.
//!
//! Every kernel dots one weight row with `T` vectors: a weight block is loaded and unpacked
//! into registers once and multiplied into the accumulators of all `T` vectors. Each vector's
//! accumulation — lanes, accumulator of each block, block order, horizontal sum — is the same
//! sequence of operations for every `T`, so a vector's result does not depend on `T` or on the
//! other vectors: `T = 1` is the single-vector kernel, and a batched matmul gives the bits of
//! the n = 1 one. (Rust never contracts or reassociates float operations on its own, so the
//! same sequence of intrinsics and scalar operations rounds the same way.)
//!
//! Every function here is `unsafe` only because it needs those CPU features; callers in
//! `dot.rs` check [`super::Features`] first and have already checked the slice lengths
//! (`w.len() == dtype.row_bytes(x.len())` and every `x` of one length). Loads are unaligned
//! and stay inside the slices.

use std::arch::x86_64::*;

use crate::quant::iq4::IQ4_LEVELS;

mod fp8;
pub(super) mod int8;
mod k_quants;
pub use fp8::dot_f8_e4m3;
pub use k_quants::{dot_iq4_xs, dot_q2_k, dot_q3_k, dot_q4_k, dot_q5_k, dot_q6_k};

/// Sums the 8 lanes of `v`.
#[inline]
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

/// Σ q·x over one 32-value block: `q` the block's 32 integer values as 4 × 8 floats,
/// `x[xb..xb + 32]` the activations. Two short chains instead of one of four FMAs: the
/// block's latency halves.
///
/// # Safety
/// Needs AVX2 and FMA; `xb + 32 <= x.len()`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn block_dot(q: &[__m256; 4], x: &[f32], xb: usize) -> __m256 {
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

/// Unpacks 16 bytes of nibbles minus `offset`: low nibbles are values 0..16, high nibbles
/// 16..32.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn unpack_nibbles(qs: __m128i, offset: __m128i) -> [__m256; 4] {
    let (lo, hi) = split_nibbles(qs);
    widen_32(_mm_sub_epi8(lo, offset), _mm_sub_epi8(hi, offset))
}

/// The low nibbles (values 0..16) and the high nibbles (values 16..32) of 16 bytes, one per
/// byte.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn split_nibbles(qs: __m128i) -> (__m128i, __m128i) {
    let mask = _mm_set1_epi8(0x0f);
    let lo = _mm_and_si128(qs, mask);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(qs), mask);
    (lo, hi)
}

/// 32 signed bytes, values 0..16 in `lo` and 16..32 in `hi`, as 4 × 8 floats.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn widen_32(lo: __m128i, hi: __m128i) -> [__m256; 4] {
    [
        widen_i8(lo),
        widen_i8(_mm_srli_si128::<8>(lo)),
        widen_i8(hi),
        widen_i8(_mm_srli_si128::<8>(hi)),
    ]
}

/// Bit 4 (0x10) of values 0..16 and 16..32 from the little-endian word `qh`, whose bit `i`
/// is value `i`'s: byte `i` of the result is 0x10 when the bit is set, else 0.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn high_bits_32(qh: u32) -> (__m128i, __m128i) {
    let word = _mm_cvtsi32_si128(qh as i32);
    let bits = _mm_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let four = _mm_set1_epi8(0x10); // bit 4
    // Byte i of `lo` / `hi` is the byte of `qh` that holds value i's bit (i / 8 and
    // 2 + i / 8), and `bits` picks bit i mod 8 of it.
    let lo = _mm_shuffle_epi8(word, _mm_set_epi64x(0x0101_0101_0101_0101, 0));
    let hi = _mm_shuffle_epi8(
        word,
        _mm_set_epi64x(0x0303_0303_0303_0303, 0x0202_0202_0202_0202),
    );
    (select_bytes(lo, bits, four), select_bytes(hi, bits, four))
}

/// `value` in each byte of `v` that has all the bits of `bits`' byte set, else 0.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn select_bytes(v: __m128i, bits: __m128i, value: __m128i) -> __m128i {
    _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(v, bits), bits), value)
}

/// The 16 IQ4 levels as a byte-shuffle table.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn iq4_table() -> __m128i {
    // SAFETY: IQ4_LEVELS is 16 bytes.
    unsafe { _mm_loadu_si128(IQ4_LEVELS.as_ptr().cast()) }
}

/// The 32 values whose IQ4 level indices are the nibbles of `qs`, as 4 × 8 floats.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn unpack_iq4(qs: __m128i, table: __m128i) -> [__m256; 4] {
    let (lo, hi) = split_nibbles(qs);
    widen_32(_mm_shuffle_epi8(table, lo), _mm_shuffle_epi8(table, hi))
}

/// The low 8 bytes of `part` as signed integers, converted to 8 floats.
///
/// Kernels call small `#[target_feature]` functions like this one rather than closures
/// through `array::map` or `array::from_fn`: those have no target features, so such a
/// closure is never inlined and every block would cost a call.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn widen_i8(part: __m128i) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part))
}

/// Adds `d · Σ q·x` of block `b` into each vector's total in `totals`.
///
/// # Safety
/// Needs AVX2 and FMA; `b·32 + 32 <= x.len()` for every `x`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn accumulate_block<const T: usize>(
    totals: &mut [__m256; T],
    q: &[__m256; 4],
    d: __m256,
    xs: &[&[f32]; T],
    b: usize,
) {
    for (total, x) in totals.iter_mut().zip(xs) {
        // SAFETY: the caller guarantees b·32 + 32 <= x.len().
        let acc = unsafe { block_dot(q, x, b * 32) };
        *total = _mm256_fmadd_ps(d, acc, *total);
    }
}

/// Each vector's `hsum(even + odd)` of its two block accumulators.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn finish<const T: usize>(totals: [[__m256; T]; 2]) -> [f32; T] {
    let mut out = [0.0; T];
    for (t, total) in out.iter_mut().enumerate() {
        *total = hsum(_mm256_add_ps(totals[0][t], totals[1][t]));
    }
    out
}

/// Runs `block(bytes, b, parity)` over the `BYTES`-byte blocks of `w` in order, where
/// `parity` is `b & 1`. Blocks alternate between two sets of accumulators so that
/// consecutive blocks do not wait on each other; taking the blocks two at a time makes the
/// choice static, so the accumulators stay in registers.
#[inline(always)]
fn for_each_block_pair<const BYTES: usize>(
    w: &[u8],
    mut block: impl FnMut(&[u8; BYTES], usize, usize),
) {
    let (blocks, _) = w.as_chunks::<BYTES>();
    let mut pairs = blocks.chunks_exact(2);
    let mut b = 0;
    for pair in &mut pairs {
        block(&pair[0], b, 0);
        block(&pair[1], b + 1, 1);
        b += 2;
    }
    if let [last] = pairs.remainder() {
        block(last, b, 0);
    }
}

/// Σ over the 32-value blocks of a row of `d · Σ q·x`, with `d` the f16 at byte 0 of each
/// `BYTES`-byte block and `q` its 32 values as `unpack` gives them: the body of the
/// kernels of the 32-value types, which differ only in `unpack` (and a min term after).
///
/// # Safety
/// Needs AVX2, FMA and F16C; `w.len() == x.len() / 32 * BYTES` for every `x`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_scaled_blocks<const BYTES: usize, const T: usize>(
    w: &[u8],
    xs: [&[f32]; T],
    unpack: impl Fn(&[u8; BYTES]) -> [__m256; 4],
) -> [f32; T] {
    let mut totals = [[_mm256_setzero_ps(); T]; 2];
    for_each_block_pair::<BYTES>(
        w,
        #[inline(always)]
        |block, b, parity| {
            let q = unpack(block);
            let d = _mm256_set1_ps(f16_at(block, 0));
            // SAFETY: b·32 + 32 <= x.len() by the row length.
            unsafe { accumulate_block(&mut totals[parity], &q, d, &xs, b) };
        },
    );
    finish(totals)
}

/// Loads `bytes[at..at + 16]`.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn load16(bytes: &[u8], at: usize) -> __m128i {
    let part = &bytes[at..at + 16];
    // SAFETY: `part` is 16 bytes (the slice above is bounds-checked).
    unsafe { _mm_loadu_si128(part.as_ptr().cast()) }
}

/// Q8_0 row: blocks of (f16 d, 32 × i8).
///
/// # Safety
/// Needs AVX2, FMA and F16C; `w.len() == x.len() / 32 * 34` for every `x`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q8_0<const T: usize>(w: &[u8], xs: [&[f32]; T]) -> [f32; T] {
    // SAFETY: same features and row length (the caller's contract).
    unsafe {
        dot_scaled_blocks::<34, T>(
            w,
            xs,
            #[inline(always)]
            |block| widen_32(load16(block, 2), load16(block, 18)),
        )
    }
}

/// Q4_0 row: blocks of (f16 d, 16 bytes of nibbles); value = d·(q − 8).
///
/// # Safety
/// Needs AVX2, FMA and F16C; `w.len() == x.len() / 32 * 18` for every `x`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q4_0<const T: usize>(w: &[u8], xs: [&[f32]; T]) -> [f32; T] {
    let eight = _mm_set1_epi8(8);
    // SAFETY: same features and row length (the caller's contract).
    unsafe {
        dot_scaled_blocks::<18, T>(
            w,
            xs,
            #[inline(always)]
            |block| unpack_nibbles(load16(block, 2), eight),
        )
    }
}

/// Q4_1 row: blocks of (f16 d, f16 m, 16 bytes of nibbles); value = d·q + m.
/// `sums[t][b]` is Σ x over block `b` of vector `t`, so the min term costs one multiply per
/// block.
///
/// # Safety
/// Needs AVX2, FMA and F16C; `w.len() == x.len() / 32 * 20` and `sums[t].len() == x.len() / 32`
/// for every `x`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q4_1<const T: usize>(w: &[u8], xs: [&[f32]; T], sums: [&[f32]; T]) -> [f32; T] {
    let zero = _mm_setzero_si128();
    // SAFETY: same features, row length and sums (the caller's contract).
    unsafe {
        dot_min_blocks::<20, T>(
            w,
            xs,
            sums,
            #[inline(always)]
            |block| unpack_nibbles(load16(block, 4), zero),
        )
    }
}

/// [`dot_scaled_blocks`] plus the min terms of a Q4_1 or Q5_1 row ([`add_min_terms`]).
///
/// # Safety
/// Needs AVX2, FMA and F16C; `w.len() == x.len() / 32 * BYTES` and
/// `sums[t].len() == x.len() / 32` for every `x`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_min_blocks<const BYTES: usize, const T: usize>(
    w: &[u8],
    xs: [&[f32]; T],
    sums: [&[f32]; T],
    unpack: impl Fn(&[u8; BYTES]) -> [__m256; 4],
) -> [f32; T] {
    // SAFETY: same features, row length and sums (the caller's contract).
    unsafe {
        let mut out = dot_scaled_blocks::<BYTES, T>(w, xs, unpack);
        add_min_terms::<BYTES, T>(&mut out, w, sums);
        out
    }
}

/// Adds `Σ_b m_b · sums[b]` to each vector's total, for the blocks of a Q4_1 or Q5_1 row
/// (f16 minimum `m` at byte 2 of each `BYTES`-byte block): the min terms, in a pass of their
/// own, with the same operations in the same order for every vector, without holding on to
/// registers and bounds checks in the block loop.
///
/// # Safety
/// Needs AVX2 and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn add_min_terms<const BYTES: usize, const T: usize>(
    out: &mut [f32; T],
    w: &[u8],
    sums: [&[f32]; T],
) {
    for (total, sums) in out.iter_mut().zip(sums) {
        let mut mins = [0.0f32; 2];
        for (b, (block, sum)) in w.chunks_exact(BYTES).zip(sums).enumerate() {
            mins[b & 1] += f16_at(block, 2) * sum;
        }
        *total = *total + mins[0] + mins[1];
    }
}

/// Q5_0 row: blocks of (f16 d, u32 high bits, 16 bytes of nibbles); value = d·(q − 16).
///
/// # Safety
/// Needs AVX2, FMA and F16C; `w.len() == x.len() / 32 * 22` for every `x`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q5_0<const T: usize>(w: &[u8], xs: [&[f32]; T]) -> [f32; T] {
    let sixteen = _mm_set1_epi8(16);
    // SAFETY: same features and row length (the caller's contract).
    unsafe {
        dot_scaled_blocks::<22, T>(
            w,
            xs,
            #[inline(always)]
            |block| unpack_q5(block, 2, sixteen),
        )
    }
}

/// Q5_1 row: blocks of (f16 d, f16 m, u32 high bits, 16 bytes of nibbles); value = d·q + m,
/// the min terms as in [`dot_q4_1`].
///
/// # Safety
/// Needs AVX2, FMA and F16C; `w.len() == x.len() / 32 * 24` and `sums[t].len() == x.len() / 32`
/// for every `x`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q5_1<const T: usize>(w: &[u8], xs: [&[f32]; T], sums: [&[f32]; T]) -> [f32; T] {
    let zero = _mm_setzero_si128();
    // SAFETY: same features, row length and sums (the caller's contract).
    unsafe {
        dot_min_blocks::<24, T>(
            w,
            xs,
            sums,
            #[inline(always)]
            |block| unpack_q5(block, 4, zero),
        )
    }
}

/// The 32 quants of a Q5_0 or Q5_1 block minus `offset`, whose high-bit word sits at
/// `block[qh_at..]` and 16 bytes of nibbles right after it.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn unpack_q5(block: &[u8], qh_at: usize, offset: __m128i) -> [__m256; 4] {
    let qh = u32::from_le_bytes([
        block[qh_at],
        block[qh_at + 1],
        block[qh_at + 2],
        block[qh_at + 3],
    ]);
    let (lo, hi) = split_nibbles(load16(block, qh_at + 4));
    let (bit_lo, bit_hi) = high_bits_32(qh);
    widen_32(
        _mm_sub_epi8(_mm_or_si128(lo, bit_lo), offset),
        _mm_sub_epi8(_mm_or_si128(hi, bit_hi), offset),
    )
}

/// IQ4_NL row: blocks of (f16 d, 16 bytes of level indices); value = d·LEVELS[q].
///
/// # Safety
/// Needs AVX2, FMA and F16C; `w.len() == x.len() / 32 * 18` for every `x`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_iq4_nl<const T: usize>(w: &[u8], xs: [&[f32]; T]) -> [f32; T] {
    let table = iq4_table();
    // SAFETY: same features and row length (the caller's contract).
    unsafe {
        dot_scaled_blocks::<18, T>(
            w,
            xs,
            #[inline(always)]
            |block| unpack_iq4(load16(block, 2), table),
        )
    }
}
