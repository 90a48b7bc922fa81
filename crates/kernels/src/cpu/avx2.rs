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

mod float;
mod fp8;
pub(super) mod int8;
mod k_quants;
pub use float::{dot_bf16, dot_f16, dot_f32};
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

/// The two little-endian f16s at `bytes[at..at + 4]` (a block's `d` and `m`, or `d` and
/// `dmin`), converted together with F16C: lanes 0 and 1.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn f16_pair(bytes: &[u8], at: usize) -> __m128 {
    _mm_cvtph_ps(_mm_cvtsi32_si128(le_word(bytes, at) as i32))
}

/// The little-endian word at `bytes[at..at + 4]`.
#[inline]
fn le_word(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
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

/// The 32 values of the 16 bytes of nibbles at `block[at..at + 16]`, minus `offset`, as
/// 4 × 8 floats: low nibbles are values 0..16, high nibbles 16..32.
///
/// For one vector (`T = 1`), each half of the bytes is widened to 8 words as it is loaded
/// and the nibbles are taken from the words: two widenings instead of four, and no byte
/// shuffles. That made the Q4_1 matvec about a sixth faster at one thread. The kernels for
/// groups of vectors got slower with it (a 46-token Q4_1 prefill at one thread: 168 → 155
/// tok/s, medians of 5 alternating runs), so they split the nibbles in registers as
/// before. The values are the same either way.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn unpack_nibbles<const T: usize>(block: &[u8], at: usize, offset: i8) -> [__m256; 4] {
    if T > 1 {
        let (lo, hi) = split_nibbles(load16(block, at));
        let offset = _mm_set1_epi8(offset);
        return widen_32(_mm_sub_epi8(lo, offset), _mm_sub_epi8(hi, offset));
    }
    let offset = _mm256_set1_epi32(i32::from(offset));
    let [a, b, c, d] = nibble_words(block, at);
    [
        words_minus(a, offset),
        words_minus(b, offset),
        words_minus(c, offset),
        words_minus(d, offset),
    ]
}

/// The 32 nibbles of the 16 bytes at `block[at..]` as 4 × 8 words, values 0..32 in order
/// (low nibbles first): each half of the bytes widened to words as it is loaded.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn nibble_words(block: &[u8], at: usize) -> [__m256i; 4] {
    let first = _mm256_cvtepu8_epi32(load8_bytes(block, at));
    let second = _mm256_cvtepu8_epi32(load8_bytes(block, at + 8));
    let mask = _mm256_set1_epi32(0x0f);
    [
        _mm256_and_si256(first, mask),
        _mm256_and_si256(second, mask),
        _mm256_srli_epi32::<4>(first),
        _mm256_srli_epi32::<4>(second),
    ]
}

/// The 8 words of `v` minus `offset`, as floats.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn words_minus(v: __m256i, offset: __m256i) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_sub_epi32(v, offset))
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
/// kernels of the 32-value types, which differ only in `unpack` and in the min terms of
/// Q4_1 and Q5_1 ([`dot_min_blocks`]).
///
/// `mins = Some(sums)` (one vector only) also adds each block's min term in the loop:
/// `m · sums[b]`, with `m` the f16 at byte 2 and `sums[b]` Σ x over block `b`, into two
/// scalar chains by block parity, added to the total at the end.
///
/// # Safety
/// Needs AVX2, FMA and F16C; `w.len() == x.len() / 32 * BYTES` for every `x`, and
/// `sums.len() == x.len() / 32`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_scaled_blocks<const BYTES: usize, const T: usize>(
    w: &[u8],
    xs: [&[f32]; T],
    mins: Option<&[f32]>,
    unpack: impl Fn(&[u8; BYTES]) -> [__m256; 4],
) -> [f32; T] {
    debug_assert!(mins.is_none() || T == 1);
    let mut totals = [[_mm256_setzero_ps(); T]; 2];
    let mut min_chains = [0.0f32; 2];
    for_each_block_pair::<BYTES>(
        w,
        #[inline(always)]
        |block, b, parity| {
            let q = unpack(block);
            let Some(sums) = mins else {
                let d = _mm256_set1_ps(f16_at(block, 0));
                // SAFETY: b·32 + 32 <= x.len() by the row length.
                unsafe { accumulate_block(&mut totals[parity], &q, d, &xs, b) };
                return;
            };
            let dm = f16_pair(block, 0);
            let d = _mm256_broadcastss_ps(dm);
            // SAFETY: as above.
            unsafe { accumulate_block(&mut totals[parity], &q, d, &xs, b) };
            min_chains[parity] += _mm_cvtss_f32(_mm_movehdup_ps(dm)) * sums[b];
        },
    );
    let mut out = finish(totals);
    if mins.is_some() {
        out[0] = out[0] + min_chains[0] + min_chains[1];
    }
    out
}

/// Loads `bytes[at..at + 16]`.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn load16(bytes: &[u8], at: usize) -> __m128i {
    let part = &bytes[at..at + 16];
    // SAFETY: `part` is 16 bytes (the slice above is bounds-checked).
    unsafe { _mm_loadu_si128(part.as_ptr().cast()) }
}

/// Loads `bytes[at..at + 8]` into the low half.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn load8_bytes(bytes: &[u8], at: usize) -> __m128i {
    let part = &bytes[at..at + 8];
    // SAFETY: `part` is 8 bytes (the slice above is bounds-checked).
    unsafe { _mm_loadl_epi64(part.as_ptr().cast()) }
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
            None,
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
    // SAFETY: same features and row length (the caller's contract).
    unsafe {
        dot_scaled_blocks::<18, T>(
            w,
            xs,
            None,
            #[inline(always)]
            |block| unpack_nibbles::<T>(block, 2, 8),
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
    // SAFETY: same features, row length and sums (the caller's contract).
    unsafe {
        dot_min_blocks::<20, T>(
            w,
            xs,
            sums,
            #[inline(always)]
            |block| unpack_nibbles::<T>(block, 4, 0),
        )
    }
}

/// [`dot_scaled_blocks`] plus the min terms of a Q4_1 or Q5_1 row. For one vector they are
/// taken in the block loop, where they hide behind the vector work. For a group of vectors
/// they run in a pass after it ([`add_min_terms`]): in the loop they slowed the group's
/// kernel down. Both take the same operations in the same order, so a vector's bits are
/// the same either way.
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
        if T == 1 {
            return dot_scaled_blocks::<BYTES, T>(w, xs, Some(sums[0]), unpack);
        }
        let mut out = dot_scaled_blocks::<BYTES, T>(w, xs, None, unpack);
        add_min_terms::<BYTES, T>(&mut out, w, sums);
        out
    }
}

/// Adds `Σ_b m_b · sums[b]` to each vector's total, for the blocks of a Q4_1 or Q5_1 row
/// (f16 minimum `m` at byte 2 of each `BYTES`-byte block), in two chains by block parity as
/// the one-vector loop of [`dot_scaled_blocks`] does. Up to 4 vectors go in the lanes of
/// one register: each block's `m` is converted once, and each lane takes the same multiply
/// and add as a scalar chain would, so the bits are the same.
///
/// # Safety
/// Needs AVX2 and F16C; `sums[t].len() >= ` the row's blocks for every `t`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn add_min_terms<const BYTES: usize, const T: usize>(
    out: &mut [f32; T],
    w: &[u8],
    sums: [&[f32]; T],
) {
    const {
        assert!(
            T <= 4,
            "the min terms of at most 4 vectors fit one register"
        )
    };
    let mut chains = [_mm_setzero_ps(); 2];
    for_each_block_pair::<BYTES>(
        w,
        #[inline(always)]
        |block, b, parity| {
            let m = _mm_set1_ps(f16_at(block, 2));
            let sum = |t: usize| if t < T { sums[t][b] } else { 0.0 };
            let s = _mm_setr_ps(sum(0), sum(1), sum(2), sum(3));
            chains[parity] = _mm_add_ps(chains[parity], _mm_mul_ps(m, s));
        },
    );
    let [mut even, mut odd] = [[0.0f32; 4]; 2];
    // SAFETY: each array holds 4 values.
    unsafe {
        _mm_storeu_ps(even.as_mut_ptr(), chains[0]);
        _mm_storeu_ps(odd.as_mut_ptr(), chains[1]);
    }
    for (t, total) in out.iter_mut().enumerate() {
        *total = *total + even[t] + odd[t];
    }
}

/// Q5_0 row: blocks of (f16 d, u32 high bits, 16 bytes of nibbles); value = d·(q − 16).
///
/// # Safety
/// Needs AVX2, FMA and F16C; `w.len() == x.len() / 32 * 22` for every `x`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q5_0<const T: usize>(w: &[u8], xs: [&[f32]; T]) -> [f32; T] {
    // SAFETY: same features and row length (the caller's contract).
    unsafe {
        dot_scaled_blocks::<22, T>(
            w,
            xs,
            None,
            #[inline(always)]
            |block| {
                if T == 1 {
                    unpack_q5_words(block, 2, 16)
                } else {
                    unpack_q5(block, 2, 16)
                }
            },
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
    // SAFETY: same features, row length and sums (the caller's contract).
    unsafe {
        dot_min_blocks::<24, T>(
            w,
            xs,
            sums,
            #[inline(always)]
            |block| {
                if T == 1 {
                    unpack_q5_words(block, 4, 0)
                } else {
                    unpack_q5(block, 4, 0)
                }
            },
        )
    }
}

/// The 32 quants of a Q5_0 or Q5_1 block minus `offset`, whose high-bit word sits at
/// `block[qh_at..]` and 16 bytes of nibbles right after it.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn unpack_q5(block: &[u8], qh_at: usize, offset: i8) -> [__m256; 4] {
    let (lo, hi) = split_nibbles(load16(block, qh_at + 4));
    let (bit_lo, bit_hi) = high_bits_32(le_word(block, qh_at));
    let offset = _mm_set1_epi8(offset);
    widen_32(
        _mm_sub_epi8(_mm_or_si128(lo, bit_lo), offset),
        _mm_sub_epi8(_mm_or_si128(hi, bit_hi), offset),
    )
}

/// [`unpack_q5`] for the one-vector kernels, as [`unpack_nibbles`] does: the nibbles as
/// words, and each value's fifth bit shifted into its word from the broadcast high-bit
/// word, with no byte shuffles. The same values; the group kernels keep the byte form, as
/// they do for Q4_0 and Q4_1.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn unpack_q5_words(block: &[u8], qh_at: usize, offset: i8) -> [__m256; 4] {
    let [a, b, c, d] = nibble_words(block, qh_at + 4);
    // Value 8r + k's bit moved to bit 4 of lane k: values 0..8 from the word shifted up by
    // 4 (its top bits are not needed there), the others shifted down by 8r + k − 4.
    let word = _mm256_set1_epi32(le_word(block, qh_at) as i32);
    let bits = [
        bit_4(
            _mm256_slli_epi32::<4>(word),
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
        ),
        bit_4(word, _mm256_setr_epi32(4, 5, 6, 7, 8, 9, 10, 11)),
        bit_4(word, _mm256_setr_epi32(12, 13, 14, 15, 16, 17, 18, 19)),
        bit_4(word, _mm256_setr_epi32(20, 21, 22, 23, 24, 25, 26, 27)),
    ];
    let offset = _mm256_set1_epi32(i32::from(offset));
    [
        words_minus(_mm256_or_si256(a, bits[0]), offset),
        words_minus(_mm256_or_si256(b, bits[1]), offset),
        words_minus(_mm256_or_si256(c, bits[2]), offset),
        words_minus(_mm256_or_si256(d, bits[3]), offset),
    ]
}

/// Bit 4 (0x10) of each word of `v` shifted down by its lane's `shifts`.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn bit_4(v: __m256i, shifts: __m256i) -> __m256i {
    _mm256_and_si256(_mm256_srlv_epi32(v, shifts), _mm256_set1_epi32(16))
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
            None,
            #[inline(always)]
            |block| unpack_iq4(load16(block, 2), table),
        )
    }
}
