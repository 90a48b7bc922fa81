//! One rank's step execution: the sequences this rank holds, their KV blocks, and the
//! forward passes and sampling a [`StepPlan`] asks for.
//!
//! Every rank of a group executes the same plans in the same order, so every rank makes
//! the same collective calls. Rank 0 samples; the sampled tokens (and whether each
//! sequence finished) reach the other ranks through one broadcast per step, so no rank
//! waits for the coordinator to learn a token. The engine reads no clock and does no I/O;
//! the worker thread drives it.

use std::collections::HashMap;

use tessera_comm::Collective;
use tessera_comm::proto::{FinishReason, NewSeq, Sampling, SeqId, SeqToken, StepPlan};
use tessera_kernels::sampling::{Sampler, SamplingParams};
use tessera_model::kv_cache::{KvCache, SeqCache};
use tessera_model::llama::Llama;
use tessera_topology::Rank;

use crate::error::ShardError;

/// Prompt tokens per forward pass during prefill: bounds activation memory.
const PREFILL_CHUNK_TOKENS: usize = 256;

/// One sequence as this rank holds it.
#[derive(Debug)]
struct Seq {
    cache: SeqCache,
    prompt: Vec<u32>,
    generated: Vec<u32>,
    max_tokens: u32,
    stop_token_ids: Vec<u32>,
    /// Rank 0 only.
    sampler: Option<Sampler>,
    finished: bool,
}

/// What one step produced on this rank.
#[derive(Debug, Default, PartialEq)]
pub struct StepOutput {
    /// Every token sampled in this step, in plan order (the same on every rank).
    pub tokens: Vec<SeqToken>,
}

/// The sequences of one epoch on one rank.
#[derive(Debug)]
pub struct Engine {
    rank: Rank,
    epoch: u64,
    next_step: u64,
    cache: KvCache,
    seqs: HashMap<SeqId, Seq>,
}

impl Engine {
    pub fn new(rank: Rank, epoch: u64, cache: KvCache) -> Engine {
        Engine {
            rank,
            epoch,
            next_step: 0,
            cache,
            seqs: HashMap::new(),
        }
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    pub fn free_blocks(&self) -> usize {
        self.cache.free_blocks()
    }

    /// Executes `plan`: frees, prefills, decodes, then shares rank 0's samples.
    pub fn step(
        &mut self,
        model: &Llama,
        plan: &StepPlan,
        comm: &mut dyn Collective,
    ) -> Result<StepOutput, ShardError> {
        if plan.step != self.next_step {
            return Err(ShardError::BadPlan {
                step: plan.step,
                message: format!("expected step {} of epoch {}", self.next_step, self.epoch),
            });
        }
        self.next_step += 1;
        for id in &plan.free {
            if let Some(mut seq) = self.seqs.remove(id) {
                self.cache.release(&mut seq.cache);
            }
        }
        let mut sampled: Vec<(SeqId, u32, Option<FinishReason>)> = Vec::new();
        for new in &plan.new {
            self.admit(plan.step, new)?;
        }
        for chunk in &plan.prefill {
            let seq = self
                .seqs
                .get_mut(&chunk.seq)
                .ok_or_else(|| ShardError::BadPlan {
                    step: plan.step,
                    message: format!("prefill of unknown sequence {}", chunk.seq),
                })?;
            let mut logits = Vec::new();
            for part in seq.prompt.chunks(PREFILL_CHUNK_TOKENS) {
                logits = model.forward(part, &mut seq.cache, &mut self.cache, comm)?;
            }
            sampled.push(sample(chunk.seq, seq, &mut logits, model));
        }
        for id in &plan.decode {
            let seq = self.seqs.get_mut(id).ok_or_else(|| ShardError::BadPlan {
                step: plan.step,
                message: format!("decode of unknown sequence {id}"),
            })?;
            // The coordinator plans ahead of the results; a sequence that finished in an
            // earlier step is skipped on every rank alike.
            if seq.finished {
                continue;
            }
            let last = *seq.generated.last().ok_or_else(|| ShardError::BadPlan {
                step: plan.step,
                message: format!("decode of sequence {id} before its prefill"),
            })?;
            let mut logits = model.forward(&[last], &mut seq.cache, &mut self.cache, comm)?;
            sampled.push(sample(*id, seq, &mut logits, model));
        }
        let shared = share_samples(&sampled, self.rank, comm)?;
        let mut out = StepOutput::default();
        for (id, token, finish) in shared {
            let seq = self.seqs.get_mut(&id).expect("sampled sequences exist");
            seq.generated.push(token);
            seq.finished = finish.is_some();
            out.tokens.push(SeqToken {
                seq: id,
                token,
                finish,
                logprobs: None,
            });
        }
        Ok(out)
    }

    fn admit(&mut self, step: u64, new: &NewSeq) -> Result<(), ShardError> {
        let bad = |message: String| ShardError::BadPlan { step, message };
        if self.seqs.contains_key(&new.seq) {
            return Err(bad(format!("sequence {} is already running", new.seq)));
        }
        if new.prompt.is_empty() || new.max_tokens == 0 {
            return Err(bad(format!(
                "sequence {} has an empty prompt or max_tokens = 0",
                new.seq
            )));
        }
        let sampler = (self.rank == Rank(0))
            .then(|| Sampler::new(sampling_params(&new.sampling), new.sampling.seed));
        self.seqs.insert(
            new.seq,
            Seq {
                cache: SeqCache::default(),
                prompt: new.prompt.clone(),
                generated: Vec::new(),
                max_tokens: new.max_tokens,
                stop_token_ids: new.stop_token_ids.clone(),
                sampler,
                finished: false,
            },
        );
        Ok(())
    }
}

/// Rank 0 picks the next token and decides whether the sequence ends with it; other
/// ranks return a placeholder that [`share_samples`] overwrites.
fn sample(
    id: SeqId,
    seq: &mut Seq,
    logits: &mut [f32],
    model: &Llama,
) -> (SeqId, u32, Option<FinishReason>) {
    let Some(sampler) = seq.sampler.as_mut() else {
        return (id, 0, None);
    };
    let token = sampler.sample(logits, &seq.prompt, &seq.generated);
    let produced = seq.generated.len() + 1;
    let context = model.config().max_position_embeddings;
    let finish = if seq.stop_token_ids.contains(&token) {
        Some(FinishReason::Stop)
    } else if produced >= seq.max_tokens as usize || seq.cache.len + 1 >= context {
        Some(FinishReason::Length)
    } else {
        None
    };
    (id, token, finish)
}

/// Broadcasts rank 0's `(token, finish)` pairs to every rank, 8 bytes per sequence.
fn share_samples(
    sampled: &[(SeqId, u32, Option<FinishReason>)],
    rank: Rank,
    comm: &mut dyn Collective,
) -> Result<Vec<(SeqId, u32, Option<FinishReason>)>, ShardError> {
    if sampled.is_empty() || comm.world_size() == 1 {
        return Ok(sampled.to_vec());
    }
    let mut buf = Vec::with_capacity(sampled.len() * 8);
    for (_, token, finish) in sampled {
        buf.extend_from_slice(&token.to_le_bytes());
        let code: u32 = match finish {
            None => 0,
            Some(FinishReason::Stop) => 1,
            Some(FinishReason::Length) => 2,
        };
        buf.extend_from_slice(&code.to_le_bytes());
    }
    comm.broadcast(&mut buf, Rank(0))?;
    if rank == Rank(0) {
        return Ok(sampled.to_vec());
    }
    let word = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    Ok(sampled
        .iter()
        .zip(buf.chunks_exact(8))
        .map(|((id, _, _), b)| {
            let finish = match word(&b[4..]) {
                0 => None,
                1 => Some(FinishReason::Stop),
                _ => Some(FinishReason::Length),
            };
            (*id, word(&b[..4]), finish)
        })
        .collect())
}

/// The kernel's sampling settings for the wire's.
pub fn sampling_params(s: &Sampling) -> SamplingParams {
    SamplingParams {
        temperature: s.temperature,
        top_k: s.top_k as usize,
        top_p: s.top_p,
        min_p: s.min_p,
        repetition_penalty: s.repetition_penalty,
        presence_penalty: s.presence_penalty,
        frequency_penalty: s.frequency_penalty,
        seed: Some(s.seed),
    }
}
