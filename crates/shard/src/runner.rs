//! One rank's step execution: the sequences this rank holds, their KV blocks, and the
//! batched forward pass and sampling a [`StepPlan`] asks for.
//!
//! Every rank of a group executes the same plans in the same order, so every rank makes
//! the same collective calls and the same block allocations. A step is: release `free`,
//! admit `new` (taking cached prefix blocks), then one forward pass over every prefill
//! chunk and decode token of the step. A sequence samples when its prompt is complete and
//! on every decode. Rank 0 samples; the sampled tokens (and whether each sequence
//! finished) reach the other ranks through one broadcast per step, so no rank waits for
//! the coordinator to learn a token. The runner reads no clock and does no I/O; the
//! worker thread drives it.
//!
//! With device sampling on ([`StepRunner::with_device_sampling`]), each sampling row asks
//! the pass for a token sampled where its logits are, with its sampler's settings and
//! draw (`row_request`); the pass answers with the token, or with the logits where it
//! cannot (the CPU, a group of more than one rank) and the runner samples those itself.
//! Both apply the sampler's one rule to the same draw, so the tokens are the same.

use std::collections::HashMap;

use tessera_comm::Collective;
use tessera_comm::proto::{
    Epoch, FinishReason, HeldSeq, NewSeq, SeqId, SeqToken, StepId, StepPlan, TokenLogprobs,
};
use tessera_kernels::sampling::{Sampler, logprobs};
use tessera_model::generate::FinishRule;
use tessera_model::kv_cache::SeqChunk;
use tessera_model::rows::{RowOutput, RowRequest};
use tessera_model::slice::{ModelSlice, SliceCache, SliceComm};
use tessera_topology::Rank;

use crate::blocks::{BlockAllocator, BlockId, ChainHash};
use crate::error::ShardError;

mod warmup;
pub use warmup::{FIRST_WARMUP_SEQ, WarmupRun, warmup_plans};

/// One sequence as this rank holds it.
#[derive(Debug)]
struct Seq {
    /// The request journal's id (empty when not journaled).
    request: String,
    /// Prompt, then every generated token.
    tokens: Vec<u32>,
    /// Tokens of the original prompt (the rest were generated).
    prompt_len: usize,
    /// Tokens to compute before the sequence samples for the first time in this group:
    /// the prompt plus any tokens generated before a preemption.
    prefill_len: usize,
    /// Positions whose K/V is in the cache.
    computed: usize,
    table: Vec<BlockId>,
    /// Chain hash of each full block, registered in the prefix cache.
    hashes: Vec<ChainHash>,
    max_tokens: u32,
    stop_token_ids: Vec<u32>,
    /// Rank 0 only.
    sampler: Option<Sampler>,
    top_logprobs: Option<u8>,
    finished: bool,
}

impl Seq {
    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    fn prefilled(&self) -> bool {
        self.computed >= self.prefill_len
    }
}

/// What one step produced on this rank.
#[derive(Debug, Default, PartialEq)]
pub struct StepOutput {
    /// Every token sampled in this step, in plan order (the same on every rank).
    pub tokens: Vec<SeqToken>,
    /// Prompt tokens of this step's new sequences found in the prefix cache.
    pub cached: Vec<(SeqId, u32)>,
}

/// One sequence's part of this step's forward pass.
struct Run {
    seq: SeqId,
    /// Positions `start..end` of its tokens.
    start: usize,
    end: usize,
    /// Whether it samples after this pass.
    samples: bool,
}

/// The sequences of one epoch on one rank.
#[derive(Debug)]
pub struct StepRunner {
    rank: Rank,
    epoch: Epoch,
    next_step: StepId,
    cache: SliceCache,
    blocks: BlockAllocator,
    seqs: HashMap<SeqId, Seq>,
    /// Ask the pass to sample where the logits are.
    device_sampling: bool,
}

impl StepRunner {
    /// A runner that samples on the host from every row's logits.
    pub fn new(rank: Rank, epoch: Epoch, cache: SliceCache) -> StepRunner {
        let blocks = BlockAllocator::new(cache.num_blocks(), cache.block_size());
        StepRunner {
            rank,
            epoch,
            next_step: StepId(0),
            cache,
            blocks,
            seqs: HashMap::new(),
            device_sampling: false,
        }
    }

    /// Whether sampling rows ask the pass for a token sampled where the logits are (a GPU
    /// of a one-rank group does; elsewhere the logits come back all the same). Kept when
    /// the runner carries into a new epoch.
    pub fn with_device_sampling(mut self, on: bool) -> StepRunner {
        self.device_sampling = on;
        self
    }

    pub fn epoch(&self) -> Epoch {
        self.epoch
    }

    /// The journaled sequences a new coordinator leader could carry on with: prompt
    /// complete, not finished, so their cache holds every position but the last token.
    pub fn journaled_held(&self) -> Vec<HeldSeq> {
        let mut held: Vec<HeldSeq> = self
            .seqs
            .iter()
            .filter(|(_, s)| !s.request.is_empty() && !s.finished && s.prefilled())
            .filter(|(_, s)| s.tokens.len() == s.computed + 1)
            .map(|(&seq, s)| HeldSeq {
                seq,
                request: s.request.clone(),
                prompt_len: s.prompt_len as u32,
                generated: s.tokens[s.prompt_len..].to_vec(),
                computed: s.computed as u32,
            })
            .collect();
        held.sort_by_key(|h| h.seq);
        held
    }

    /// This runner's cache and the sequences of `keep` (those it holds), for `epoch`;
    /// every other sequence is freed. Returns the sequences carried.
    pub fn carry(mut self, epoch: Epoch, keep: &[SeqId]) -> (StepRunner, Vec<SeqId>) {
        let keep: std::collections::HashSet<SeqId> = keep.iter().copied().collect();
        let dropped: Vec<SeqId> = self
            .seqs
            .keys()
            .filter(|id| !keep.contains(id))
            .copied()
            .collect();
        for id in dropped {
            if let Some(seq) = self.seqs.remove(&id) {
                self.blocks.release(&seq.table);
            }
        }
        let mut kept: Vec<SeqId> = self.seqs.keys().copied().collect();
        kept.sort();
        self.epoch = epoch;
        self.next_step = StepId(0);
        (self, kept)
    }

    /// KV blocks of the cache, in all.
    pub fn num_blocks(&self) -> usize {
        self.blocks.num_blocks()
    }

    /// Positions per KV block.
    pub fn block_size(&self) -> usize {
        self.blocks.block_size()
    }

    /// Blocks a new sequence could still get (free, or cached and unreferenced).
    pub fn free_blocks(&self) -> usize {
        self.blocks.available()
    }

    /// Executes `plan`: frees, admits, runs one batched pass, shares rank 0's samples.
    pub fn step(
        &mut self,
        model: &ModelSlice,
        plan: &StepPlan,
        comm: &mut SliceComm<'_>,
    ) -> Result<StepOutput, ShardError> {
        let bad = |message: String| ShardError::BadPlan {
            step: plan.step,
            message,
        };
        if plan.step != self.next_step {
            return Err(bad(format!(
                "expected step {} of epoch {}",
                self.next_step, self.epoch
            )));
        }
        self.next_step = self.next_step.next();
        for id in &plan.free {
            if let Some(seq) = self.seqs.remove(id) {
                self.blocks.release(&seq.table);
            }
        }
        let mut out = StepOutput::default();
        for new in &plan.new {
            let cached = self.admit(new).map_err(bad)?;
            if cached > 0 {
                out.cached.push((new.seq, cached as u32));
            }
        }
        let runs = self.plan_runs(plan).map_err(bad)?;
        if runs.is_empty() {
            return Ok(out);
        }
        self.reserve(&runs).map_err(bad)?;
        let requests: Vec<RowRequest> = runs
            .iter()
            .filter(|r| r.samples)
            .map(|r| row_request(&self.seqs[&r.seq], self.device_sampling))
            .collect();
        let rows = self.forward(model, &runs, &requests, comm)?;
        let context = model.config().max_position_embeddings;
        let mut sampled = Vec::with_capacity(rows.len());
        let samplers = runs.iter().filter(|r| r.samples);
        for (run, row) in samplers.zip(rows) {
            let seq = self
                .seqs
                .get_mut(&run.seq)
                .expect("runs name held sequences");
            sampled.push(sample(run.seq, seq, row, context));
        }
        for run in &runs {
            let seq = self
                .seqs
                .get_mut(&run.seq)
                .expect("runs name held sequences");
            seq.computed = run.end;
            register_full_blocks(&mut self.blocks, seq);
        }
        for t in share_samples(sampled, self.rank, comm.host())? {
            let seq = self.seqs.get_mut(&t.seq).expect("sampled sequences exist");
            seq.tokens.push(t.token);
            seq.finished = t.finish.is_some();
            out.tokens.push(t);
        }
        Ok(out)
    }

    /// Admits a new sequence; returns how many of its tokens the prefix cache held.
    fn admit(&mut self, new: &NewSeq) -> Result<usize, String> {
        if self.seqs.contains_key(&new.seq) {
            return Err(format!("sequence {} is already running", new.seq));
        }
        if new.prompt.is_empty() || new.max_tokens == 0 {
            return Err(format!(
                "sequence {} has an empty prompt or max_tokens = 0",
                new.seq
            ));
        }
        let mut tokens = new.prompt.clone();
        tokens.extend_from_slice(&new.generated);
        // At least one token is computed, for the logits the first sample needs.
        let bs = self.blocks.block_size();
        let reusable = (tokens.len() - 1) / bs * bs;
        let (table, hashes) = self.blocks.acquire_prefix(&tokens[..reusable]);
        let computed = table.len() * bs;
        let sampler =
            (self.rank == Rank(0)).then(|| Sampler::new(new.sampling.params(), new.sampling.seed));
        self.seqs.insert(
            new.seq,
            Seq {
                request: new.request.clone(),
                prefill_len: tokens.len(),
                prompt_len: new.prompt.len(),
                tokens,
                computed,
                table,
                hashes,
                max_tokens: new.max_tokens,
                stop_token_ids: new.stop_token_ids.clone(),
                sampler,
                top_logprobs: new.sampling.logprobs,
                finished: false,
            },
        );
        Ok(computed)
    }

    /// What each sequence computes in this step. The coordinator plans ahead of the
    /// results, so a chunk for a prompt already complete (the prefix cache held more than
    /// it knew) and a decode of a finished sequence are skipped, on every rank alike.
    fn plan_runs(&self, plan: &StepPlan) -> Result<Vec<Run>, String> {
        let mut runs = Vec::with_capacity(plan.prefill.len() + plan.decode.len());
        for chunk in &plan.prefill {
            let seq = self.held(chunk.seq, "prefill")?;
            if seq.prefilled() || chunk.tokens == 0 {
                continue;
            }
            let end = (seq.computed + chunk.tokens as usize).min(seq.prefill_len);
            runs.push(Run {
                seq: chunk.seq,
                start: seq.computed,
                end,
                samples: end == seq.prefill_len,
            });
        }
        for &id in &plan.decode {
            let seq = self.held(id, "decode")?;
            if seq.finished || !seq.prefilled() {
                continue;
            }
            if seq.tokens.len() != seq.computed + 1 {
                return Err(format!("decode of sequence {id} with no new token"));
            }
            runs.push(Run {
                seq: id,
                start: seq.computed,
                end: seq.computed + 1,
                samples: true,
            });
        }
        let mut seen = std::collections::HashSet::with_capacity(runs.len());
        if let Some(dup) = runs.iter().find(|r| !seen.insert(r.seq)) {
            return Err(format!("sequence {} is planned twice in one step", dup.seq));
        }
        Ok(runs)
    }

    fn held(&self, id: SeqId, what: &str) -> Result<&Seq, String> {
        self.seqs
            .get(&id)
            .ok_or_else(|| format!("{what} of unknown sequence {id}"))
    }

    /// Grows each running sequence's block table to hold its positions after this step.
    fn reserve(&mut self, runs: &[Run]) -> Result<(), String> {
        let bs = self.blocks.block_size();
        for run in runs {
            let seq = self
                .seqs
                .get_mut(&run.seq)
                .expect("runs name held sequences");
            while seq.table.len() < run.end.div_ceil(bs) {
                let block = self.blocks.allocate().ok_or_else(|| {
                    format!(
                        "out of KV blocks ({} in all) growing sequence {} to {} positions",
                        self.blocks.num_blocks(),
                        run.seq,
                        run.end
                    )
                })?;
                seq.table.push(block);
            }
        }
        Ok(())
    }

    /// One batched forward pass; what `requests` ask for every run that samples, in run
    /// order.
    fn forward(
        &mut self,
        model: &ModelSlice,
        runs: &[Run],
        requests: &[RowRequest],
        comm: &mut SliceComm<'_>,
    ) -> Result<Vec<RowOutput>, ShardError> {
        let chunks: Vec<SeqChunk<'_>> = runs
            .iter()
            .map(|run| {
                let seq = &self.seqs[&run.seq];
                SeqChunk {
                    tokens: &seq.tokens[run.start..run.end],
                    start: run.start,
                    block_table: BlockId::as_u32s(&seq.table),
                    logits: run.samples,
                }
            })
            .collect();
        Ok(model.forward_rows(&chunks, &mut self.cache, comm, requests)?)
    }
}

/// What `seq`'s sampling row asks of the pass: with device sampling on, its sampler's
/// settings and draw for the next token (the logits too for logprobs), unless penalties
/// keep it on the host; otherwise, and on ranks that do not sample, its logits.
fn row_request(seq: &Seq, device_sampling: bool) -> RowRequest {
    let draw = match &seq.sampler {
        Some(sampler) if device_sampling => sampler.device_draw(seq.generated()),
        _ => None,
    };
    RowRequest {
        draw,
        logits: draw.is_none() || seq.top_logprobs.is_some(),
    }
}

/// Registers every block of `seq` that its computed positions have filled.
fn register_full_blocks(blocks: &mut BlockAllocator, seq: &mut Seq) {
    let bs = blocks.block_size();
    while seq.hashes.len() < seq.computed / bs {
        let i = seq.hashes.len();
        let parent = seq.hashes.last().copied().unwrap_or(0);
        let hash = blocks.register(seq.table[i], parent, &seq.tokens[i * bs..(i + 1) * bs]);
        seq.hashes.push(hash);
    }
}

/// Rank 0 takes the next token (sampled on the device, or here from the row's logits)
/// and decides whether the sequence ends with it; other ranks return a placeholder that
/// [`share_samples`] overwrites.
fn sample(id: SeqId, seq: &mut Seq, row: RowOutput, context: usize) -> SeqToken {
    let Some(sampler) = seq.sampler.as_mut() else {
        return SeqToken {
            seq: id,
            token: 0,
            finish: None,
            logprobs: None,
        };
    };
    let (token, raw) = match row {
        RowOutput::Token { token, logits } => (token, logits),
        RowOutput::Logits(mut logits) => {
            // Logprobs are of the raw logits, before the penalties.
            let raw = seq.top_logprobs.map(|_| logits.clone());
            let (prompt, generated) = seq.tokens.split_at(seq.prompt_len);
            (sampler.sample(&mut logits, prompt, generated), raw)
        }
    };
    let rule = FinishRule {
        stop_tokens: &seq.stop_token_ids,
        max_tokens: seq.max_tokens as usize,
        context_tokens: context,
    };
    // `token` is not pushed yet: it is one more generated token and one more in all.
    let finish = rule.check(token, seq.generated() + 1, seq.tokens.len() + 1);
    let logprobs = match (seq.top_logprobs, raw) {
        (Some(k), Some(raw)) => {
            let (logprob, top) = logprobs(&raw, token, usize::from(k));
            Some(TokenLogprobs { logprob, top })
        }
        _ => None,
    };
    SeqToken {
        seq: id,
        token,
        finish,
        logprobs,
    }
}

/// Broadcasts rank 0's `(token, finish)` pairs to every rank, 8 bytes per sequence.
/// Logprobs stay on rank 0, the only rank that reports them.
fn share_samples(
    mut sampled: Vec<SeqToken>,
    rank: Rank,
    comm: &mut dyn Collective,
) -> Result<Vec<SeqToken>, ShardError> {
    if sampled.is_empty() || comm.world_size() == 1 {
        return Ok(sampled);
    }
    let mut buf = Vec::with_capacity(sampled.len() * 8);
    for t in &sampled {
        buf.extend_from_slice(&t.token.to_le_bytes());
        let code: u32 = match t.finish {
            None => 0,
            Some(FinishReason::Stop) => 1,
            Some(FinishReason::Length) => 2,
        };
        buf.extend_from_slice(&code.to_le_bytes());
    }
    comm.broadcast(&mut buf, Rank(0))?;
    if rank == Rank(0) {
        return Ok(sampled);
    }
    let word = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    for (t, b) in sampled.iter_mut().zip(buf.chunks_exact(8)) {
        t.token = word(&b[..4]);
        t.finish = match word(&b[4..]) {
            0 => None,
            1 => Some(FinishReason::Stop),
            _ => Some(FinishReason::Length),
        };
    }
    Ok(sampled)
}

#[cfg(test)]
mod tests;
