//! The gated MLP activations (Shazeer 2020, <https://arxiv.org/abs/2002.05202>):
//! `silu(gate) · up` (SwiGLU) and `gelu_tanh(gate) · up` (GeGLU, Gemma).

use rayon::prelude::*;

/// Values per task: a longer input (a prefill's) is split across the pool.
const PARALLEL_VALUES: usize = 8 * 1024;

/// `gate[i] = f(gate[i], up[i])`, element by element (the same bits however it is split).
fn gated(gate: &mut [f32], up: &[f32], f: impl Fn(f32, f32) -> f32 + Sync + Copy) {
    (gate.par_chunks_mut(PARALLEL_VALUES))
        .zip(up.par_chunks(PARALLEL_VALUES))
        .for_each(|(gate, up)| gated_here(gate, up, f));
}

/// [`gated`] on this thread.
fn gated_here(gate: &mut [f32], up: &[f32], f: impl Fn(f32, f32) -> f32) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = f(*g, *u);
    }
}

/// `silu(g) · u` where `silu(x) = x · sigmoid(x)`.
fn silu_times(g: f32, u: f32) -> f32 {
    g / (1.0 + (-g).exp()) * u
}

/// `gelu_tanh(x) · u`, GELU's tanh approximation as torch computes it
/// (`approximate="tanh"`): `½x(1 + tanh(√(2/π)(x + 0.044715x³)))`.
fn gelu_tanh_times(x: f32, u: f32) -> f32 {
    const K: f32 = 0.797_884_6; // √(2/π)
    let inner = K * (x + 0.044_715 * x * x * x);
    0.5 * x * (1.0 + inner.tanh()) * u
}

/// `gate[i] = silu(gate[i]) · up[i]` where `silu(x) = x · sigmoid(x)`.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    gated(gate, up, silu_times);
}

/// `gate[i] = gelu_tanh(gate[i]) · up[i]` ([`gelu_tanh_times`]).
pub fn gelu_tanh_mul(gate: &mut [f32], up: &[f32]) {
    gated(gate, up, gelu_tanh_times);
}

/// [`silu_mul`] of one vector, on this thread (for [`crate::matmul::Input::make`], which
/// runs the vectors across the pool).
pub fn silu_mul_row(gate: &mut [f32], up: &[f32]) {
    gated_here(gate, up, silu_times);
}

/// [`gelu_tanh_mul`] of one vector, on this thread.
pub fn gelu_tanh_mul_row(gate: &mut [f32], up: &[f32]) {
    gated_here(gate, up, gelu_tanh_times);
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

    #[test]
    fn gelu_tanh_mul_matches_torch_values() {
        // torch.nn.functional.gelu(x, approximate="tanh") in float64.
        let x = [-3.0f32, -1.0, -0.1, 0.0, 0.5, 2.0];
        let torch = [
            -0.003_637_392_081_773,
            -0.158_808_009_391_723,
            -0.046_017_248_954_865,
            0.0,
            0.345_714_009_825_144,
            1.954_597_694_087_775,
        ];
        let mut g = x.to_vec();
        super::gelu_tanh_mul(&mut g, &[1.0; 6]);
        for (a, b) in g.iter().zip(torch) {
            assert!((f64::from(*a) - b).abs() <= 1e-6, "{a} vs {b}");
        }
    }
}
