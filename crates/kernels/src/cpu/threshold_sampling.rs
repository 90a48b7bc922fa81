//! The sampling rule, in one place. The host's [`Sampler`](crate::sampling::Sampler)
//! applies it after the penalties, and the CUDA `sample_rows` kernel (`cuda/sampling.cu`) is
//! its twin: the same float operations in the same order and the same integer sums, so that
//! for the same logits, settings and draw both pick the same token, to the bit.
//!
//! Temperature ≤ 0 (or NaN), or no finite maximum: greedy, the first index of the maximum.
//! Otherwise, with `x_i = l_i / T`:
//! - tokens are taken in order of `x`, largest first, lower index first on ties (the order
//!   of [`order_key`]);
//! - each weighs `w_i = e^(x_i − max x)` ([`sampling_exp`]: the largest weighs 1), summed
//!   as the integers `⌊w_i · 2⁴⁰⌋`, so that every sum is exact in any order;
//! - top-k (0 < k < vocab) keeps the tokens whose `x` is at least the k-th largest (ties at
//!   the cut stay);
//! - top-p (< 1) then keeps the shortest head of that order, in whole groups of equal `x`,
//!   whose weight reaches `⌊top_p · W_k⌋` (`W_k`: what top-k kept);
//! - min-p (> 0) then drops the tokens with `w_i < min_p` (relative to the largest);
//! - the token is the first, in that order, at which the kept weight summed so far reaches
//!   `max(1, ⌊u · W⌋)` (`W`: all the kept weight), `u` the uniform draw in `[0, 1)`.
//!
//! These are the steps of vLLM and transformers (temperature, top-k, softmax, top-p, min-p,
//! one inverse-CDF draw over the sorted probabilities) with exact sums where they sum
//! floats, which is what lets a GPU, summing in another order, agree.

/// A weight's fixed-point scale, 2⁴⁰: a vocabulary of 2¹⁷ weights of at most 1 sums below
/// 2⁵⁸, and a weight of 2⁻⁴⁰ still counts.
const FIXED_ONE: f32 = 1_099_511_627_776.0;

/// The sampling settings of one row.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ThresholdParams {
    /// ≤ 0: greedy.
    pub temperature: f32,
    /// 0: no limit.
    pub top_k: u32,
    /// 1: no limit.
    pub top_p: f32,
    /// 0: no limit.
    pub min_p: f32,
}

impl ThresholdParams {
    /// The first index of the maximum.
    pub const GREEDY: ThresholdParams = ThresholdParams {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
    };

    /// Whether these settings pick the maximum without a draw.
    pub fn is_greedy(&self) -> bool {
        // NaN is greedy too.
        self.temperature.is_nan() || self.temperature <= 0.0
    }
}

/// One row's part of the rule: its settings and its uniform draw in `[0, 1)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowDraw {
    pub params: ThresholdParams,
    pub uniform: f32,
}

/// Memory [`sample_threshold_in`] reuses from call to call.
#[derive(Debug, Default)]
pub struct SampleScratch {
    /// Tokens in the rule's order: `!key << 32 | index`, ascending.
    order: Vec<u64>,
    /// `w` of each token of `order`.
    weights: Vec<f32>,
}

/// The token of one row of logits for the draw `u` (see the module's rule).
pub fn sample_threshold(logits: &[f32], params: ThresholdParams, u: f32) -> u32 {
    sample_threshold_in(logits, params, u, &mut SampleScratch::default())
}

/// [`sample_threshold`] with memory kept between calls.
pub fn sample_threshold_in(
    logits: &[f32],
    params: ThresholdParams,
    u: f32,
    scratch: &mut SampleScratch,
) -> u32 {
    let (max, argmax) = first_max(logits);
    let t = params.temperature;
    if params.is_greedy() || !max.is_finite() {
        return argmax;
    }
    let x_max = max / t;
    let SampleScratch { order, weights } = scratch;
    order.clear();
    order.extend(
        logits
            .iter()
            .enumerate()
            .map(|(i, &l)| entry(order_key(l / t), i)),
    );
    let k = params.top_k as usize;
    if k > 0 && k < logits.len() {
        keep_top_k(order, k);
    }
    order.sort_unstable();
    weights.clear();
    weights.extend(
        order
            .iter()
            .map(|&e| sampling_exp(key_value(key_of(e)) - x_max)),
    );
    let end = if params.top_p < 1.0 {
        top_p_end(order, weights, params.top_p)
    } else {
        order.len()
    };
    let min_w = if params.min_p > 0.0 {
        params.min_p.min(1.0)
    } else {
        0.0
    };
    let (order, weights) = (&order[..end], &weights[..end]);
    let kept = weights.iter().filter(|&&w| w >= min_w);
    let total: u64 = kept.map(|&w| fixed(w)).sum();
    if total == 0 {
        return argmax;
    }
    let need = need_of(u, total);
    let mut sum = 0u64;
    for (&e, &w) in order.iter().zip(weights) {
        if w >= min_w {
            sum += fixed(w);
            if sum >= need {
                return index_of(e);
            }
        }
    }
    argmax
}

/// The largest logit and the first index holding it (NaN never is; 0 when none is above −∞).
fn first_max(logits: &[f32]) -> (f32, u32) {
    let (mut max, mut at) = (f32::NEG_INFINITY, 0u32);
    for (i, &l) in logits.iter().enumerate() {
        if l > max {
            max = l;
            at = i as u32;
        }
    }
    (max, at)
}

/// Keeps the entries whose key is at least the k-th largest, in no order.
fn keep_top_k(order: &mut Vec<u64>, k: usize) {
    order.select_nth_unstable(k - 1);
    let level = key_of(order[k - 1]);
    let mut kept = k;
    for j in k..order.len() {
        if key_of(order[j]) == level {
            order.swap(kept, j);
            kept += 1;
        }
    }
    order.truncate(kept);
}

/// The end of the shortest head of `order`, in whole groups of one key, whose weight
/// reaches `top_p` of the weight of all of `order`.
fn top_p_end(order: &[u64], weights: &[f32], top_p: f32) -> usize {
    let total: u64 = weights.iter().map(|&w| fixed(w)).sum();
    let need = need_of(top_p, total);
    let (mut sum, mut j) = (0u64, 0);
    while j < order.len() {
        let key = key_of(order[j]);
        while j < order.len() && key_of(order[j]) == key {
            sum += fixed(weights[j]);
            j += 1;
        }
        if sum >= need {
            return j;
        }
    }
    order.len()
}

/// `max(1, ⌊ratio · total⌋)`, the product in f64 (as the kernel computes it).
fn need_of(ratio: f32, total: u64) -> u64 {
    let need = if ratio > 0.0 {
        (f64::from(ratio) * total as f64) as u64
    } else {
        0
    };
    need.max(1)
}

/// `⌊w · 2⁴⁰⌋`; 0 for a weight that is not positive.
fn fixed(w: f32) -> u64 {
    if w > 0.0 { (w * FIXED_ONE) as u64 } else { 0 }
}

fn entry(key: u32, index: usize) -> u64 {
    (u64::from(!key) << 32) | index as u64
}

fn key_of(entry: u64) -> u32 {
    !((entry >> 32) as u32)
}

fn index_of(entry: u64) -> u32 {
    entry as u32
}

/// The bits of `x` as an unsigned integer in the order of `x` (−0 just below +0; NaNs
/// at the ends, by their bits).
pub fn order_key(x: f32) -> u32 {
    let b = x.to_bits();
    if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    }
}

/// The float whose [`order_key`] is `key`.
pub fn key_value(key: u32) -> f32 {
    f32::from_bits(if key & 0x8000_0000 != 0 {
        key & 0x7fff_ffff
    } else {
        !key
    })
}

/// `log2 e`, `ln 2` in two parts (the first exact in a product with any exponent of f32),
/// and the Taylor coefficients 1/6! … 1/2!, as f32 bits (`sampling.cu` writes the same).
const LOG2_E: u32 = 0x3fb8_aa3b;
const LN2_HI: u32 = 0x3f31_7200;
const LN2_LO: u32 = 0x35bf_be8e;
const TAYLOR: [u32; 5] = [
    0x3ab6_0b61,
    0x3c08_8889,
    0x3d2a_aaab,
    0x3e2a_aaab,
    0x3f00_0000,
];

/// `e^x` for `x ≤ 0` from f32 multiplies and adds in a fixed order, none fused, so that
/// `sampling.cu` computes the same bits: `x = n·ln 2 + r`, `|r| ≤ ln 2 / 2`, a degree-6
/// Taylor polynomial of `r`, scaled by `2^n`. Within 4 ulp of `e^x`; 0 below −104 (where
/// `e^x` is below half the smallest subnormal) and for NaN.
pub fn sampling_exp(x: f32) -> f32 {
    if x.is_nan() || x < -104.0 {
        return 0.0;
    }
    let f = f32::from_bits;
    let n = (x * f(LOG2_E) + 0.5).floor();
    let r = (x - n * f(LN2_HI)) - n * f(LN2_LO);
    let mut p = f(TAYLOR[0]);
    for &c in &TAYLOR[1..] {
        p = p * r + f(c);
    }
    p = p * r + 1.0;
    p = p * r + 1.0;
    let mut e = n as i32;
    if e < -126 {
        p *= f(1 << 23); // 2⁻¹²⁶
        e += 126;
    }
    p * f(((e + 127) as u32) << 23)
}

#[cfg(test)]
mod tests;
