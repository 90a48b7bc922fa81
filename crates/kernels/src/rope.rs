//! Rotary position embeddings (Su et al., RoFormer, <https://arxiv.org/abs/2104.09864>),
//! with the frequency scalings Llama-family checkpoints use.
//!
//! The inverse frequencies are computed once per model ([`Rope::new`]); cos/sin for the
//! positions of one forward pass once per pass ([`Rope::tables`]), then reused by every
//! layer and head.
//!
//! LongRoPE (Ding et al., <https://arxiv.org/abs/2402.13753>; Phi-3's `longrope`, once
//! `su`) keeps two sets of per-frequency divisors: the short ones while a sequence is no
//! longer than the pretraining context, the long ones past it, and scales cos and sin by
//! an attention factor. As in transformers 5 (`longrope_frequency_update`), the set is
//! chosen once per forward call of a sequence, by the sequence's length at the end of the
//! call: every position of that call rotates with it, and K cached by earlier calls keeps
//! the rotation it was written with.

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
    /// LongRoPE: one divisor per frequency for short and for long sequences.
    LongRope(LongRope),
}

/// LongRoPE's settings, as `rope_scaling` of type `longrope` gives them.
#[derive(Clone, Debug, PartialEq)]
pub struct LongRope {
    /// Divisors of `1/θ^(2i/d)` while the sequence is at most `original_max_position_embeddings`.
    pub short_factor: Vec<f32>,
    /// Divisors once it is longer.
    pub long_factor: Vec<f32>,
    pub original_max_position_embeddings: usize,
    /// Multiplies cos and sin (transformers' `attention_scaling`).
    pub attention_factor: f32,
}

impl LongRope {
    /// transformers' default attention factor for a context stretched `factor` times beyond
    /// `original`: `√(1 + ln factor / ln original)`, or 1 when not stretched.
    pub fn default_attention_factor(factor: f64, original: usize) -> f32 {
        if factor <= 1.0 {
            1.0
        } else {
            (1.0 + factor.ln() / (original as f64).ln()).sqrt() as f32
        }
    }
}

/// Precomputed inverse frequencies of one model.
#[derive(Clone, Debug)]
pub struct Rope {
    inv_freq: Vec<f32>,
    pairing: RopePairing,
    /// LongRoPE's frequencies for sequences longer than the given length.
    long: Option<(Vec<f32>, usize)>,
    /// Multiplies cos and sin (LongRoPE's attention factor; 1 otherwise).
    attention_factor: f32,
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
        let bases: Vec<f32> = (0..half)
            .map(|i| theta.powf((2 * i) as f32 / head_dim as f32))
            .collect();
        let mut inv_freq: Vec<f32> = bases.iter().map(|b| 1.0 / b).collect();
        let (mut long, mut attention_factor) = (None, 1.0);
        match scaling {
            RopeScaling::None => {}
            RopeScaling::LongRope(l) => {
                // transformers: 1 / (factor · θ^(2i/d)), in f32.
                let divided = |factors: &[f32]| -> Vec<f32> {
                    bases
                        .iter()
                        .zip(factors)
                        .map(|(b, f)| 1.0 / (f * b))
                        .collect()
                };
                inv_freq = divided(&l.short_factor);
                long = Some((divided(&l.long_factor), l.original_max_position_embeddings));
                attention_factor = l.attention_factor;
            }
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
        Rope {
            inv_freq,
            pairing,
            long,
            attention_factor,
        }
    }

    /// cos/sin tables for `positions`, each taken as the last position of its sequence
    /// so far (what a token-by-token decode sees).
    pub fn tables(&self, positions: &[usize]) -> RopeTables {
        let lengths: Vec<usize> = positions.iter().map(|p| p + 1).collect();
        self.tables_in(positions, &lengths)
    }

    /// cos/sin tables for `positions`, where `lengths[t]` is the length of position `t`'s
    /// sequence at the end of this forward call: LongRoPE picks its frequencies by it.
    pub fn tables_in(&self, positions: &[usize], lengths: &[usize]) -> RopeTables {
        let mut tables = RopeTables::default();
        self.fill_tables(positions, lengths, &mut tables);
        tables
    }

    /// [`Rope::tables_in`] into `tables`, reusing its buffers.
    pub fn fill_tables(&self, positions: &[usize], lengths: &[usize], tables: &mut RopeTables) {
        let half = self.inv_freq.len();
        tables.half = half;
        let RopeTables { cos, sin, .. } = tables;
        cos.clear();
        sin.clear();
        cos.reserve(positions.len() * half);
        sin.reserve(positions.len() * half);
        let scale = self.attention_factor;
        for (&p, &len) in positions.iter().zip(lengths) {
            let freqs = match &self.long {
                Some((long, original)) if len > *original => long,
                _ => &self.inv_freq,
            };
            for &f in freqs {
                let angle = p as f32 * f;
                cos.push(angle.cos() * scale);
                sin.push(angle.sin() * scale);
            }
        }
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

    /// The inverse frequencies, after scaling (LongRoPE's short ones).
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

    #[test]
    fn longrope_picks_factors_by_sequence_length_and_scales_cos_sin() {
        let scaling = RopeScaling::LongRope(LongRope {
            short_factor: vec![1.0, 2.0],
            long_factor: vec![4.0, 8.0],
            original_max_position_embeddings: 8,
            attention_factor: LongRope::default_attention_factor(4.0, 32),
        });
        let plain = Rope::new(4, 100.0, &RopeScaling::None, RopePairing::Halves);
        let rope = Rope::new(4, 100.0, &scaling, RopePairing::Halves);
        let scale = 1.4f32.sqrt();
        assert!((rope.attention_factor - scale).abs() < 1e-7);
        // Position 5 of a sequence of 8 (not past the original context): the short factors;
        // of a sequence of 9: the long ones, for every position of the call.
        let short = rope.tables_in(&[5], &[8]);
        let long = rope.tables_in(&[5], &[9]);
        let f = plain.inv_freq();
        for (i, d) in [(0, 1.0f32), (1, 2.0)] {
            assert_eq!(short.cos[i], (5.0 * (1.0 / (d / f[i]))).cos() * scale);
        }
        for (i, d) in [(0, 4.0f32), (1, 8.0)] {
            let angle = 5.0 * (1.0 / (d * (1.0 / f[i])));
            assert!((long.cos[i] - angle.cos() * scale).abs() < 1e-6);
            assert!((long.sin[i] - angle.sin() * scale).abs() < 1e-6);
        }
        assert_ne!(short.cos, long.cos);
        // Decoding token by token, the choice follows the position.
        assert_eq!(rope.tables(&[7]).cos, rope.tables_in(&[7], &[8]).cos);
        assert_eq!(rope.tables(&[8]).cos, rope.tables_in(&[8], &[9]).cos);
    }
}
