//! Rotary position embeddings (Su et al., RoFormer, <https://arxiv.org/abs/2104.09864>),
//! with the frequency scalings Llama-family checkpoints use.
//!
//! The inverse frequencies are computed once per model ([`Rope::new`]); cos/sin for the
//! positions of one forward pass once per pass ([`Rope::tables`]), then reused by every
//! layer and head.

/// How RoPE pairs the dimensions of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopePairing {
    /// Dimension `i` rotates with `i + head_dim/2` (HuggingFace `rotate_half`, GPT-NeoX).
    Halves,
    /// Dimension `2i` rotates with `2i + 1`. llama.cpp's converter permutes the rows of
    /// q/k for the `llama` GGUF architecture so that this pairing on the stored weights
    /// equals `Halves` on the original ones; using it avoids un-permuting quantized rows.
    Interleaved,
}

/// Frequency scaling of RoPE for long contexts.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor`.
    Linear {
        factor: f32,
    },
    /// Llama 3.1's piecewise scaling of the inverse frequencies.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position_embeddings: usize,
    },
    /// One divisor per frequency, as stored in GGUF `rope_freqs.weight`.
    Factors(Vec<f32>),
}

/// Precomputed inverse frequencies of one model.
#[derive(Clone, Debug)]
pub struct Rope {
    inv_freq: Vec<f32>,
    pairing: RopePairing,
}

/// cos and sin of every (position, frequency) of one forward pass.
#[derive(Clone, Debug, Default)]
pub struct RopeTables {
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl Rope {
    /// Frequencies for heads of `head_dim` values (even), base `theta`.
    pub fn new(head_dim: usize, theta: f32, scaling: &RopeScaling, pairing: RopePairing) -> Rope {
        let half = head_dim / 2;
        // As transformers computes them: theta^(2i/d) in f32 arithmetic.
        let mut inv_freq: Vec<f32> = (0..half)
            .map(|i| 1.0 / theta.powf((2 * i) as f32 / head_dim as f32))
            .collect();
        match scaling {
            RopeScaling::None => {}
            RopeScaling::Linear { factor } => inv_freq.iter_mut().for_each(|f| *f /= factor),
            RopeScaling::Factors(factors) => {
                for (f, d) in inv_freq.iter_mut().zip(factors) {
                    *f /= d;
                }
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let old = *original_max_position_embeddings as f32;
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                for f in &mut inv_freq {
                    let wavelen = 2.0 * std::f32::consts::PI / *f;
                    if wavelen > low_wavelen {
                        *f /= factor;
                    } else if wavelen >= high_wavelen {
                        let smooth = (old / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        *f = (1.0 - smooth) * *f / factor + smooth * *f;
                    }
                }
            }
        }
        Rope { inv_freq, pairing }
    }

    /// cos/sin tables for `positions`.
    pub fn tables(&self, positions: &[usize]) -> RopeTables {
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            for &f in &self.inv_freq {
                let angle = p as f32 * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        RopeTables { half, cos, sin }
    }

    /// Rotates every head in `heads` (a multiple of `head_dim` values) for the `t`-th
    /// position of `tables`.
    pub fn apply(&self, tables: &RopeTables, t: usize, heads: &mut [f32]) {
        let half = tables.half;
        let cos = &tables.cos[t * half..(t + 1) * half];
        let sin = &tables.sin[t * half..(t + 1) * half];
        for head in heads.chunks_exact_mut(2 * half) {
            for i in 0..half {
                let (a, b) = match self.pairing {
                    RopePairing::Halves => (i, i + half),
                    RopePairing::Interleaved => (2 * i, 2 * i + 1),
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * cos[i] - x1 * sin[i];
                head[b] = x1 * cos[i] + x0 * sin[i];
            }
        }
    }

    /// The inverse frequencies, after scaling.
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn position_zero_is_identity() {
        let rope = Rope::new(8, 10_000.0, &RopeScaling::None, RopePairing::Halves);
        let tables = rope.tables(&[0]);
        let mut x: Vec<f32> = (0..16).map(|i| i as f32).collect();
        let before = x.clone();
        rope.apply(&tables, 0, &mut x);
        assert_eq!(x, before);
    }

    #[test]
    fn interleaved_equals_halves_on_permuted_dims() {
        // llama.cpp's q/k permutation maps HF dim i (first half) to 2i and i + d/2 to 2i + 1.
        let d = 8;
        let halves = Rope::new(d, 500.0, &RopeScaling::None, RopePairing::Halves);
        let inter = Rope::new(d, 500.0, &RopeScaling::None, RopePairing::Interleaved);
        let tables = halves.tables(&[7]);
        let x: Vec<f32> = (0..d).map(|i| (i as f32 * 0.7).sin()).collect();
        let mut permuted = vec![0.0; d];
        for i in 0..d / 2 {
            permuted[2 * i] = x[i];
            permuted[2 * i + 1] = x[i + d / 2];
        }
        let mut a = x.clone();
        halves.apply(&tables, 0, &mut a);
        inter.apply(&tables, 0, &mut permuted);
        for i in 0..d / 2 {
            assert!((a[i] - permuted[2 * i]).abs() < 1e-6);
            assert!((a[i + d / 2] - permuted[2 * i + 1]).abs() < 1e-6);
        }
    }

    #[test]
    fn rotation_preserves_norm_and_matches_angle() {
        let rope = Rope::new(4, 10_000.0, &RopeScaling::None, RopePairing::Halves);
        let tables = rope.tables(&[3]);
        let mut x = vec![1.0, 0.0, 0.0, 0.0];
        rope.apply(&tables, 0, &mut x);
        // Frequency 0 is 1.0: the pair (x0, x2) turns by 3 radians.
        assert!((x[0] - 3f32.cos()).abs() < 1e-6);
        assert!((x[2] - 3f32.sin()).abs() < 1e-6);
    }

    #[test]
    fn llama3_scaling_keeps_high_and_divides_low_frequencies() {
        let scaling = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 64,
        };
        let plain = Rope::new(16, 10_000.0, &RopeScaling::None, RopePairing::Halves);
        let scaled = Rope::new(16, 10_000.0, &scaling, RopePairing::Halves);
        let (p, s) = (plain.inv_freq(), scaled.inv_freq());
        assert_eq!(p[0], s[0], "wavelength 2π < 16 stays");
        assert!(
            (s[7] - p[7] / 8.0).abs() < 1e-12,
            "the longest wavelength is divided by 8"
        );
        assert!(
            s.iter().zip(p).any(|(a, b)| a < b && *a > b / 8.0),
            "some are smoothed"
        );
    }
}
