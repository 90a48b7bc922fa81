use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

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
    // Greedy takes the first of two equal maxima; min_p = 1 keeps both, lower index first.
    let logits = [0.5, 3.0, -1.0, 3.0, 2.9];
    assert_eq!(sample_threshold(&logits, params(0.0, 0, 1.0, 0.0), 0.99), 1);
    assert_eq!(sample_threshold(&logits, params(1.0, 0, 1.0, 1.0), 0.0), 1);
    assert_eq!(sample_threshold(&logits, params(1.0, 0, 1.0, 1.0), 0.99), 3);
    for u in [0.0, 0.3, 0.999] {
        for p in [
            params(1.0, 1, 1.0, 0.0),
            params(1.0, 0, 1.0, 1.0),
            params(1.0, 0, 1e-6, 0.0),
            params(1.0, 0, 0.0, 0.0),
            params(f32::NAN, 0, 1.0, 0.0),
        ] {
            assert_eq!(sample_threshold(&logits[..3], p, u), 1, "{p:?} u {u}");
        }
    }
    // No finite maximum: the first index.
    let none = [f32::NEG_INFINITY, f32::NAN];
    assert_eq!(sample_threshold(&none, params(1.0, 0, 1.0, 0.0), 0.5), 0);
}

#[test]
fn top_k_keeps_the_k_best_and_ties_at_the_cut() {
    // w ∝ e^l: 1, e², e⁴, e³ for l = 0, 2, 4, 3; top-2 keeps indices 2 and 3, largest first.
    let logits = [0.0, 2.0, 4.0, 3.0];
    let cut = 1.0 / (1.0 + (-1.0f32).exp());
    let pick = |u| sample_threshold(&logits, params(1.0, 2, 1.0, 0.0), u);
    assert_eq!(pick(0.0), 2);
    assert_eq!(pick(cut - 1e-3), 2);
    assert_eq!(pick(cut + 1e-3), 3);
    assert_eq!(pick(0.9999), 3);
    // Top-1 of two equal maxima keeps both.
    let tied = [1.0, 2.0, 2.0, 0.0];
    assert_eq!(sample_threshold(&tied, params(1.0, 1, 1.0, 0.0), 0.0), 1);
    assert_eq!(sample_threshold(&tied, params(1.0, 1, 1.0, 0.0), 0.9), 2);
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
fn top_p_keeps_the_shortest_head_with_that_mass() {
    // Probabilities 0.5, 0.3, 0.2 (as logits); top_p 0.7 keeps the first two.
    let logits = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()];
    let mut seen = [0; 3];
    for i in 0..100 {
        let u = i as f32 / 100.0;
        seen[sample_threshold(&logits, params(1.0, 0, 0.7, 0.0), u) as usize] += 1;
    }
    assert!(seen[0] > 0 && seen[1] > 0 && seen[2] == 0, "{seen:?}");
}

/// The rule with f64 softmax probabilities and sorted float sums, as transformers and
/// vLLM write it (top-k exactly k, top-p a prefix, min-p against the top probability).
fn reference(logits: &[f32], p: ThresholdParams, u: f32) -> u32 {
    let t = f64::from(p.temperature);
    let mut c: Vec<(u32, f64)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i as u32, f64::from(l) / t))
        .collect();
    c.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if p.top_k > 0 {
        c.truncate(p.top_k as usize);
    }
    let max = c[0].1;
    let z: f64 = c.iter().map(|e| (e.1 - max).exp()).sum();
    let mut probs: Vec<(u32, f64)> = c.iter().map(|e| (e.0, (e.1 - max).exp() / z)).collect();
    let mut acc = 0.0;
    let keep = probs
        .iter()
        .position(|e| {
            acc += e.1;
            acc >= f64::from(p.top_p)
        })
        .map_or(probs.len(), |i| i + 1);
    probs.truncate(keep);
    let floor = f64::from(p.min_p) * probs[0].1;
    probs.retain(|e| e.1 >= floor);
    let total: f64 = probs.iter().map(|e| e.1).sum();
    let mut draw = f64::from(u) * total;
    for e in &probs {
        draw -= e.1;
        if draw <= 0.0 {
            return e.0;
        }
    }
    probs[probs.len() - 1].0
}

#[test]
fn the_rule_picks_what_sorted_float_probabilities_pick() {
    // Continuous random logits have no ties, so the two differ only where a draw falls
    // within rounding of the boundary between two tokens.
    let mut rng = StdRng::seed_from_u64(3);
    let rows = 400;
    let mut same = 0;
    for row in 0..rows {
        let vocab = [50, 1000, 5000][row % 3];
        let logits: Vec<f32> = (0..vocab).map(|_| rng.random_range(-8.0..8.0)).collect();
        let p = params(
            [0.5, 0.8, 1.0, 1.5][row % 4],
            [0, 1, 20, 400][row / 4 % 4],
            [1.0, 0.95, 0.6][row % 5 % 3],
            [0.0, 0.02][row % 2],
        );
        let u: f32 = rng.random_range(0.0..1.0);
        if sample_threshold(&logits, p, u) == reference(&logits, p, u) {
            same += 1;
        }
    }
    assert!(same * 100 >= rows * 99, "{same} of {rows} rows agree");
}

#[test]
fn sampling_exp_is_within_4_ulp_of_exp() {
    assert_eq!(sampling_exp(0.0), 1.0);
    assert_eq!(sampling_exp(f32::NEG_INFINITY), 0.0);
    assert_eq!(sampling_exp(f32::NAN), 0.0);
    assert_eq!(sampling_exp(-105.0), 0.0);
    let mut x = -87.0f32; // the smallest normal results
    while x <= 0.0 {
        let want = f64::from(x).exp();
        let got = f64::from(sampling_exp(x));
        let ulp = f64::from(f32::EPSILON) * want;
        assert!((got - want).abs() <= 4.0 * ulp, "e^{x}: {got} vs {want}");
        x += 0.000_731;
    }
    // Subnormal results: within a few units of the smallest subnormal.
    for x in [-88.0f32, -95.0, -100.0, -103.9] {
        let want = f64::from(x).exp();
        let got = f64::from(sampling_exp(x));
        assert!((got - want).abs() <= 4.0 * 1.4e-45 + 4e-7 * want, "e^{x}");
    }
}

#[test]
fn order_keys_follow_the_floats() {
    let xs = [
        f32::NEG_INFINITY,
        -3.5,
        -1e-40,
        -0.0,
        0.0,
        1e-40,
        2.0,
        f32::INFINITY,
    ];
    for pair in xs.windows(2) {
        assert!(order_key(pair[0]) < order_key(pair[1]), "{pair:?}");
    }
    for x in xs.into_iter().chain([f32::NAN, -f32::NAN, 0.1]) {
        assert_eq!(key_value(order_key(x)).to_bits(), x.to_bits());
    }
}
