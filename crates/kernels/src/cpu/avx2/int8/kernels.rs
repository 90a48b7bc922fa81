//! The kernel of each weight type with 8-bit activations, and its VNNI twin: how a row's
//! blocks are read ([`super::dot_blocks`] does the rest).

use std::arch::x86_64::*;

use super::reads::*;
use super::{Mins, Octet, Sub, dot_blocks};
use crate::cpu::int8::Q8Row;
use crate::quant::iq4::{
    BLOCK_IQ4_NL_BYTES, BLOCK_IQ4_XS_BYTES, IQ4_NL_QS_OFFSET, IQ4_XS_QS_OFFSET, iq4_xs_scale,
};
use crate::quant::k_quants::{
    BLOCK_Q4_K_BYTES, BLOCK_Q5_K_BYTES, BLOCK_Q6_K_BYTES, Q4_K_QS_OFFSET, Q5_K_QH_OFFSET,
    Q5_K_QS_OFFSET, Q6_K_D_OFFSET, Q6_K_QH_OFFSET, Q6_K_SCALES_OFFSET, q4_k_scale_min,
};
use crate::quant::k_quants_small::{
    BLOCK_Q2_K_BYTES, BLOCK_Q3_K_BYTES, Q2_K_D_OFFSET, Q2_K_QS_OFFSET, Q3_K_D_OFFSET,
    Q3_K_QS_OFFSET, Q3_K_SCALES_OFFSET, q3_k_scale_pair,
};

int8_kernels!(
    /// Q8_0 row (f16 d, 32 × i8 per block) with 8-bit activations.
    dot_q8_0, dot_q8_0_vnni, Mins::None, |w| w.len() / 34, |b| {
        let block = w.as_ptr().add(b * 34);
        Sub { values: load32(block.add(2)), signed: true, scale: f16_at(block), min: 0.0, halves: None, min_halves: None }
    },
    |q| (f16x4(w.as_ptr().add(q * 34), 34), _mm_setzero_ps()),
    // Octets for groups only: with one vector, the transpose of 8 × 32 bytes per octet
    // costs more than the horizontal adds it saves (matvec 1536 × 576 at 1 thread: quads
    // 26.0–26.8 GiB/s, octets 24.7–25.8).
    (T > 1).then_some(
        #[inline(always)]
        |o: usize| Octet { values: byte_octet(w.as_ptr().add(o * 34 + 2), 34), signed: true }
    )
);

int8_kernels!(
    /// Q4_0 row (f16 d, 16 bytes of nibbles; value q − 8) with 8-bit activations.
    dot_q4_0, dot_q4_0_vnni, Mins::None, |w| w.len() / 18, |b| {
        let block = w.as_ptr().add(b * 18);
        let values = _mm256_sub_epi8(nibbles(block.add(2)), _mm256_set1_epi8(8));
        Sub { values, signed: true, scale: f16_at(block), min: 0.0, halves: None, min_halves: None }
    },
    |q| (f16x4(w.as_ptr().add(q * 18), 18), _mm_setzero_ps()),
    Some(
        #[inline(always)]
        |o: usize| {
            let mut values = nibble_octet(w.as_ptr().add(o * 18 + 2), 18);
            for v in &mut values {
                *v = _mm256_sub_epi8(*v, _mm256_set1_epi8(8));
            }
            Octet { values, signed: true }
        }
    )
);

int8_kernels!(
    /// Q4_1 row (f16 d, f16 m, 16 bytes of nibbles; value d·q + m) with 8-bit activations.
    dot_q4_1, dot_q4_1_vnni, Mins::Add, |w| w.len() / 20, |b| {
        let block = w.as_ptr().add(b * 20);
        let (scale, min) = (f16_at(block), f16_at(block.add(2)));
        Sub { values: nibbles(block.add(4)), signed: false, scale, min, halves: None, min_halves: None }
    },
    |q| f16_pairs_x4(w.as_ptr().add(q * 20), 20),
    Some(
        #[inline(always)]
        |o: usize| Octet { values: nibble_octet(w.as_ptr().add(o * 20 + 4), 20), signed: false }
    )
);

int8_kernels!(
    /// Q5_0 row (f16 d, 32 fifth bits, 16 bytes of nibbles; value q − 16) with 8-bit
    /// activations.
    dot_q5_0, dot_q5_0_vnni, Mins::None, |w| w.len() / 22, |b| {
        let block = w.as_ptr().add(b * 22);
        let q = _mm256_or_si256(nibbles(block.add(6)), fifth_bits(block.add(2)));
        let values = _mm256_sub_epi8(q, _mm256_set1_epi8(16));
        Sub { values, signed: true, scale: f16_at(block), min: 0.0, halves: None, min_halves: None }
    },
    |q| (f16x4(w.as_ptr().add(q * 22), 22), _mm_setzero_ps())
);

int8_kernels!(
    /// Q5_1 row (f16 d, f16 m, 32 fifth bits, 16 bytes of nibbles; value d·q + m) with
    /// 8-bit activations.
    dot_q5_1, dot_q5_1_vnni, Mins::Add, |w| w.len() / 24, |b| {
        let block = w.as_ptr().add(b * 24);
        let values = _mm256_or_si256(nibbles(block.add(8)), fifth_bits(block.add(4)));
        let (scale, min) = (f16_at(block), f16_at(block.add(2)));
        Sub { values, signed: false, scale, min, halves: None, min_halves: None }
    },
    |q| f16_pairs_x4(w.as_ptr().add(q * 24), 24)
);

/// The Q4_K and Q5_K kernels from one block reader (`$five`: Q5_K's fifth bits): 256 values
/// per block of `$bytes` bytes, f16 d, f16 dmin, 12 bytes of 6-bit sub-block scales and
/// mins, then (Q5_K) 32 bytes of fifth bits, and 128 bytes of nibbles at `$qs`; value
/// `(d·sc)·q − dmin·m`. Sub-blocks 2c and 2c + 1 are the low and high nibbles of the c-th 32
/// bytes, and the fifth bit of sub-block j's value i is bit j of qh[i]. One macro rather
/// than helper functions for the scales: those kept their `f16_at` calls as calls, and
/// Q4_K's kernel lost 10 to 15% (matvec 4096 × 4096, 1 thread).
macro_rules! k_quant_kernels {
    ($(#[$doc:meta])* $avx2:ident, $vnni:ident, $bytes:expr, $qs:expr, $five:expr) => {
        int8_kernels!(
            $(#[$doc])*
            $avx2, $vnni, Mins::Subtract, |w| w.len() / $bytes * 8, |b| {
                let block = w.as_ptr().add(b / 8 * $bytes);
                let j = b % 8;
                let scales: &[u8; 12] = &*block.add(4).cast::<[u8; 12]>();
                let (sc, m) = q4_k_scale_min(j, scales);
                let qs = load32(block.add($qs + 32 * (j / 2)));
                let shifted = if j % 2 == 0 { qs } else { _mm256_srli_epi16::<4>(qs) };
                let mut values = _mm256_and_si256(shifted, _mm256_set1_epi8(0x0f));
                if $five {
                    let qh = load32(block.add(Q5_K_QH_OFFSET));
                    let bit = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(j as i32));
                    let bit = _mm256_and_si256(bit, _mm256_set1_epi8(1));
                    values = _mm256_or_si256(values, _mm256_slli_epi16::<4>(bit));
                }
                let scale = f16_at(block) * f32::from(sc);
                let min = f16_at(block.add(2)) * f32::from(m);
                Sub { values, signed: false, scale, min, halves: None, min_halves: None }
            },
            |q| {
                // Sub-blocks q..q + 4 of one block (q is a multiple of 4).
                let block = w.as_ptr().add(q / 8 * $bytes);
                let scales: &[u8; 12] = &*block.add(4).cast::<[u8; 12]>();
                let pairs: [(u8, u8); 4] =
                    std::array::from_fn(|k| q4_k_scale_min(q % 8 + k, scales));
                let (d, dmin) = (f16_at(block), f16_at(block.add(2)));
                let [a, b, c, e] = pairs.map(|(sc, _)| d * f32::from(sc));
                let [f, g, h, i] = pairs.map(|(_, m)| dmin * f32::from(m));
                (_mm_setr_ps(a, b, c, e), _mm_setr_ps(f, g, h, i))
            }
        );
    };
}

k_quant_kernels!(
    /// Q4_K row with 8-bit activations (see [`k_quant_kernels!`]).
    dot_q4_k, dot_q4_k_vnni, BLOCK_Q4_K_BYTES, Q4_K_QS_OFFSET, false
);

k_quant_kernels!(
    /// Q5_K row with 8-bit activations (see [`k_quant_kernels!`]).
    dot_q5_k, dot_q5_k_vnni, BLOCK_Q5_K_BYTES, Q5_K_QS_OFFSET, true
);

int8_kernels!(
    /// Q6_K row (256 values per block: 128 bytes of low nibbles, 64 of high bit pairs, 16
    /// 8-bit scales of 16-value sub-blocks, f16 d; value `d·sc·(q − 32)`) with 8-bit
    /// activations. Sub-block j = 4h + k is the low (k < 2) or high nibbles of
    /// ql[64h + 32·(k mod 2)..] with bits 2k.. of qh[32h..] above them; its halves' scales
    /// sc[8h + 2k] and sc[8h + 2k + 1] multiply their pair sums in the integers, and `d` is
    /// its factor.
    dot_q6_k, dot_q6_k_vnni, Mins::None, |w| w.len() / BLOCK_Q6_K_BYTES * 8, |b| {
        let block = w.as_ptr().add(b / 8 * BLOCK_Q6_K_BYTES);
        let (h, k) = (b % 8 / 4, b % 4);
        let ql = load32(block.add(64 * h + 32 * (k % 2)));
        let low = if k < 2 { ql } else { _mm256_srli_epi16::<4>(ql) };
        let qh = load32(block.add(Q6_K_QH_OFFSET + 32 * h));
        let high = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * k as i32));
        let high = _mm256_slli_epi16::<4>(_mm256_and_si256(high, _mm256_set1_epi8(3)));
        let q = _mm256_or_si256(_mm256_and_si256(low, _mm256_set1_epi8(0x0f)), high);
        let sc = block.add(Q6_K_SCALES_OFFSET + 8 * h + 2 * k).cast::<i8>();
        let halves = _mm256_set_m128i(
            _mm_set1_epi16(i16::from(*sc.add(1))),
            _mm_set1_epi16(i16::from(*sc)),
        );
        let values = _mm256_sub_epi8(q, _mm256_set1_epi8(32));
        let scale = f16_at(block.add(Q6_K_D_OFFSET));
        Sub { values, signed: true, scale, min: 0.0, halves: Some(halves), min_halves: None }
    },
    |q| {
        let d = f16_at(w.as_ptr().add(q / 8 * BLOCK_Q6_K_BYTES + Q6_K_D_OFFSET));
        (_mm_set1_ps(d), _mm_setzero_ps())
    }
);

int8_kernels!(
    /// Q3_K row (256 values per block: 32 bytes of high bits, 64 of 2-bit quants, 12 of
    /// packed 6-bit scales of 16-value sub-blocks, f16 d; value `d·sc·q` with q in −4..4)
    /// with 8-bit activations. Sub-block j = 4h + k is bits 2k.. of qs[32h..], less 4 where
    /// bit j of hmask[i] is clear; its halves' scales sc[2j] and sc[2j + 1] multiply their
    /// pair sums in the integers, and `d` is its factor.
    dot_q3_k, dot_q3_k_vnni, Mins::None, |w| w.len() / BLOCK_Q3_K_BYTES * 8, |b| {
        let block = w.as_ptr().add(b / 8 * BLOCK_Q3_K_BYTES);
        let j = b % 8;
        let (h, k) = (j / 4, j % 4);
        let qs = load32(block.add(Q3_K_QS_OFFSET + 32 * h));
        let low = _mm256_srl_epi16(qs, _mm_cvtsi32_si128(2 * k as i32));
        let low = _mm256_and_si256(low, _mm256_set1_epi8(3));
        let hmask = _mm256_srl_epi16(load32(block), _mm_cvtsi32_si128(j as i32));
        let high = _mm256_slli_epi16::<2>(_mm256_and_si256(hmask, _mm256_set1_epi8(1)));
        let values = _mm256_sub_epi8(_mm256_or_si256(low, high), _mm256_set1_epi8(4));
        let scales: &[u8; 12] = &*block.add(Q3_K_SCALES_OFFSET).cast::<[u8; 12]>();
        let (first, second) = q3_k_scale_pair(j, scales);
        let halves = _mm256_set_m128i(
            _mm_set1_epi16(i16::from(second)),
            _mm_set1_epi16(i16::from(first)),
        );
        let scale = f16_at(block.add(Q3_K_D_OFFSET));
        Sub { values, signed: true, scale, min: 0.0, halves: Some(halves), min_halves: None }
    },
    |q| {
        let d = f16_at(w.as_ptr().add(q / 8 * BLOCK_Q3_K_BYTES + Q3_K_D_OFFSET));
        (_mm_set1_ps(d), _mm_setzero_ps())
    }
);

int8_kernels!(
    /// IQ4_NL row (f16 d, 16 bytes of 4-bit indices into the 16 levels, laid out as Q4_0's
    /// nibbles; value `d·LEVELS[q]`) with 8-bit activations.
    dot_iq4_nl, dot_iq4_nl_vnni, Mins::None, |w| w.len() / BLOCK_IQ4_NL_BYTES, |b| {
        let block = w.as_ptr().add(b * BLOCK_IQ4_NL_BYTES);
        let values = _mm256_shuffle_epi8(iq4_levels(), nibbles(block.add(IQ4_NL_QS_OFFSET)));
        Sub { values, signed: true, scale: f16_at(block), min: 0.0, halves: None, min_halves: None }
    },
    |q| (f16x4(w.as_ptr().add(q * BLOCK_IQ4_NL_BYTES), BLOCK_IQ4_NL_BYTES), _mm_setzero_ps()),
    Some(
        #[inline(always)]
        |o: usize| {
            let at = w.as_ptr().add(o * BLOCK_IQ4_NL_BYTES + IQ4_NL_QS_OFFSET);
            let mut values = nibble_octet(at, BLOCK_IQ4_NL_BYTES);
            for v in &mut values {
                *v = _mm256_shuffle_epi8(iq4_levels(), *v);
            }
            Octet { values, signed: true }
        }
    )
);

int8_kernels!(
    /// IQ4_XS row (256 values per block: f16 d, 6-bit sub-block scales in 2 + 4 bytes,
    /// 128 bytes of 4-bit indices; sub-block j's value `d·(sc_j − 32)·LEVELS[q]`, its
    /// indices laid out as an IQ4_NL block's) with 8-bit activations.
    dot_iq4_xs, dot_iq4_xs_vnni, Mins::None, |w| w.len() / BLOCK_IQ4_XS_BYTES * 8, |b| {
        let block = w.as_ptr().add(b / 8 * BLOCK_IQ4_XS_BYTES);
        let j = b % 8;
        let at = block.add(IQ4_XS_QS_OFFSET + 16 * j);
        let values = _mm256_shuffle_epi8(iq4_levels(), nibbles(at));
        let header = std::slice::from_raw_parts(block, IQ4_XS_QS_OFFSET);
        let scale = f16_at(block) * f32::from(iq4_xs_scale(j, header));
        Sub { values, signed: true, scale, min: 0.0, halves: None, min_halves: None }
    },
    |q| {
        let block = w.as_ptr().add(q / 8 * BLOCK_IQ4_XS_BYTES);
        let header = std::slice::from_raw_parts(block, IQ4_XS_QS_OFFSET);
        let d = f16_at(block);
        let [a, b, c, e] = std::array::from_fn(|k| d * f32::from(iq4_xs_scale(q % 8 + k, header)));
        (_mm_setr_ps(a, b, c, e), _mm_setzero_ps())
    },
    // An octet of sub-blocks is one whole block: its 8 runs of 16 index bytes, each laid out
    // as an IQ4_NL block's.
    Some(
        #[inline(always)]
        |o: usize| {
            let at = w.as_ptr().add(o / 8 * BLOCK_IQ4_XS_BYTES + IQ4_XS_QS_OFFSET);
            let mut values = nibble_octet(at, 16);
            for v in &mut values {
                *v = _mm256_shuffle_epi8(iq4_levels(), *v);
            }
            Octet { values, signed: true }
        }
    )
);

int8_kernels!(
    /// Q2_K row (256 values per block: 16 bytes of 4-bit scales and mins of 16-value
    /// sub-blocks, 64 bytes of 2-bit quants, f16 d, f16 dmin; value `(d·sc)·q − dmin·m`)
    /// with 8-bit activations. Sub-block j = 4h + k is bits 2k.. of qs[32h..]; its halves'
    /// scales (the low nibbles of bytes 8h + 2k and 8h + 2k + 1) multiply their pair sums
    /// in the integers under the factor `d`, and their mins (the high nibbles) the pair
    /// sums of the vector's values under `dmin` ([`Mins::Halves`]).
    dot_q2_k, dot_q2_k_vnni, Mins::Halves, |w| w.len() / BLOCK_Q2_K_BYTES * 8, |b| {
        let block = w.as_ptr().add(b / 8 * BLOCK_Q2_K_BYTES);
        let j = b % 8;
        let (h, k) = (j / 4, j % 4);
        let qs = load32(block.add(Q2_K_QS_OFFSET + 32 * h));
        let shifted = _mm256_srl_epi16(qs, _mm_cvtsi32_si128(2 * k as i32));
        let values = _mm256_and_si256(shifted, _mm256_set1_epi8(3));
        let (first, second) = (*block.add(8 * h + 2 * k), *block.add(8 * h + 2 * k + 1));
        let words = |low: u8, high: u8| {
            _mm256_set_m128i(_mm_set1_epi16(i16::from(high)), _mm_set1_epi16(i16::from(low)))
        };
        let halves = words(first & 0x0f, second & 0x0f);
        let min_halves = [i32::from(first >> 4), i32::from(second >> 4)];
        let (scale, min) = (f16_at(block.add(Q2_K_D_OFFSET)), f16_at(block.add(Q2_K_D_OFFSET + 2)));
        Sub { values, signed: false, scale, min, halves: Some(halves), min_halves: Some(min_halves) }
    },
    |q| {
        let block = w.as_ptr().add(q / 8 * BLOCK_Q2_K_BYTES);
        let (d, dmin) = (f16_at(block.add(Q2_K_D_OFFSET)), f16_at(block.add(Q2_K_D_OFFSET + 2)));
        (_mm_set1_ps(d), _mm_set1_ps(dmin))
    }
);
