//! One-sequence generation on one process: prefill the prompt, then decode token by token
//! with a [`Sampler`], stopping at a stop token or the token limit. That stopping rule,
//! [`FinishRule`], is also the one the shard applies to served requests.
//!
//! This drives `tessera generate` ([`generate`], tp = 1). [`generate_in_group`] runs one
//! rank of a tensor-parallel group inside one process (every rank on its own thread, with
//! the same request): the logits, and so the sampled tokens, are the same on every rank.
//! The distributed path runs the same forward pass per rank under the shard's step loop.

use std::time::{Duration, Instant};

use tessera_comm::{Collective, Solo};
use tessera_kernels::sampling::{Sampler, SamplingParams};

use crate::error::ModelError;
use crate::kv_cache::{DEFAULT_BLOCK_SIZE, KvCache, SeqCache};
use crate::llama::Llama;

/// Prompt tokens per forward pass during prefill: bounds activation memory.
const PREFILL_CHUNK_TOKENS: usize = 256;

/// What to generate.
#[derive(Clone, Debug)]
pub struct GenerationRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Generation ends after emitting one of these (the token is included in the output).
    pub stop_tokens: Vec<u32>,
}

/// Why generation ended: the same reason a shard reports on the wire.
pub use tessera_comm::proto::FinishReason;

/// When a sequence stops: the one rule that [`generate_in_group`] and the shard's step loop
/// both apply to every token they sample, so `tessera generate` and a served request end
/// on the same token.
#[derive(Clone, Copy, Debug)]
pub struct FinishRule<'a> {
    /// Tokens that end the sequence (the token itself is kept in the output).
    pub stop_tokens: &'a [u32],
    /// Tokens the request may generate.
    pub max_tokens: usize,
    /// The model's context: a sequence this long has no position left for another token.
    pub context_tokens: usize,
}

impl FinishRule<'_> {
    /// Why the sequence ends with `token`, just sampled, which makes it `generated_tokens`
    /// generated and `total_tokens` long (prompt included); `None` when it goes on. A stop
    /// token is reported as [`FinishReason::Stop`] even when it is also the last one allowed.
    pub fn check(
        &self,
        token: u32,
        generated_tokens: usize,
        total_tokens: usize,
    ) -> Option<FinishReason> {
        if self.stop_tokens.contains(&token) {
            Some(FinishReason::Stop)
        } else if generated_tokens >= self.max_tokens || total_tokens >= self.context_tokens {
            Some(FinishReason::Length)
        } else {
            None
        }
    }
}

/// The result of one generation.
#[derive(Clone, Debug)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub finish_reason: FinishReason,
    /// Logits at the last prompt position (before any sampling penalty).
    pub prompt_logits: Vec<f32>,
    pub prefill_time: Duration,
    pub decode_time: Duration,
}

impl Generation {
    /// Prompt tokens per second of prefill.
    pub fn prefill_tokens_per_s(&self, prompt_tokens: usize) -> f64 {
        prompt_tokens as f64 / self.prefill_time.as_secs_f64().max(1e-9)
    }

    /// Generated tokens per second after the first (the first comes from prefill).
    pub fn decode_tokens_per_s(&self) -> f64 {
        self.tokens.len().saturating_sub(1) as f64 / self.decode_time.as_secs_f64().max(1e-9)
    }
}

/// Generates for `request` with a whole model (tp = 1); `on_token` sees each token as it
/// is chosen.
pub fn generate(
    model: &Llama,
    request: &GenerationRequest,
    fallback_seed: u64,
    on_token: impl FnMut(u32),
) -> Result<Generation, ModelError> {
    generate_in_group(
        model,
        request,
        fallback_seed,
        &mut Solo::default(),
        on_token,
    )
}

/// [`generate`] for one rank of a tensor-parallel group: `model` is the rank's slice and
/// `comm` the group's collective. Every rank must call it with the same request and seed.
pub fn generate_in_group(
    model: &Llama,
    request: &GenerationRequest,
    fallback_seed: u64,
    comm: &mut dyn Collective,
    mut on_token: impl FnMut(u32),
) -> Result<Generation, ModelError> {
    let c = model.config();
    if request.prompt.is_empty() {
        return Err(ModelError::InvalidRequest {
            message: "the prompt has no tokens".into(),
        });
    }
    let total = request.prompt.len() + request.max_tokens;
    if total > c.max_position_embeddings {
        return Err(ModelError::InvalidRequest {
            message: format!(
                "prompt ({} tokens) + max_tokens ({}) exceeds the model's context of {} tokens",
                request.prompt.len(),
                request.max_tokens,
                c.max_position_embeddings
            ),
        });
    }
    let layout = model.kv_layout(DEFAULT_BLOCK_SIZE);
    let mut cache = KvCache::new(
        layout,
        c.num_hidden_layers,
        total.div_ceil(DEFAULT_BLOCK_SIZE),
    );
    let mut seq = SeqCache::default();
    let mut sampler = Sampler::new(request.sampling.clone(), fallback_seed);

    let started = Instant::now();
    let mut logits = Vec::new();
    for chunk in request.prompt.chunks(PREFILL_CHUNK_TOKENS) {
        logits = model.forward(chunk, &mut seq, &mut cache, comm)?;
    }
    let prompt_logits = logits.clone();
    let rule = FinishRule {
        stop_tokens: &request.stop_tokens,
        max_tokens: request.max_tokens,
        context_tokens: c.max_position_embeddings,
    };
    let mut tokens = Vec::with_capacity(request.max_tokens);
    // What a request for no tokens ends with; any other ends through `rule`.
    let mut finish_reason = FinishReason::Length;
    let mut prefill_time = Duration::ZERO;
    while tokens.len() < request.max_tokens {
        let token = sampler.sample(&mut logits, &request.prompt, &tokens);
        if tokens.is_empty() {
            prefill_time = started.elapsed();
        }
        tokens.push(token);
        on_token(token);
        let total_tokens = request.prompt.len() + tokens.len();
        if let Some(reason) = rule.check(token, tokens.len(), total_tokens) {
            finish_reason = reason;
            break;
        }
        logits = model.forward(&[token], &mut seq, &mut cache, comm)?;
    }
    let elapsed = started.elapsed();
    Ok(Generation {
        tokens,
        finish_reason,
        prompt_logits,
        prefill_time,
        decode_time: elapsed.saturating_sub(prefill_time),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const RULE: FinishRule<'static> = FinishRule {
        stop_tokens: &[2, 7],
        max_tokens: 4,
        context_tokens: 10,
    };

    #[test]
    fn a_stop_token_ends_the_sequence_even_as_its_last_allowed_token() {
        assert_eq!(RULE.check(7, 1, 3), Some(FinishReason::Stop));
        assert_eq!(RULE.check(2, 4, 10), Some(FinishReason::Stop));
    }

    #[test]
    fn the_token_limit_or_a_full_context_ends_it_by_length() {
        assert_eq!(RULE.check(5, 3, 9), None);
        assert_eq!(RULE.check(5, 4, 6), Some(FinishReason::Length));
        assert_eq!(RULE.check(5, 1, 10), Some(FinishReason::Length));
    }
}
