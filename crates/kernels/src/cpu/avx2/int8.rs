//! The `fast` precision's row dots with 8-bit activations ([`crate::cpu::int8`], whose
//! module documentation states the arithmetic every path shares): AVX2 `vpmaddubsw` +
//! `vpmaddwd`, or AVX-512 VNNI `vpdpbusd` on 256-bit registers where the CPU has it. Both
//! give each block's 8 exact `i32` lanes; everything after is the same float operations.
//!
//! Each kernel dots one weight row with `T` quantized vectors, unpacking each weight block
//! once for all of them.

use std::arch::x86_64::*;

use super::hsum;
use crate::cpu::int8::{BLOCK, Q8Row};

/// Loads 32 bytes from `p`.
///
/// # Safety
/// `p..p + 32` must be readable.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn load32(p: *const u8) -> __m256i {
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
unsafe fn nibbles(p: *const u8) -> __m256i {
    // SAFETY: the caller's range.
    let qs = unsafe { _mm_loadu_si128(p.cast()) };
    let mask = _mm_set1_epi8(0x0f);
    let lo = _mm_and_si128(qs, mask);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(qs), mask);
    _mm256_set_m128i(hi, lo)
}

/// The little-endian f16 at `p`, converted with F16C.
///
/// # Safety
/// `p..p + 2` must be readable.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn f16_at(p: *const u8) -> f32 {
    // SAFETY: the caller's range.
    let bits = unsafe { p.cast::<u16>().read_unaligned() };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(u16::from_le(
        bits,
    )))))
}

/// The 8 lanes of `Σ w·x` (lane k: values 4k..4k + 4) for unsigned `w`, signed `x`: AVX2.
#[inline]
#[target_feature(enable = "avx2")]
fn lanes_avx2(w: __m256i, x: __m256i) -> __m256i {
    // |w| ≤ 128 and |x| ≤ 127: a pair's sum stays within i16.
    _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1))
}

/// [`lanes_avx2`] with AVX-512 VNNI: the same exact sums in one instruction.
#[inline]
#[target_feature(enable = "avx2,avx512vnni,avx512vl")]
fn lanes_vnni(w: __m256i, x: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x)
}

/// How a weight block reads: its 32 values in one register, signed or not.
#[derive(Clone, Copy)]
struct Block {
    values: __m256i,
    signed: bool,
}

/// The loop every kernel shares: blocks in pairs (even blocks into one set of
/// accumulators, odd ones into the other, in registers); for each block, `unpack` its
/// values, then each vector's 8 lanes (through `lanes`) scaled by `d_w·d_x`; with
/// `min_at` (Q4_1: byte 2, its f16 min), the min terms `m·(d_x·Σq_x)` in two scalar
/// chains by the same parity, added after the lanes' sum.
///
/// # Safety
/// Needs AVX2, FMA, F16C and whatever `lanes` needs.
#[inline(always)]
unsafe fn dot_blocks<const BYTES: usize, const T: usize>(
    w: &[u8],
    xs: [Q8Row<'_>; T],
    min_at: Option<usize>,
    unpack: impl Fn(*const u8) -> Block,
    lanes: impl Fn(__m256i, __m256i) -> __m256i,
) -> [f32; T] {
    let blocks = w.len() / BYTES;
    // The one check the raw reads below rely on.
    assert!(
        xs.iter()
            .all(|x| x.d.len() >= blocks && x.dsum.len() >= blocks && x.qs.len() >= blocks * BLOCK),
        "quantized activations shorter than the weight row"
    );
    // SAFETY: every intrinsic and read below has the caller's features; block
    // `b < blocks` lies in `w`, and every vector holds `blocks` scales and `32 · blocks`
    // values (asserted above).
    unsafe {
        // A macro, not a closure: a closure would not inherit the caller's target
        // features, and its intrinsics would become calls.
        macro_rules! step {
            ($b:expr, $acc:ident, $mins:ident) => {{
                let b = $b;
                let block = w.as_ptr().add(b * BYTES);
                let Block { values, signed } = unpack(block);
                let dw = f16_at(block);
                let unsigned = if signed {
                    _mm256_sign_epi8(values, values)
                } else {
                    values
                };
                let m = min_at.map(|at| f16_at(block.add(at)));
                for t in 0..T {
                    let x = &xs[t];
                    let mut xq = load32(x.qs.as_ptr().add(b * BLOCK).cast());
                    if signed {
                        xq = _mm256_sign_epi8(xq, values);
                    }
                    let sums = _mm256_cvtepi32_ps(lanes(unsigned, xq));
                    let dx = *x.d.get_unchecked(b);
                    $acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * dx), sums, $acc[t]);
                    if let Some(m) = m {
                        $mins[t] = m.mul_add(*x.dsum.get_unchecked(b), $mins[t]);
                    }
                }
            }};
        }
        let (mut acc0, mut acc1) = ([_mm256_setzero_ps(); T], [_mm256_setzero_ps(); T]);
        let (mut mins0, mut mins1) = ([0.0f32; T], [0.0f32; T]);
        let mut b = 0;
        while b + 2 <= blocks {
            step!(b, acc0, mins0);
            step!(b + 1, acc1, mins1);
            b += 2;
        }
        if b < blocks {
            step!(b, acc0, mins0);
        }
        std::array::from_fn(|t| {
            let total = hsum(_mm256_add_ps(acc0[t], acc1[t]));
            if min_at.is_some() {
                total + (mins0[t] + mins1[t])
            } else {
                total
            }
        })
    }
}

/// One kernel: `$name`, compiled for `$features`, its lanes through `$lanes`.
macro_rules! int8_kernel {
    ($(#[$doc:meta])* $name:ident, $features:literal, $lanes:ident, $bytes:literal,
     $min_at:expr, |$block:ident| $unpack:expr) => {
        $(#[$doc])*
        #[target_feature(enable = $features)]
        pub unsafe fn $name<const T: usize>(w: &[u8], xs: [Q8Row<'_>; T]) -> [f32; T] {
            // SAFETY: the caller's features and lengths.
            unsafe {
                dot_blocks::<$bytes, T>(
                    w,
                    xs,
                    $min_at,
                    #[inline(always)]
                    |$block| $unpack,
                    #[inline(always)]
                    |w, x| $lanes(w, x),
                )
            }
        }
    };
}

/// A kernel and its VNNI twin from one block loop: `$avx2` through [`lanes_avx2`],
/// `$vnni` through [`lanes_vnni`] (the same bits).
macro_rules! int8_kernels {
    ($(#[$doc:meta])* $avx2:ident, $vnni:ident, $bytes:literal, $min_at:expr,
     |$block:ident| $unpack:expr) => {
        int8_kernel!(
            $(#[$doc])*
            ///
            /// # Safety
            /// Needs AVX2, FMA and F16C; `w` holds whole blocks, one per 32 values of
            /// every vector.
            $avx2, "avx2,fma,f16c", lanes_avx2, $bytes, $min_at, |$block| $unpack
        );
        int8_kernel!(
            $(#[$doc])*
            ///
            /// # Safety
            /// Needs AVX2, FMA, F16C, AVX-512 VNNI and VL; lengths as the AVX2 kernel.
            $vnni, "avx2,fma,f16c,avx512vnni,avx512vl", lanes_vnni, $bytes, $min_at,
            |$block| $unpack
        );
    };
}

int8_kernels!(
    /// Q8_0 row (f16 d, 32 × i8 per block) with 8-bit activations.
    dot_q8_0, dot_q8_0_vnni, 34, None, |block| Block {
        values: load32(block.add(2)),
        signed: true,
    }
);

int8_kernels!(
    /// Q4_0 row (f16 d, 16 bytes of nibbles; value q − 8) with 8-bit activations.
    dot_q4_0, dot_q4_0_vnni, 18, None, |block| Block {
        values: _mm256_sub_epi8(nibbles(block.add(2)), _mm256_set1_epi8(8)),
        signed: true,
    }
);

int8_kernels!(
    /// Q4_1 row (f16 d, f16 m, 16 bytes of nibbles; value d·q + m) with 8-bit activations.
    dot_q4_1, dot_q4_1_vnni, 20, Some(2), |block| Block {
        values: nibbles(block.add(4)),
        signed: false,
    }
);
