//! Token sampling: penalties, temperature, top-k, top-p (nucleus), min-p, and a seeded RNG
//! so that a request with a seed is reproducible.
//!
//! Order of operations (as vLLM and transformers apply them): repetition, presence and
//! frequency penalties on the raw logits; then greedy argmax when `temperature == 0`;
//! otherwise temperature, top-k, softmax, top-p, min-p, and one draw.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Sampling settings of one sequence. The defaults are greedy decoding.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means no limit.
    pub top_k: usize,
    /// 1 means no limit.
    pub top_p: f32,
    /// 0 means no limit: tokens with p < min_p · p_max are dropped.
    pub min_p: f32,
    /// 1 means none. > 1 discourages tokens of the prompt and output (CTRL-style).
    pub repetition_penalty: f32,
    /// Subtracted once from every token already generated.
    pub presence_penalty: f32,
    /// Subtracted per occurrence in the generated tokens.
    pub frequency_penalty: f32,
    /// `None` draws a seed from the OS.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
        }
    }
}

/// Samples tokens for one sequence; owns its RNG stream.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    candidates: Vec<(u32, f32)>,
}

impl Sampler {
    /// A sampler for `params`. Without a seed, `fallback_seed` (e.g. from the clock or OS,
    /// chosen by the caller: kernels read no clock) is used.
    pub fn new(params: SamplingParams, fallback_seed: u64) -> Sampler {
        let seed = params.seed.unwrap_or(fallback_seed);
        Sampler {
            params,
            rng: ChaCha8Rng::seed_from_u64(seed),
            candidates: Vec::new(),
        }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token from `logits` (modified in place by the penalties), given the
    /// prompt and the tokens generated so far.
    pub fn sample(&mut self, logits: &mut [f32], prompt: &[u32], generated: &[u32]) -> u32 {
        apply_penalties(&self.params, logits, prompt, generated);
        if self.params.temperature <= 0.0 {
            return argmax(logits);
        }
        let p = &self.params;
        let c = &mut self.candidates;
        c.clear();
        c.extend(
            logits
                .iter()
                .enumerate()
                .map(|(i, &l)| (i as u32, l / p.temperature)),
        );
        c.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if p.top_k > 0 && p.top_k < c.len() {
            c.truncate(p.top_k);
        }
        let max = c[0].1;
        let mut sum = 0.0;
        for e in c.iter_mut() {
            e.1 = (e.1 - max).exp();
            sum += e.1;
        }
        for e in c.iter_mut() {
            e.1 /= sum;
        }
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let keep = c
                .iter()
                .position(|e| {
                    acc += e.1;
                    acc >= p.top_p
                })
                .map_or(c.len(), |i| i + 1);
            c.truncate(keep);
        }
        if p.min_p > 0.0 {
            let floor = p.min_p * c[0].1;
            c.retain(|e| e.1 >= floor);
        }
        let total: f32 = c.iter().map(|e| e.1).sum();
        let mut draw = self.rng.random::<f32>() * total;
        for e in c.iter() {
            draw -= e.1;
            if draw <= 0.0 {
                return e.0;
            }
        }
        c[c.len() - 1].0
    }
}

/// Index of the largest logit; the first one on ties (as `torch.argmax`).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

fn apply_penalties(p: &SamplingParams, logits: &mut [f32], prompt: &[u32], generated: &[u32]) {
    if p.repetition_penalty != 1.0 {
        let mut seen = vec![false; logits.len()];
        for &t in prompt.iter().chain(generated) {
            if let Some(s) = seen.get_mut(t as usize) {
                *s = true;
            }
        }
        for (l, s) in logits.iter_mut().zip(seen) {
            if s {
                *l = if *l > 0.0 {
                    *l / p.repetition_penalty
                } else {
                    *l * p.repetition_penalty
                };
            }
        }
    }
    if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
        let mut counts = vec![0u32; logits.len()];
        for &t in generated {
            if let Some(c) = counts.get_mut(t as usize) {
                *c += 1;
            }
        }
        for (l, c) in logits.iter_mut().zip(counts) {
            if c > 0 {
                *l -= p.presence_penalty + p.frequency_penalty * c as f32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampler(params: SamplingParams) -> Sampler {
        Sampler::new(params, 7)
    }

    #[test]
    fn greedy_takes_first_maximum() {
        let mut s = sampler(SamplingParams::default());
        assert_eq!(s.sample(&mut [0.1, 3.0, -1.0, 3.0], &[], &[]), 1);
    }

    #[test]
    fn same_seed_same_tokens_and_different_seed_differs() {
        let params = SamplingParams {
            temperature: 1.0,
            seed: Some(42),
            ..Default::default()
        };
        let logits = vec![0.0f32; 1000];
        let draw = |params: SamplingParams| {
            let mut s = sampler(params);
            (0..20)
                .map(|_| s.sample(&mut logits.clone(), &[], &[]))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(params.clone()), draw(params.clone()));
        assert_ne!(
            draw(params.clone()),
            draw(SamplingParams {
                seed: Some(43),
                ..params
            })
        );
    }

    #[test]
    fn top_k_one_is_greedy_and_top_p_keeps_the_nucleus() {
        let mut s = sampler(SamplingParams {
            temperature: 1.0,
            top_k: 1,
            ..Default::default()
        });
        for _ in 0..20 {
            assert_eq!(s.sample(&mut [1.0, 2.0, 0.5], &[], &[]), 1);
        }
        // p = softmax([10, 9, 0, 0]) ≈ [0.73, 0.27, ~0, ~0]: top_p 0.9 keeps tokens 0 and 1.
        let mut s = sampler(SamplingParams {
            temperature: 1.0,
            top_p: 0.9,
            ..Default::default()
        });
        let mut seen = [0; 4];
        for _ in 0..400 {
            seen[s.sample(&mut [10.0, 9.0, 0.0, 0.0], &[], &[]) as usize] += 1;
        }
        assert!(
            seen[0] > 0 && seen[1] > 0 && seen[2] == 0 && seen[3] == 0,
            "{seen:?}"
        );
    }

    #[test]
    fn min_p_drops_unlikely_tokens() {
        let mut s = sampler(SamplingParams {
            temperature: 1.0,
            min_p: 0.5,
            ..Default::default()
        });
        for _ in 0..200 {
            // p ≈ [0.67, 0.24, 0.09]: only token 0 is above 0.5 · 0.67.
            assert_eq!(s.sample(&mut [2.0, 1.0, 0.0], &[], &[]), 0);
        }
    }

    #[test]
    fn penalties_change_the_greedy_choice() {
        let mut s = sampler(SamplingParams {
            repetition_penalty: 2.0,
            ..Default::default()
        });
        // 3.0 / 2 = 1.5 < 2.0: the repeated token loses.
        assert_eq!(s.sample(&mut [3.0, 2.0], &[0], &[]), 1);
        let mut s = sampler(SamplingParams {
            presence_penalty: 0.5,
            frequency_penalty: 0.5,
            ..Default::default()
        });
        // Token 0 seen twice: 3.0 − 0.5 − 1.0 = 1.5 < 2.0.
        assert_eq!(s.sample(&mut [3.0, 2.0], &[], &[0, 0]), 1);
        // Presence and frequency look at generated tokens only.
        assert_eq!(s.sample(&mut [3.0, 2.0], &[0, 0], &[]), 0);
    }
}
