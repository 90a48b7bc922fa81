//! The `fast` precision's row dots with 8-bit activations ([`crate::cpu::int8`], whose
//! module documentation states the arithmetic every path shares): AVX2 `vpmaddubsw` +
//! `vpmaddwd`, or AVX-512 VNNI `vpdpbusd` on 256-bit registers where the CPU has it. Both
//! give each block's 8 exact `i32` lanes; everything after is the same float operations.
//!
//! Each kernel dots whole weight rows, one after another, with `T` quantized vectors,
//! unpacking each weight block once for all of them. Where a type has an octet reader (all
//! but Q5_0, Q5_1 and the K-quants), a row's whole octets of 8 blocks are read interleaved, like the vector's
//! ([`Q8Row::octets`]): one register then collects the 8 blocks' sums, with no horizontal
//! adds, and its halves go into the chains exactly as two quads' sums would.

use std::arch::x86_64::*;

use crate::cpu::int8::{BLOCK, OCTET, Q8Row, Sum, add_chains};
mod reads;
use reads::*;

/// One 32-value sub-block of a weight row, as the loop reads it: its values in one
/// register (signed or not), its scale, and the factor of its min term (Q4_1's `m`, Q4_K's
/// `dmin·m`; 0 for the types without one).
#[derive(Clone, Copy)]
struct Sub {
    values: __m256i,
    signed: bool,
    scale: f32,
    min: f32,
    /// Q6_K's: the 8-bit scales of the sub-block's two 16-value halves, as 16-bit words
    /// (the first half's in the low 128 bits), by which its pair sums are multiplied in the
    /// integer sum; none for the other types.
    halves: Option<__m256i>,
    /// Q2_K's: the 4-bit mins of the two halves, by which the vector's sums of their values
    /// ([`Q8Row::hsum`]) are multiplied ([`Mins::Halves`]); none for the other types.
    min_halves: Option<[i32; 2]>,
}

/// Eight 32-value sub-blocks of a weight row, interleaved as the vectors' octets are
/// ([`Q8Row::octets`]), signed or not.
#[derive(Clone, Copy)]
struct Octet {
    values: [__m256i; 8],
    signed: bool,
}

/// What a row's min terms do to its total.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mins {
    None,
    /// Q4_1: value `d·q + m`.
    Add,
    /// Q4_K: value `(d·sc)·q − dmin·m`.
    Subtract,
    /// Q2_K: value `(d·sc)·q − dmin·m` with `sc` and `m` per 16-value half: a block's
    /// `Σ_h m_h·Σ_{i∈h} q_x` is an exact integer sum of its own ([`Sub::min_halves`]),
    /// scaled by `dmin·d_x` into the min chains and taken away. Not with octets.
    Halves,
}

/// Panics unless every vector holds `blocks` scales, `32 · blocks` values and their whole
/// octets: the one check the block loops' raw reads rely on.
fn assert_covers(xs: &[Q8Row<'_>], blocks: usize) {
    assert!(
        (xs.iter()).all(|x| {
            x.d.len() >= blocks
                && x.dsum.len() >= blocks
                && x.qs.len() >= blocks * BLOCK
                && x.octets.len() >= blocks / 8 * OCTET
        }),
        "quantized activations shorter than the weight row"
    );
}

/// Four chains of sums in one register, in f32 ([`__m128`]) or f64 ([`__m256d`]): chain `c`
/// takes blocks `b ≡ c (mod 4)`.
trait Chains: Sum {
    type V: Copy;
    /// Every chain 0.
    fn zero() -> Self::V;
    /// `a·b` per chain, rounded in this type (exact in f64: 24 bits times 24).
    fn product(a: __m128, b: __m128) -> Self::V;
    /// `a` in this type.
    fn widen(a: __m128) -> Self::V;
    /// `a` (integers below 2^24 in magnitude, so exact either way) in this type.
    fn from_ints(a: __m128i) -> Self::V;
    /// `a·b + acc`, rounded once.
    fn fma(a: Self::V, b: Self::V, acc: Self::V) -> Self::V;
    /// `v` with its chains below `first` set to 0.
    fn keep_from(v: Self::V, first: usize) -> Self::V;
    /// The four chains.
    fn chains(v: Self::V) -> [Self; 4];
}

impl Chains for f32 {
    type V = __m128;
    #[inline(always)]
    fn zero() -> __m128 {
        // SAFETY: SSE is part of x86_64.
        unsafe { _mm_setzero_ps() }
    }
    #[inline(always)]
    fn product(a: __m128, b: __m128) -> __m128 {
        // SAFETY: as in `zero`.
        unsafe { _mm_mul_ps(a, b) }
    }
    #[inline(always)]
    fn widen(a: __m128) -> __m128 {
        a
    }
    #[inline(always)]
    fn from_ints(a: __m128i) -> __m128 {
        // SAFETY: as in `zero`.
        unsafe { _mm_cvtepi32_ps(a) }
    }
    #[inline(always)]
    fn fma(a: __m128, b: __m128, acc: __m128) -> __m128 {
        // SAFETY: the kernels that inline this have FMA.
        unsafe { _mm_fmadd_ps(a, b, acc) }
    }
    #[inline(always)]
    fn keep_from(v: __m128, first: usize) -> __m128 {
        // SAFETY: as in `zero`.
        unsafe {
            let lanes = _mm_setr_epi32(0, 1, 2, 3);
            let keep = _mm_cmpgt_epi32(lanes, _mm_set1_epi32(first as i32 - 1));
            _mm_and_ps(v, _mm_castsi128_ps(keep))
        }
    }
    #[inline(always)]
    fn chains(v: __m128) -> [f32; 4] {
        let mut out = [0.0; 4];
        // SAFETY: `out` holds 4 values.
        unsafe { _mm_storeu_ps(out.as_mut_ptr(), v) };
        out
    }
}

impl Chains for f64 {
    type V = __m256d;
    #[inline(always)]
    fn zero() -> __m256d {
        // SAFETY: the kernels that inline this have AVX2.
        unsafe { _mm256_setzero_pd() }
    }
    #[inline(always)]
    fn product(a: __m128, b: __m128) -> __m256d {
        // SAFETY: as in `zero`.
        unsafe { _mm256_mul_pd(_mm256_cvtps_pd(a), _mm256_cvtps_pd(b)) }
    }
    #[inline(always)]
    fn widen(a: __m128) -> __m256d {
        // SAFETY: as in `zero`.
        unsafe { _mm256_cvtps_pd(a) }
    }
    #[inline(always)]
    fn from_ints(a: __m128i) -> __m256d {
        // SAFETY: as in `zero`.
        unsafe { _mm256_cvtepi32_pd(a) }
    }
    #[inline(always)]
    fn fma(a: __m256d, b: __m256d, acc: __m256d) -> __m256d {
        // SAFETY: the kernels that inline this have FMA.
        unsafe { _mm256_fmadd_pd(a, b, acc) }
    }
    #[inline(always)]
    fn keep_from(v: __m256d, first: usize) -> __m256d {
        // SAFETY: as in `zero`.
        unsafe {
            let lanes = _mm256_setr_epi64x(0, 1, 2, 3);
            let keep = _mm256_cmpgt_epi64(lanes, _mm256_set1_epi64x(first as i64 - 1));
            _mm256_and_pd(v, _mm256_castsi256_pd(keep))
        }
    }
    #[inline(always)]
    fn chains(v: __m256d) -> [f64; 4] {
        let mut out = [0.0; 4];
        // SAFETY: `out` holds 4 values.
        unsafe { _mm256_storeu_pd(out.as_mut_ptr(), v) };
        out
    }
}

/// The loop every kernel shares, in the arithmetic of [`crate::cpu::int8`], summing in `S`:
/// over the row's `blocks` 32-value sub-blocks four at a time, `sub(b)` reads each, then for
/// each vector the four blocks' 8 lanes (through `add_lanes`) are reduced to each block's
/// whole integer sum (the four sums in one register), scaled by `scale·d_x` and added into
/// chain [`chain`](crate::cpu::int8::chain)`(b)`; the min terms `min·(d_x·Σq_x)` go into
/// four chains of their own the same way. The blocks after the last whole quad are taken
/// with the row's last 4 blocks, those already summed with factors of exact zeros (a row of
/// fewer than 4 blocks: as a quad whose missing blocks are zeros). The result comes as f64
/// either way. `quad(b)` gives blocks `b..b + 4`'s scales and min factors in one
/// register each (the same values as `sub`'s, read together).
///
/// Where `octet` is given, the row's whole octets go first, eight blocks at a time: the
/// vector's interleaved octet ([`Q8Row::octets`]) against `octet(b)`'s weights of blocks
/// `b..b + 8` laid out alike (signed ones through their signs, as for quads), through
/// `add_lanes`, gives the 8 blocks' sums in one register without a horizontal sum; each
/// half then goes into the chains as a quad's sums.
///
/// # Safety
/// Needs AVX2, FMA, F16C and whatever `sub`, `quad`, `octet` and `add_lanes` need;
/// `sub(b)` reads inside the row for every `b < blocks`, `quad(b)` for every
/// `b + 4 <= blocks`, `octet(b)` for every `b + 8 <= blocks`.
#[inline(always)]
unsafe fn dot_blocks<const T: usize, S: Chains>(
    blocks: usize,
    xs: [Q8Row<'_>; T],
    mins: Mins,
    sub: impl Fn(usize) -> Sub,
    quad: impl Fn(usize) -> (__m128, __m128),
    octet: Option<impl Fn(usize) -> Octet>,
    add_lanes: impl Fn(__m256i, __m256i, __m256i) -> __m256i,
) -> [f64; T] {
    // The one check the raw reads below rely on.
    assert_covers(&xs, blocks);
    // SAFETY: every intrinsic and read below has the caller's features; every vector
    // holds `blocks` scales and `32 · blocks` values (asserted above).
    unsafe {
        // Block `$b`'s 8 lanes with vector `$x`. A macro, not a closure: a closure would
        // not inherit the caller's target features, and its intrinsics would become calls.
        macro_rules! block_lanes {
            ($sub:expr, $unsigned:expr, $x:expr, $b:expr) => {{
                let mut xq = load32($x.qs.as_ptr().add($b * BLOCK).cast());
                if $sub.signed {
                    xq = _mm256_sign_epi8(xq, $sub.values);
                }
                match $sub.halves {
                    // Each 16-bit pair sum (at most 2·32·127) times its half's scale.
                    Some(scales) => _mm256_madd_epi16(_mm256_maddubs_epi16($unsigned, xq), scales),
                    None => add_lanes(_mm256_setzero_si256(), $unsigned, xq),
                }
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
        let mut acc = [S::zero(); T];
        let mut min_acc = [S::zero(); T];
        // Blocks `$b..$b + $n` (`$n` ≤ 4) into the chains, with the quad's scales and min
        // factors; in a last partial quad, the missing blocks count as zeros (lanes, scales
        // and factors), whose fused 0·0 leaves a chain's bits as they were.
        macro_rules! quad {
            ($b:expr, $n:expr, $skip:expr, $scales:expr, $mins:expr) => {{
                let (b, n, skip) = ($b, $n, $skip);
                let none = Sub {
                    values: _mm256_setzero_si256(),
                    signed: false,
                    scale: 0.0,
                    min: 0.0,
                    halves: None,
                    min_halves: None,
                };
                let s0 = sub(b);
                let s1 = if n > 1 { sub(b + 1) } else { none };
                let s2 = if n > 2 { sub(b + 2) } else { none };
                let s3 = if n > 3 { sub(b + 3) } else { none };
                let (u0, u1, u2, u3) = (unsigned!(s0), unsigned!(s1), unsigned!(s2), unsigned!(s3));
                let (scales, min_scales): (__m128, __m128) =
                    ($scales(s0, s1, s2, s3), $mins(s0, s1, s2, s3));
                let block_mins = S::widen(min_scales);
                // Q2_K's mins of the quad's 8 halves (zeros for the other types and past the
                // row's last block).
                let m8 = |s: Sub| s.min_halves.unwrap_or([0, 0]);
                let [a, c, e, g] = [m8(s0), m8(s1), m8(s2), m8(s3)];
                let mins8 = _mm256_setr_epi32(a[0], a[1], c[0], c[1], e[0], e[1], g[0], g[1]);
                for t in 0..T {
                    let x = &xs[t];
                    let zero = _mm256_setzero_si256();
                    let r0 = block_lanes!(s0, u0, x, b);
                    let r1 = if n > 1 {
                        block_lanes!(s1, u1, x, b + 1)
                    } else {
                        zero
                    };
                    let r2 = if n > 2 {
                        block_lanes!(s2, u2, x, b + 2)
                    } else {
                        zero
                    };
                    let r3 = if n > 3 {
                        block_lanes!(s3, u3, x, b + 3)
                    } else {
                        zero
                    };
                    // Per 128-bit half: [Σ r0, Σ r1, Σ r2, Σ r3] of its lanes; then the halves.
                    let q = _mm256_hadd_epi32(_mm256_hadd_epi32(r0, r1), _mm256_hadd_epi32(r2, r3));
                    let sums =
                        _mm_add_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256::<1>(q));
                    // The vector's 4 values from block `b` on (zeros past the last block).
                    let four = |v: &[f32]| {
                        if n == 4 {
                            _mm_loadu_ps(v.as_ptr().add(b))
                        } else {
                            let at = |k: usize| if k < n { *v.get_unchecked(b + k) } else { 0.0 };
                            _mm_setr_ps(at(0), at(1), at(2), at(3))
                        }
                    };
                    let mut factors = S::product(scales, four(x.d));
                    if skip > 0 {
                        factors = S::keep_from(factors, skip);
                    }
                    acc[t] = S::fma(factors, S::from_ints(sums), acc[t]);
                    if mins == Mins::Halves {
                        // Each block's Σ_h m_h·Σ q_x over its halves: the vector's 8 half
                        // sums times the blocks' 8 mins, added in pairs.
                        let sums8 = if n == 4 {
                            _mm256_loadu_si256(x.hsum.as_ptr().add(2 * b).cast())
                        } else {
                            let at = |k: usize| {
                                if k < 2 * n {
                                    *x.hsum.get_unchecked(2 * b + k)
                                } else {
                                    0
                                }
                            };
                            _mm256_setr_epi32(
                                at(0),
                                at(1),
                                at(2),
                                at(3),
                                at(4),
                                at(5),
                                at(6),
                                at(7),
                            )
                        };
                        let pairs = _mm256_hadd_epi32(_mm256_mullo_epi32(mins8, sums8), zero);
                        // [p0 p1 0 0 | p2 p3 0 0] → [p0 p1 p2 p3].
                        let min_sums =
                            _mm256_castsi256_si128(_mm256_permute4x64_epi64::<0b1000>(pairs));
                        let mut min_factors = S::product(min_scales, four(x.d));
                        if skip > 0 {
                            min_factors = S::keep_from(min_factors, skip);
                        }
                        min_acc[t] = S::fma(min_factors, S::from_ints(min_sums), min_acc[t]);
                    } else if mins != Mins::None {
                        let (mut m, mut dsum) = (block_mins, S::widen(four(x.dsum)));
                        if skip > 0 {
                            (m, dsum) = (S::keep_from(m, skip), S::keep_from(dsum, skip));
                        }
                        min_acc[t] = S::fma(m, dsum, min_acc[t]);
                    }
                }
            }};
        }
        let mut b = 0;
        if let Some(octet) = octet {
            while b + 8 <= blocks {
                let Octet { values, signed } = octet(b);
                let mut unsigned = values;
                if signed {
                    for u in &mut unsigned {
                        *u = _mm256_sign_epi8(*u, *u);
                    }
                }
                let (low, high) = (quad(b), quad(b + 4));
                let scales = (low.0, high.0);
                let block_mins = (S::widen(low.1), S::widen(high.1));
                for t in 0..T {
                    let x = &xs[t];
                    let xq = x.octets.as_ptr().add(b * BLOCK).cast::<u8>();
                    let mut sums = _mm256_setzero_si256();
                    for s in 0..8 {
                        let mut x = load32(xq.add(32 * s));
                        if signed {
                            x = _mm256_sign_epi8(x, values[s]);
                        }
                        sums = add_lanes(sums, unsigned[s], x);
                    }
                    let halves = [
                        _mm256_castsi256_si128(sums),
                        _mm256_extracti128_si256::<1>(sums),
                    ];
                    for (h, sums) in halves.into_iter().enumerate() {
                        let first = b + 4 * h;
                        let d = _mm_loadu_ps(x.d.as_ptr().add(first));
                        let factors = S::product(if h == 0 { scales.0 } else { scales.1 }, d);
                        acc[t] = S::fma(factors, S::from_ints(sums), acc[t]);
                        if mins != Mins::None {
                            let dsum = S::widen(_mm_loadu_ps(x.dsum.as_ptr().add(first)));
                            let m = if h == 0 { block_mins.0 } else { block_mins.1 };
                            min_acc[t] = S::fma(m, dsum, min_acc[t]);
                        }
                    }
                }
                b += 8;
            }
        }
        while b + 4 <= blocks {
            let (scales, block_mins) = quad(b);
            quad!(b, 4, 0, |_, _, _, _| scales, |_, _, _, _| block_mins);
            b += 4;
        }
        if b < blocks && blocks >= 4 {
            // The last 4 blocks, those already summed (the first `b - last`) with factors
            // of exact zeros: chains `b + 4 - blocks..4` take the remaining blocks.
            let last = blocks - 4;
            let (scales, block_mins) = quad(last);
            quad!(last, 4, b - last, |_, _, _, _| scales, |_, _, _, _| {
                block_mins
            });
        } else if b < blocks {
            quad!(
                b,
                blocks - b,
                0,
                |s0: Sub, s1: Sub, s2: Sub, s3: Sub| _mm_setr_ps(
                    s0.scale, s1.scale, s2.scale, s3.scale
                ),
                |s0: Sub, s1: Sub, s2: Sub, s3: Sub| _mm_setr_ps(s0.min, s1.min, s2.min, s3.min)
            );
        }
        // A loop, not `array::from_fn`: its closure would not inherit the target features,
        // and the chains' stores would become calls.
        let mut out = [0.0; T];
        for t in 0..T {
            let total = add_chains(S::chains(acc[t]));
            let m = add_chains(S::chains(min_acc[t]));
            out[t] = S::to_f64(match mins {
                Mins::None => total,
                Mins::Add => total + m,
                Mins::Subtract | Mins::Halves => total - m,
            });
        }
        out
    }
}

/// One kernel: `$name`, compiled for `$features`, its lanes added through `$add_lanes`,
/// reading each row `$w` with `$blocks` sub-blocks through `|$b| $sub` (four at a time
/// through `|$q| $quad`, eight interleaved through `$octet`, where it is `Some`).
macro_rules! int8_kernel {
    ($(#[$doc:meta])* $name:ident, $features:literal, $add_lanes:ident, $mins:expr,
     |$w:ident| $blocks:expr, |$b:ident| $sub:expr, |$q:ident| $quad:expr,
     $octet:expr) => {
        $(#[$doc])*
        #[target_feature(enable = $features)]
        pub unsafe fn $name<const T: usize, const WIDE: bool>(
            rows: &[u8],
            row_bytes: usize,
            xs: [Q8Row<'_>; T],
            out: &mut [[f64; T]],
        ) {
            // Every row in this one call: the loop and the kernel compile together.
            for ($w, out) in rows.chunks_exact(row_bytes).zip(out) {
                // Defined here, where the row is in scope of the macro's body.
                macro_rules! run {
                    ($sum:ty) => {
                        // SAFETY: the caller's features and lengths.
                        unsafe {
                            dot_blocks::<T, $sum>(
                                $blocks,
                                xs,
                                $mins,
                                #[inline(always)]
                                |$b| $sub,
                                #[inline(always)]
                                |$q| $quad,
                                $octet,
                                #[inline(always)]
                                |acc, w, x| $add_lanes(acc, w, x),
                            )
                        }
                    };
                }
                *out = if WIDE { run!(f64) } else { run!(f32) };
            }
        }
    };
}

/// The octet reader given, or none.
macro_rules! no_octets {
    () => {
        None::<fn(usize) -> Octet>
    };
    ($octet:expr) => {
        $octet
    };
}

/// A kernel and its VNNI twin from one block loop: `$avx2` through [`add_lanes_avx2`],
/// `$vnni` through [`add_lanes_vnni`] (the same bits).
macro_rules! int8_kernels {
    ($(#[$doc:meta])* $avx2:ident, $vnni:ident, $mins:expr,
     |$w:ident| $blocks:expr, |$b:ident| $sub:expr, |$q:ident| $quad:expr $(, $octet:expr)?) => {
        int8_kernel!(
            $(#[$doc])*
            ///
            /// # Safety
            /// Needs AVX2, FMA and F16C; `w` holds whole blocks, one 32-value sub-block per
            /// scale of every vector.
            $avx2, "avx2,fma,f16c", add_lanes_avx2, $mins, |$w| $blocks,
            |$b| $sub, |$q| $quad, no_octets!($($octet)?)
        );
        int8_kernel!(
            $(#[$doc])*
            ///
            /// # Safety
            /// Needs AVX2, FMA, F16C, AVX-512 VNNI and VL; lengths as the AVX2 kernel.
            $vnni, "avx2,fma,f16c,avx512vnni,avx512vl", add_lanes_vnni, $mins,
            |$w| $blocks, |$b| $sub, |$q| $quad, no_octets!($($octet)?)
        );
    };
}

// After the macros above, which it invokes.
mod kernels;
pub use kernels::*;
