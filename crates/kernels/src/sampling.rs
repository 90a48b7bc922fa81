//! Token sampling: penalties, temperature, top-k, top-p (nucleus), min-p, and a seeded RNG
//! so that a request with a seed is reproducible.
//!
//! The draw for the `i`-th generated token comes from its own RNG stream (seed, stream
//! `i`), not from a stream shared by the whole sequence: a sequence recomputed after
//! preemption, or sampled by another rank, draws exactly the same tokens.
//!
//! Order of operations (as vLLM and transformers apply them): repetition, presence and
//! frequency penalties on the raw logits; then greedy argmax when `temperature == 0`;
//! otherwise temperature, top-k, softmax, top-p, min-p, and one draw. Everything after the
//! penalties is [`cpu::sample_threshold`]'s rule, which the CUDA `sample_rows` kernel
//! computes to the bit: [`Sampler::draw`] gives what a row needs for either, so a sequence
//! without penalties samples the same token on the host and on a GPU.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::cpu::{self, RowDraw, SampleScratch, ThresholdParams};

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

/// Samples tokens for one sequence.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    seed: u64,
    scratch: SampleScratch,
}

impl Sampler {
    /// A sampler for `params`. Without a seed, `fallback_seed` (e.g. from the clock or OS,
    /// chosen by the caller: kernels read no clock) is used.
    pub fn new(params: SamplingParams, fallback_seed: u64) -> Sampler {
        let seed = params.seed.unwrap_or(fallback_seed);
        Sampler {
            params,
            seed,
            scratch: SampleScratch::default(),
        }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token from `logits` (modified in place by the penalties), given the
    /// prompt and the tokens generated so far.
    pub fn sample(&mut self, logits: &mut [f32], prompt: &[u32], generated: &[u32]) -> u32 {
        apply_penalties(&self.params, logits, prompt, generated);
        let draw = self.draw(generated.len());
        cpu::sample_threshold_in(logits, draw.params, draw.uniform, &mut self.scratch)
    }

    /// The rule's settings and uniform draw for the token after `generated` tokens: what
    /// [`Sampler::sample`] uses after the penalties, and what the device kernel takes.
    pub fn draw(&self, generated: usize) -> RowDraw {
        let p = &self.params;
        let params = ThresholdParams {
            temperature: p.temperature,
            top_k: u32::try_from(p.top_k).unwrap_or(u32::MAX),
            top_p: p.top_p,
            min_p: p.min_p,
        };
        let uniform = if params.is_greedy() {
            0.0
        } else {
            let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
            rng.set_stream(generated as u64);
            rng.random::<f32>()
        };
        RowDraw { params, uniform }
    }

    /// Whether penalties change the logits before the rule (repetition, presence,
    /// frequency). The device kernel applies none: such a sequence samples on the host.
    pub fn has_penalties(&self) -> bool {
        let p = &self.params;
        p.repetition_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0
    }

    /// [`Sampler::draw`] for a sampler without penalties; `None` where the host must sample.
    pub fn device_draw(&self, generated: usize) -> Option<RowDraw> {
        (!self.has_penalties()).then(|| self.draw(generated))
    }
}

/// The log-probability of `token` under `logits` (log-softmax, f64 sums), and the `top`
/// most likely tokens with theirs, most likely first (lower id first on ties).
pub fn logprobs(logits: &[f32], token: u32, top: usize) -> (f32, Vec<(u32, f32)>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    let log_z = f64::from(max) + sum.ln();
    let logprob = |l: f32| (f64::from(l) - log_z) as f32;
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(top + 1);
    if top > 0 {
        for (i, &l) in logits.iter().enumerate() {
            if best.len() == top && l <= best[top - 1].1 {
                continue;
            }
            let at = best.partition_point(|&(_, b)| b >= l);
            best.insert(at, (i as u32, l));
            best.truncate(top);
        }
    }
    let chosen = logits
        .get(token as usize)
        .map_or(f32::NEG_INFINITY, |&l| logprob(l));
    (
        chosen,
        best.into_iter().map(|(t, l)| (t, logprob(l))).collect(),
    )
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
    fn logprobs_are_a_log_softmax_with_the_top_tokens_first() {
        let logits = [1.0f32, 3.0, 2.0, 3.0];
        let (chosen, top) = logprobs(&logits, 2, 3);
        let z: f64 = logits.iter().map(|&l| f64::from(l).exp()).sum();
        assert!((f64::from(chosen) - (2.0 - z.ln())).abs() < 1e-6);
        let ids: Vec<u32> = top.iter().map(|t| t.0).collect();
        assert_eq!(ids, [1, 3, 2]);
        assert!((f64::from(top[0].1) - (3.0 - z.ln())).abs() < 1e-6);
        assert!(logprobs(&logits, 0, 0).1.is_empty());
    }

    #[test]
    fn each_draw_depends_only_on_the_seed_and_the_token_index() {
        let params = SamplingParams {
            temperature: 1.0,
            seed: Some(7),
            ..Default::default()
        };
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let mut a = Sampler::new(params.clone(), 0);
        let first: Vec<u32> = (0..20)
            .map(|i| a.sample(&mut logits.clone(), &[1], &vec![0; i]))
            .collect();
        // A fresh sampler asked for token 12 alone draws what the first drew for it.
        let mut b = Sampler::new(params, 0);
        assert_eq!(b.sample(&mut logits.clone(), &[1], &[0; 12]), first[12]);
    }

    #[test]
    fn the_device_draw_is_what_the_host_sampler_uses() {
        let params = SamplingParams {
            temperature: 0.8,
            top_k: 5,
            top_p: 0.9,
            min_p: 0.01,
            seed: Some(11),
            ..Default::default()
        };
        let logits: Vec<f32> = (0..40).map(|i| ((i * 7) % 13) as f32 * 0.4).collect();
        let mut s = Sampler::new(params.clone(), 0);
        for generated in 0..30 {
            let draw = s.device_draw(generated).expect("no penalties");
            assert_eq!(draw, s.draw(generated));
            assert!((0.0..1.0).contains(&draw.uniform));
            let want = cpu::sample_threshold(&logits, draw.params, draw.uniform);
            let got = s.sample(&mut logits.clone(), &[1], &vec![0; generated]);
            assert_eq!(got, want, "token {generated}");
        }
        // Greedy draws nothing; penalties keep a sequence on the host.
        let greedy = Sampler::new(SamplingParams::default(), 0);
        assert_eq!(greedy.draw(3).uniform, 0.0);
        assert!(greedy.draw(3).params.is_greedy());
        let penalized = Sampler::new(
            SamplingParams {
                presence_penalty: 0.5,
                ..params
            },
            0,
        );
        assert!(penalized.has_penalties() && penalized.device_draw(0).is_none());
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
        // Each token index draws from its own stream: vary the index.
        for i in 0..400 {
            seen[s.sample(&mut [10.0, 9.0, 0.0, 0.0], &[], &vec![0; i]) as usize] += 1;
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
