//! The gated MLP activation: `silu(gate) · up` (SwiGLU, Shazeer 2020,
//! <https://arxiv.org/abs/2002.05202>).

/// `gate[i] = silu(gate[i]) · up[i]` where `silu(x) = x · sigmoid(x)`.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn silu_mul_matches_formula() {
        let mut g = vec![-20.0, -1.0, 0.0, 0.5, 3.0, 30.0];
        let u = vec![2.0, 2.0, 2.0, -1.0, 0.5, 1.0];
        let expect: Vec<f32> = g
            .iter()
            .zip(&u)
            .map(|(&x, &y): (&f32, &f32)| {
                let x = f64::from(x);
                (x / (1.0 + (-x).exp()) * f64::from(y)) as f32
            })
            .collect();
        super::silu_mul(&mut g, &u);
        for (a, b) in g.iter().zip(expect) {
            assert!((a - b).abs() <= 1e-6 * b.abs().max(1.0), "{a} vs {b}");
        }
    }
}
