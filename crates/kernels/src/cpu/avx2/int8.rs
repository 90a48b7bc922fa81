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
use crate::quant::k_quants::q4_k_scale_min;

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

/// One 32-value sub-block of a weight row, as the loop reads it: its values in one
/// register (signed or not), its scale, and the factor of its min term (Q4_1's `m`, Q4_K's
/// `dmin·m`; 0 for the types without one).
#[derive(Clone, Copy)]
struct Sub {
    values: __m256i,
    signed: bool,
    scale: f32,
    min: f32,
}

/// What a row's min terms do to its total.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mins {
    None,
    /// Q4_1: value `d·q + m`.
    Add,
    /// Q4_K: value `(d·sc)·q − dmin·m`.
    Subtract,
}

/// Panics unless every vector holds `blocks` scales and `32 · blocks` values: the one
/// check the block loops' raw reads rely on.
fn assert_covers(xs: &[Q8Row<'_>], blocks: usize) {
    assert!(
        (xs.iter()).all(|x| {
            x.d.len() >= blocks && x.dsum.len() >= blocks && x.qs.len() >= blocks * BLOCK
        }),
        "quantized activations shorter than the weight row"
    );
}

/// The loop every kernel shares, over the row's `blocks` 32-value sub-blocks in pairs
/// (even ones into one set of accumulators, odd ones into the other, in registers): for
/// each, `sub(b)` reads it, then each vector's 8 lanes (through `lanes`) are scaled by
/// `scale·d_x`; the min terms `min·(d_x·Σq_x)` go into two scalar chains by the same
/// parity, added to or taken from the lanes' sum at the end. `WIDE` sums in f64 instead,
/// in [`dot_blocks_wide`]. The result comes as f64 either way.
///
/// # Safety
/// Needs AVX2, FMA, F16C and whatever `lanes` and `sub` need; `sub(b)` reads inside the
/// row for every `b < blocks`.
#[inline(always)]
unsafe fn dot_blocks<const T: usize, const WIDE: bool>(
    blocks: usize,
    xs: [Q8Row<'_>; T],
    mins: Mins,
    sub: impl Fn(usize) -> Sub,
    lanes: impl Fn(__m256i, __m256i) -> __m256i,
) -> [f64; T] {
    if WIDE {
        // SAFETY: the caller's contract, passed on.
        return unsafe { dot_blocks_wide::<T>(blocks, xs, mins, sub, lanes) };
    }
    // The one check the raw reads below rely on.
    assert_covers(&xs, blocks);
    // SAFETY: every intrinsic and read below has the caller's features; every vector
    // holds `blocks` scales and `32 · blocks` values (asserted above).
    unsafe {
        // A macro, not a closure: a closure would not inherit the caller's target
        // features, and its intrinsics would become calls.
        macro_rules! step {
            ($b:expr, $acc:ident, $mins:ident) => {{
                let b = $b;
                let Sub {
                    values,
                    signed,
                    scale,
                    min,
                } = sub(b);
                let unsigned = if signed {
                    _mm256_sign_epi8(values, values)
                } else {
                    values
                };
                for t in 0..T {
                    let x = &xs[t];
                    let mut xq = load32(x.qs.as_ptr().add(b * BLOCK).cast());
                    if signed {
                        xq = _mm256_sign_epi8(xq, values);
                    }
                    let sums = _mm256_cvtepi32_ps(lanes(unsigned, xq));
                    let dx = *x.d.get_unchecked(b);
                    $acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(scale * dx), sums, $acc[t]);
                    if mins != Mins::None {
                        $mins[t] = min.mul_add(*x.dsum.get_unchecked(b), $mins[t]);
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
            f64::from(match mins {
                Mins::None => total,
                Mins::Add => total + (mins0[t] + mins1[t]),
                Mins::Subtract => total - (mins0[t] + mins1[t]),
            })
        })
    }
}

/// [`dot_blocks`] summed in f64 (see [`crate::cpu::int8::Sum`]): blocks four at a time, each
/// block's 8 lanes reduced to its whole integer sum (the four sums in one register), scaled
/// by `scale·d_x` in f64 and added into chain `b mod 4`; a last partial quad goes block by
/// block into the same chains. The min terms as in [`dot_blocks`], in f64.
///
/// # Safety
/// As [`dot_blocks`].
#[inline(always)]
unsafe fn dot_blocks_wide<const T: usize>(
    blocks: usize,
    xs: [Q8Row<'_>; T],
    mins: Mins,
    sub: impl Fn(usize) -> Sub,
    lanes: impl Fn(__m256i, __m256i) -> __m256i,
) -> [f64; T] {
    assert_covers(&xs, blocks);
    // SAFETY: as in `dot_blocks`.
    unsafe {
        // Block `$b`'s 8 lanes with vector `$x` (a macro: see `dot_blocks`).
        macro_rules! block_lanes {
            ($sub:expr, $unsigned:expr, $x:expr, $b:expr) => {{
                let mut xq = load32($x.qs.as_ptr().add($b * BLOCK).cast());
                if $sub.signed {
                    xq = _mm256_sign_epi8(xq, $sub.values);
                }
                lanes($unsigned, xq)
            }};
        }
        macro_rules! unsigned {
            ($sub:expr) => {
                if $sub.signed {
                    _mm256_sign_epi8($sub.values, $sub.values)
                } else {
                    $sub.values
                }
            };
        }
        macro_rules! add_min {
            ($sub:expr, $x:expr, $b:expr, $chains:ident, $t:expr) => {
                if mins != Mins::None {
                    let dsum = f64::from(*$x.dsum.get_unchecked($b));
                    $chains[$b & 1][$t] = f64::from($sub.min).mul_add(dsum, $chains[$b & 1][$t]);
                }
            };
        }
        let mut acc = [_mm256_setzero_pd(); T];
        let mut min_chains = [[0.0f64; T]; 2];
        let mut b = 0;
        while b + 4 <= blocks {
            let (s0, s1, s2, s3) = (sub(b), sub(b + 1), sub(b + 2), sub(b + 3));
            let (u0, u1, u2, u3) = (unsigned!(s0), unsigned!(s1), unsigned!(s2), unsigned!(s3));
            let scales = _mm256_cvtps_pd(_mm_setr_ps(s0.scale, s1.scale, s2.scale, s3.scale));
            for t in 0..T {
                let x = &xs[t];
                let r0 = block_lanes!(s0, u0, x, b);
                let r1 = block_lanes!(s1, u1, x, b + 1);
                let r2 = block_lanes!(s2, u2, x, b + 2);
                let r3 = block_lanes!(s3, u3, x, b + 3);
                // Per 128-bit half: [Σ r0, Σ r1, Σ r2, Σ r3] of its lanes; then the halves.
                let q = _mm256_hadd_epi32(_mm256_hadd_epi32(r0, r1), _mm256_hadd_epi32(r2, r3));
                let sums =
                    _mm_add_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256::<1>(q));
                let dx = _mm256_cvtps_pd(_mm_loadu_ps(x.d.as_ptr().add(b)));
                let factors = _mm256_mul_pd(scales, dx);
                acc[t] = _mm256_fmadd_pd(factors, _mm256_cvtepi32_pd(sums), acc[t]);
                add_min!(s0, x, b, min_chains, t);
                add_min!(s1, x, b + 1, min_chains, t);
                add_min!(s2, x, b + 2, min_chains, t);
                add_min!(s3, x, b + 3, min_chains, t);
            }
            b += 4;
        }
        let mut chains = [[0.0f64; 4]; T];
        for t in 0..T {
            _mm256_storeu_pd(chains[t].as_mut_ptr(), acc[t]);
        }
        while b < blocks {
            let s = sub(b);
            let u = unsigned!(s);
            for t in 0..T {
                let x = &xs[t];
                let r = block_lanes!(s, u, x, b);
                let h = _mm_add_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256::<1>(r));
                let h = _mm_hadd_epi32(_mm_hadd_epi32(h, h), h);
                let sum = f64::from(_mm_cvtsi128_si32(h));
                let factor = f64::from(s.scale) * f64::from(*x.d.get_unchecked(b));
                chains[t][b % 4] = factor.mul_add(sum, chains[t][b % 4]);
                add_min!(s, x, b, min_chains, t);
            }
            b += 1;
        }
        let mut out = [0.0; T];
        for t in 0..T {
            let c = chains[t];
            let total = (c[0] + c[2]) + (c[1] + c[3]);
            let m = min_chains[0][t] + min_chains[1][t];
            out[t] = match mins {
                Mins::None => total,
                Mins::Add => total + m,
                Mins::Subtract => total - m,
            };
        }
        out
    }
}

/// One kernel: `$name`, compiled for `$features`, its lanes through `$lanes`, reading the
/// row `$w` with `$blocks` sub-blocks through `|$b| $sub`.
macro_rules! int8_kernel {
    ($(#[$doc:meta])* $name:ident, $features:literal, $lanes:ident, $mins:expr,
     |$w:ident| $blocks:expr, |$b:ident| $sub:expr) => {
        $(#[$doc])*
        #[target_feature(enable = $features)]
        pub unsafe fn $name<const T: usize, const WIDE: bool>(
            $w: &[u8],
            xs: [Q8Row<'_>; T],
        ) -> [f64; T] {
            // SAFETY: the caller's features and lengths.
            unsafe {
                dot_blocks::<T, WIDE>(
                    $blocks,
                    xs,
                    $mins,
                    #[inline(always)]
                    |$b| $sub,
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
    ($(#[$doc:meta])* $avx2:ident, $vnni:ident, $mins:expr,
     |$w:ident| $blocks:expr, |$b:ident| $sub:expr) => {
        int8_kernel!(
            $(#[$doc])*
            ///
            /// # Safety
            /// Needs AVX2, FMA and F16C; `w` holds whole blocks, one 32-value sub-block per
            /// scale of every vector.
            $avx2, "avx2,fma,f16c", lanes_avx2, $mins, |$w| $blocks, |$b| $sub
        );
        int8_kernel!(
            $(#[$doc])*
            ///
            /// # Safety
            /// Needs AVX2, FMA, F16C, AVX-512 VNNI and VL; lengths as the AVX2 kernel.
            $vnni, "avx2,fma,f16c,avx512vnni,avx512vl", lanes_vnni, $mins, |$w| $blocks,
            |$b| $sub
        );
    };
}

int8_kernels!(
    /// Q8_0 row (f16 d, 32 × i8 per block) with 8-bit activations.
    dot_q8_0, dot_q8_0_vnni, Mins::None, |w| w.len() / 34, |b| {
        let block = w.as_ptr().add(b * 34);
        Sub { values: load32(block.add(2)), signed: true, scale: f16_at(block), min: 0.0 }
    }
);

int8_kernels!(
    /// Q4_0 row (f16 d, 16 bytes of nibbles; value q − 8) with 8-bit activations.
    dot_q4_0, dot_q4_0_vnni, Mins::None, |w| w.len() / 18, |b| {
        let block = w.as_ptr().add(b * 18);
        let values = _mm256_sub_epi8(nibbles(block.add(2)), _mm256_set1_epi8(8));
        Sub { values, signed: true, scale: f16_at(block), min: 0.0 }
    }
);

int8_kernels!(
    /// Q4_1 row (f16 d, f16 m, 16 bytes of nibbles; value d·q + m) with 8-bit activations.
    dot_q4_1, dot_q4_1_vnni, Mins::Add, |w| w.len() / 20, |b| {
        let block = w.as_ptr().add(b * 20);
        Sub { values: nibbles(block.add(4)), signed: false, scale: f16_at(block), min: f16_at(block.add(2)) }
    }
);

int8_kernels!(
    /// Q4_K row (256 values per block: f16 d, f16 dmin, 12 bytes of 6-bit sub-block scales
    /// and mins, 128 bytes of nibbles; value `(d·sc)·q − dmin·m`) with 8-bit activations:
    /// sub-blocks 2c and 2c + 1 are the low and high nibbles of the c-th 32 bytes.
    dot_q4_k, dot_q4_k_vnni, Mins::Subtract, |w| w.len() / 144 * 8, |b| {
        let block = w.as_ptr().add(b / 8 * 144);
        let j = b % 8;
        let scales: &[u8; 12] = &*block.add(4).cast::<[u8; 12]>();
        let (sc, m) = q4_k_scale_min(j, scales);
        let qs = load32(block.add(16 + 32 * (j / 2)));
        let shifted = if j % 2 == 0 { qs } else { _mm256_srli_epi16::<4>(qs) };
        let values = _mm256_and_si256(shifted, _mm256_set1_epi8(0x0f));
        let scale = f16_at(block) * f32::from(sc);
        let min = f16_at(block.add(2)) * f32::from(m);
        Sub { values, signed: false, scale, min }
    }
);
