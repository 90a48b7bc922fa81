//! The CPU twin of the CUDA `sample_rows` kernel (`cuda/sampling.cu`): the same rule, step
//! for step, so that the GPU check can compare the two token for token.
//!
//! Temperature ≤ 0: the first index of the maximum. Otherwise `p_i = exp((l_i − max) / T)`
//! (the largest is 1); the kept tokens are those with `p_i ≥ max(min_p, t_k, t_p)`, `t_k`
//! the largest threshold (found by bisection) that keeps at least `top_k` tokens and `t_p`
//! the largest that keeps at least `top_p` of the mass; the token is where the kept mass,
//! summed in index order, first exceeds `u ·` (kept mass).

/// Bisection steps for a threshold: 2⁻³² of the unit interval.
const BISECT_STEPS: usize = 32;

/// The sampling settings of one row.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ThresholdParams {
    pub temperature: f32,
    /// 0: no limit.
    pub top_k: u32,
    /// 1: no limit.
    pub top_p: f32,
    pub min_p: f32,
}

/// The token of one row of logits for the uniform draw `u` in `[0, 1)`.
pub fn sample_threshold(logits: &[f32], params: ThresholdParams, u: f32) -> u32 {
    let (mut m, mut argmax) = (f32::NEG_INFINITY, 0u32);
    for (i, &v) in logits.iter().enumerate() {
        if v > m {
            m = v;
            argmax = i as u32;
        }
    }
    if params.temperature <= 0.0 || params.temperature.is_nan() || m == f32::NEG_INFINITY {
        return argmax;
    }
    let inv_t = 1.0 / params.temperature;
    let p = |l: f32| ((l - m) * inv_t).exp();
    let at_least = |t: f32, count: bool| -> f32 {
        logits
            .iter()
            .map(|&l| p(l))
            .filter(|&q| q >= t)
            .map(|q| if count { 1.0 } else { q })
            .sum()
    };
    let threshold = |need: f32, count: bool| -> f32 {
        if at_least(1.0, count) >= need {
            return 1.0;
        }
        let (mut lo, mut hi) = (0.0f32, 1.0f32);
        for _ in 0..BISECT_STEPS {
            let mid = 0.5 * (lo + hi);
            if at_least(mid, count) >= need {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    };
    let mut t = params.min_p.clamp(0.0, 1.0);
    let vocab = logits.len();
    if params.top_k > 0 && (params.top_k as usize) < vocab {
        t = t.max(threshold(params.top_k as f32, true));
    }
    if params.top_p < 1.0 {
        let total = at_least(0.0, false);
        t = t.max(threshold(params.top_p * total, false));
    }
    let kept = at_least(t, false);
    let target = u * kept;
    let mut run = 0.0f32;
    for (i, &l) in logits.iter().enumerate() {
        let q = p(l);
        if q >= t {
            run += q;
            if target < run {
                return i as u32;
            }
        }
    }
    // Rounding left the target past the last kept token: the maximum is always kept.
    argmax
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: u32, top_p: f32, min_p: f32) -> ThresholdParams {
        ThresholdParams {
            temperature,
            top_k,
            top_p,
            min_p,
        }
    }

    #[test]
    fn greedy_and_degenerate_limits_pick_the_maximum() {
        // Greedy takes the first of two equal maxima; min_p = 1 keeps both.
        let logits = [0.5, 3.0, -1.0, 3.0, 2.9];
        assert_eq!(sample_threshold(&logits, params(0.0, 0, 1.0, 0.0), 0.99), 1);
        assert_eq!(sample_threshold(&logits, params(1.0, 0, 1.0, 1.0), 0.0), 1);
        assert_eq!(sample_threshold(&logits, params(1.0, 0, 1.0, 1.0), 0.99), 3);
        for u in [0.0, 0.3, 0.999] {
            assert_eq!(
                sample_threshold(&logits[..3], params(1.0, 1, 1.0, 0.0), u),
                1
            );
            assert_eq!(
                sample_threshold(&logits[..3], params(1.0, 0, 1.0, 1.0), u),
                1
            );
            assert_eq!(
                sample_threshold(&logits[..3], params(1.0, 0, 1e-6, 0.0), u),
                1
            );
        }
    }

    #[test]
    fn top_k_keeps_the_k_best_and_the_draw_walks_them_in_index_order() {
        // p ∝ e^l: 1, e², e⁴, e³ for l = 0, 2, 4, 3; top-2 keeps indices 2 and 3.
        let logits = [0.0, 2.0, 4.0, 3.0];
        let p2 = 1.0f32;
        let p3 = (-1.0f32).exp();
        let cut = p2 / (p2 + p3);
        let pick = |u| sample_threshold(&logits, params(1.0, 2, 1.0, 0.0), u);
        assert_eq!(pick(0.0), 2);
        assert_eq!(pick(cut - 1e-3), 2);
        assert_eq!(pick(cut + 1e-3), 3);
        assert_eq!(pick(0.9999), 3);
    }

    #[test]
    fn frequencies_follow_the_kept_distribution() {
        let logits = [1.0, 0.0, 2.0, -5.0];
        let mut counts = [0usize; 4];
        let n = 20_000;
        for i in 0..n {
            let u = (i as f32 + 0.5) / n as f32;
            counts[sample_threshold(&logits, params(1.0, 0, 1.0, 0.0), u) as usize] += 1;
        }
        let z: f32 = logits.iter().map(|l| l.exp()).sum();
        for (c, l) in counts.iter().zip(logits) {
            let want = l.exp() / z;
            let got = *c as f32 / n as f32;
            assert!((got - want).abs() < 2e-3, "{got} vs {want}");
        }
    }

    #[test]
    fn top_p_keeps_the_smallest_head_with_that_mass() {
        // Probabilities 0.5, 0.3, 0.2 (as logits); top_p 0.7 keeps the first two.
        let logits = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()];
        for i in 0..100 {
            let u = i as f32 / 100.0;
            let token = sample_threshold(&logits, params(1.0, 0, 0.7, 0.0), u);
            assert!(token < 2, "u {u}: {token}");
        }
    }
}
