//! The reads the 8-bit kernels share: weight blocks, f16 scales and octets into registers,
//! and the integer lanes of a block's products.

use std::arch::x86_64::*;

/// Loads 32 bytes from `p`.
///
/// # Safety
/// `p..p + 32` must be readable.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn load32(p: *const u8) -> __m256i {
    // SAFETY: the caller's range.
    unsafe { _mm256_loadu_si256(p.cast()) }
}

/// 16 bytes of nibbles at `p` as 32 bytes: values 0..16 from the low nibbles, 16..32
/// from the high.
///
/// # Safety
/// `p..p + 16` must be readable.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn nibbles(p: *const u8) -> __m256i {
    // SAFETY: the caller's range.
    let qs = unsafe { _mm_loadu_si128(p.cast()) };
    let mask = _mm_set1_epi8(0x0f);
    let lo = _mm_and_si128(qs, mask);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(qs), mask);
    _mm256_set_m128i(hi, lo)
}

/// The 16 IQ4 levels ([`crate::quant::iq4::IQ4_LEVELS`]) in each 128-bit half: the table of
/// a `vpshufb` that turns indices 0..16 into their levels.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn iq4_levels() -> __m256i {
    let table = crate::quant::iq4::IQ4_LEVELS;
    // SAFETY: 16 bytes from a 16-byte array.
    let half = unsafe { _mm_loadu_si128(table.as_ptr().cast()) };
    _mm256_set_m128i(half, half)
}

/// The fifth bits of a Q5_0 or Q5_1 block as 32 bytes: byte `i` is 0x10 where bit `i` of
/// the little-endian word at `p` is set, else 0 (to be or'ed into [`nibbles`]).
///
/// # Safety
/// `p..p + 4` must be readable.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn fifth_bits(p: *const u8) -> __m256i {
    // SAFETY: the caller's range.
    let word = unsafe { p.cast::<i32>().read_unaligned() };
    // Byte i takes byte i / 8 of the word (each 128-bit half shuffles on its own), and
    // `bits` picks bit i mod 8 of it.
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(word),
        _mm256_setr_epi64x(
            0,
            0x0101_0101_0101_0101,
            0x0202_0202_0202_0202,
            0x0303_0303_0303_0303,
        ),
    );
    let bits = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bits), bits);
    _mm256_and_si256(set, _mm256_set1_epi8(0x10))
}

/// The little-endian f16 at `p`, converted with F16C.
///
/// # Safety
/// `p..p + 2` must be readable.
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn f16_at(p: *const u8) -> f32 {
    // SAFETY: the caller's range.
    let bits = unsafe { p.cast::<u16>().read_unaligned() };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(u16::from_le(
        bits,
    )))))
}

/// The little-endian f16s at `p`, `p + stride`, `p + 2·stride` and `p + 3·stride`.
///
/// # Safety
/// The four 2-byte ranges must be readable.
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn f16x4(p: *const u8, stride: usize) -> __m128 {
    // SAFETY: the caller's ranges.
    let half = |k: usize| unsafe { p.add(k * stride).cast::<i16>().read_unaligned() };
    _mm_cvtph_ps(_mm_setr_epi16(
        half(0),
        half(1),
        half(2),
        half(3),
        0,
        0,
        0,
        0,
    ))
}

/// The pairs of little-endian f16s at `p + k·stride` (k in 0..4), as two vectors: the
/// pairs' first values and their second ones.
///
/// # Safety
/// The four 4-byte ranges must be readable.
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn f16_pairs_x4(p: *const u8, stride: usize) -> (__m128, __m128) {
    // SAFETY: the caller's ranges.
    let pair = |k: usize| unsafe { p.add(k * stride).cast::<i32>().read_unaligned() };
    let halves = _mm256_cvtph_ps(_mm_setr_epi32(pair(0), pair(1), pair(2), pair(3)));
    // [a0 b0 a1 b1 a2 b2 a3 b3] → [a0 a1 a2 a3 | b0 b1 b2 b3].
    let split = _mm256_permutevar8x32_ps(halves, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
    (
        _mm256_castps256_ps128(split),
        _mm256_extractf128_ps::<1>(split),
    )
}

/// The 8 lanes of `Σ w·x` (lane k: values 4k..4k + 4) for unsigned `w`, signed `x`: AVX2.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn lanes_avx2(w: __m256i, x: __m256i) -> __m256i {
    // |w| ≤ 128 and |x| ≤ 127: a pair's sum stays within i16.
    _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1))
}

/// `acc` plus [`lanes_avx2`]`(w, x)`.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn add_lanes_avx2(acc: __m256i, w: __m256i, x: __m256i) -> __m256i {
    _mm256_add_epi32(acc, lanes_avx2(w, x))
}

/// `acc` plus [`lanes_avx2`]`(w, x)` with AVX-512 VNNI: the same exact sums, in one
/// instruction.
#[inline]
#[target_feature(enable = "avx2,avx512vnni,avx512vl")]
pub(super) fn add_lanes_vnni(acc: __m256i, w: __m256i, x: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(acc, w, x)
}

/// The 32-bit words `4s..4s + 4` of 16-byte runs `p + k·stride` (k in 0..8) as 4
/// registers: register `s` holds word `s` of each run in turn. Runs k and k + 4 are loaded
/// into the two halves of one register, then each half is a 4 × 4 transpose.
///
/// # Safety
/// The eight 16-byte ranges must be readable.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn words_x8(p: *const u8, stride: usize) -> [__m256i; 4] {
    // A macro, not a closure, keeps the intrinsics inline.
    macro_rules! runs {
        ($k:expr) => {
            // SAFETY: the caller's ranges.
            unsafe {
                _mm256_loadu2_m128i(p.add(($k + 4) * stride).cast(), p.add($k * stride).cast())
            }
        };
    }
    let (a, b, c, d) = (runs!(0), runs!(1), runs!(2), runs!(3));
    let (ab_lo, ab_hi) = (_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
    let (cd_lo, cd_hi) = (_mm256_unpacklo_epi32(c, d), _mm256_unpackhi_epi32(c, d));
    [
        _mm256_unpacklo_epi64(ab_lo, cd_lo),
        _mm256_unpackhi_epi64(ab_lo, cd_lo),
        _mm256_unpacklo_epi64(ab_hi, cd_hi),
        _mm256_unpackhi_epi64(ab_hi, cd_hi),
    ]
}

/// Eight blocks of nibbles (16 bytes each, at `p + k·stride`) as an octet's 8 registers
/// ([`crate::cpu::int8::OCTET`]): register `s` holds values `4s..4s + 4` of each block in
/// turn (values 0..16 from the low nibbles, 16..32 from the high).
///
/// # Safety
/// The eight 16-byte ranges must be readable.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn nibble_octet(p: *const u8, stride: usize) -> [__m256i; 8] {
    // SAFETY: the caller's ranges.
    let words = unsafe { words_x8(p, stride) };
    let mask = _mm256_set1_epi8(0x0f);
    // Macros, not closures, keep the intrinsics inline.
    macro_rules! low {
        ($v:expr) => {
            _mm256_and_si256($v, mask)
        };
    }
    macro_rules! high {
        ($v:expr) => {
            _mm256_and_si256(_mm256_srli_epi16::<4>($v), mask)
        };
    }
    [
        low!(words[0]),
        low!(words[1]),
        low!(words[2]),
        low!(words[3]),
        high!(words[0]),
        high!(words[1]),
        high!(words[2]),
        high!(words[3]),
    ]
}

/// Eight blocks of 32 bytes (at `p + k·stride`) as an octet's 8 registers, as
/// [`nibble_octet`] lays them out.
///
/// # Safety
/// The eight 32-byte ranges must be readable.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn byte_octet(p: *const u8, stride: usize) -> [__m256i; 8] {
    // SAFETY: the caller's ranges.
    let (low, high) = unsafe { (words_x8(p, stride), words_x8(p.add(16), stride)) };
    [
        low[0], low[1], low[2], low[3], high[0], high[1], high[2], high[3],
    ]
}
