//! Warmup: the largest steps the coordinator will plan, run once before a rank first
//! says `Ready`, on sequences of its own that are forgotten afterwards.
//!
//! The steps, on sequences numbered from [`FIRST_WARMUP_SEQ`] down:
//! 1. one prefill of the step budget (`prefill_tokens` prompt tokens of one sequence);
//! 2. the other sequences' one-token prompts, with the first sequence's decode: as many
//!    rows as the largest decode;
//! 3. decodes of the largest batch (`decode_seqs`) and, where the pass captures a decode
//!    graph per batch size (a GPU), of every smaller power of two, largest first;
//! 4. a step that frees them all.
//!
//! Every rank of a group gets the same figures and caps them alike (by the KV blocks it
//! has, the same on every rank of a group with one budget, and the model's context), so
//! the ranks' plans, and so their collective calls, match.

use tessera_comm::proto::{
    Epoch, NewSeq, PrefillChunk, Sampling, SeqId, StepId, StepPlan, Term, Warmup,
};
use tessera_model::slice::{ModelSlice, SliceComm};

use super::StepRunner;
use crate::blocks::BlockAllocator;
use crate::error::ShardError;

/// The first warmup sequence's id; the others count down from it. Never a coordinator's
/// (it numbers sequences from `term << 40` up), and gone before the first real step.
pub const FIRST_WARMUP_SEQ: SeqId = SeqId(u64::MAX);

/// What a warmup ran.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WarmupRun {
    pub steps: usize,
    /// Tokens computed, over every step.
    pub tokens: usize,
    /// The largest prefill and decode it ran (after capping).
    pub prefill_tokens: usize,
    pub decode_seqs: usize,
}

/// The size of a warmup once capped.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Shape {
    prefill: usize,
    /// Decode batch sizes, largest first.
    decodes: Vec<usize>,
}

impl Shape {
    fn new(prefill: usize, seqs: usize, every_decode_batch: bool) -> Shape {
        let mut decodes = Vec::new();
        if seqs > 0 {
            decodes.push(seqs);
        }
        if every_decode_batch {
            let mut n = seqs
                .saturating_sub(1)
                .checked_next_power_of_two()
                .unwrap_or(0);
            while n > 0 {
                if n < seqs {
                    decodes.push(n);
                }
                n /= 2;
            }
        }
        Shape {
            prefill: prefill.max(1),
            decodes,
        }
    }

    fn seqs(&self) -> usize {
        self.decodes.first().copied().unwrap_or(1)
    }

    /// Tokens the longest-lived sequence samples: after its prompt, in step 2, and in
    /// every decode.
    fn samples(&self) -> usize {
        2 + self.decodes.len()
    }

    /// Positions the first sequence reaches (its prompt and every sampled token).
    fn first_len(&self) -> usize {
        self.prefill + self.samples()
    }

    /// KV blocks of `block_size` positions it needs at most.
    fn blocks(&self, block_size: usize) -> usize {
        let others = (self.seqs() - 1) * (1 + self.samples()).div_ceil(block_size);
        self.first_len().div_ceil(block_size) + others
    }
}

/// The plans of a warmup of `spec` for `epoch`, capped to `blocks` KV blocks of
/// `block_size` positions and a model of `context` positions: the prefill is cut to the
/// context, then the decode batch halved, then the prefill, until it fits. Empty when
/// `spec` asks for none or nothing fits.
pub fn warmup_plans(
    spec: Warmup,
    epoch: Epoch,
    (blocks, block_size): (usize, usize),
    context: usize,
    every_decode_batch: bool,
) -> Vec<StepPlan> {
    if spec.is_none() || block_size == 0 {
        return Vec::new();
    }
    let mut seqs = spec.decode_seqs as usize;
    let mut prefill = spec.prefill_tokens as usize;
    let shape = loop {
        let mut shape = Shape::new(prefill, seqs, every_decode_batch);
        if shape.first_len() > context {
            shape.prefill = context.saturating_sub(shape.samples());
            if shape.prefill == 0 {
                return Vec::new();
            }
        }
        if shape.blocks(block_size) <= blocks {
            break shape;
        }
        if seqs > 1 {
            seqs /= 2;
        } else if shape.prefill > 1 {
            prefill = shape.prefill / 2;
        } else {
            return Vec::new();
        }
    };
    plans(&shape, epoch)
}

fn plans(shape: &Shape, epoch: Epoch) -> Vec<StepPlan> {
    let ids: Vec<SeqId> = (0..shape.seqs() as u64)
        .map(|i| SeqId(FIRST_WARMUP_SEQ.0 - i))
        .collect();
    let max_tokens = shape.samples() as u32 + 1;
    let new = |id: SeqId, prompt: usize| NewSeq {
        seq: id,
        request: String::new(),
        prompt: vec![0; prompt],
        generated: Vec::new(),
        sampling: Sampling::default(),
        max_tokens,
        stop_token_ids: Vec::new(),
    };
    let chunk = |id: SeqId, tokens: usize| PrefillChunk {
        seq: id,
        tokens: tokens as u32,
    };
    let mut plans = Vec::new();
    let mut plan = |free: Vec<SeqId>, new: Vec<NewSeq>, prefill, decode| {
        plans.push(StepPlan {
            term: Term(0),
            epoch,
            step: StepId(plans.len() as u64),
            free,
            new,
            prefill,
            decode,
        });
    };
    let first = ids[0];
    plan(
        Vec::new(),
        vec![new(first, shape.prefill)],
        vec![chunk(first, shape.prefill)],
        Vec::new(),
    );
    let others = &ids[1..];
    plan(
        Vec::new(),
        others.iter().map(|&id| new(id, 1)).collect(),
        others.iter().map(|&id| chunk(id, 1)).collect(),
        vec![first],
    );
    for &n in &shape.decodes {
        plan(Vec::new(), Vec::new(), Vec::new(), ids[..n].to_vec());
    }
    plan(ids, Vec::new(), Vec::new(), Vec::new());
    plans
}

impl StepRunner {
    /// Runs the warmup `spec` on this runner's empty cache, then forgets it: its blocks
    /// (prefix cache included) are free again and the epoch's steps start at 0.
    /// `every_decode_batch`: also decode each smaller power of two (a GPU captures one
    /// decode graph per batch size).
    pub fn warm_up(
        &mut self,
        model: &ModelSlice,
        comm: &mut SliceComm<'_>,
        spec: Warmup,
        every_decode_batch: bool,
    ) -> Result<WarmupRun, ShardError> {
        if !self.seqs.is_empty() || self.next_step != StepId(0) {
            return Err(ShardError::BadPlan {
                step: self.next_step,
                message: "a warmup needs a runner that has not stepped".to_string(),
            });
        }
        let plans = warmup_plans(
            spec,
            self.epoch,
            (self.num_blocks(), self.block_size()),
            model.config().max_position_embeddings,
            every_decode_batch,
        );
        let mut run = WarmupRun::default();
        for plan in &plans {
            let chunks: usize = plan.prefill.iter().map(|c| c.tokens as usize).sum();
            run.prefill_tokens = run.prefill_tokens.max(chunks);
            run.decode_seqs = run.decode_seqs.max(plan.decode.len());
            run.tokens += chunks + plan.decode.len();
            self.step(model, plan, comm)?;
        }
        run.steps = plans.len();
        self.blocks = BlockAllocator::new(self.num_blocks(), self.block_size());
        self.next_step = StepId(0);
        Ok(run)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPEC: Warmup = Warmup {
        prefill_tokens: 256,
        decode_seqs: 256,
    };

    #[test]
    fn the_plans_prefill_the_budget_then_decode_the_largest_batch_then_free() {
        let plans = warmup_plans(SPEC, Epoch(3), (10_000, 16), 8192, false);
        assert_eq!(plans.len(), 4);
        assert!(plans.iter().all(|p| p.epoch == Epoch(3)));
        assert_eq!(
            plans.iter().map(|p| p.step.0).collect::<Vec<_>>(),
            [0, 1, 2, 3]
        );
        assert_eq!(plans[0].new.len(), 1);
        assert_eq!(plans[0].new[0].prompt.len(), 256);
        assert_eq!(plans[0].prefill[0].tokens, 256);
        assert_eq!(plans[1].new.len() + plans[1].decode.len(), 256);
        assert_eq!(plans[2].decode.len(), 256);
        assert_eq!(plans[3].free.len(), 256);
        assert!(plans[3].free.contains(&FIRST_WARMUP_SEQ));
    }

    #[test]
    fn with_graphs_every_smaller_power_of_two_decodes_too() {
        let batches = |seqs| {
            let spec = Warmup {
                prefill_tokens: 16,
                decode_seqs: seqs,
            };
            let plans = warmup_plans(spec, Epoch(1), (100_000, 16), 8192, true);
            plans[2..plans.len() - 1]
                .iter()
                .map(|p| p.decode.len())
                .collect::<Vec<_>>()
        };
        assert_eq!(batches(256), [256, 128, 64, 32, 16, 8, 4, 2, 1]);
        assert_eq!(batches(100), [100, 64, 32, 16, 8, 4, 2, 1]);
        assert_eq!(batches(1), [1]);
    }

    #[test]
    fn a_small_cache_halves_the_batch_then_the_prefill() {
        // 256 one-block sequences and a 16-block prompt do not fit 40 blocks.
        let plans = warmup_plans(SPEC, Epoch(1), (40, 16), 8192, false);
        assert_eq!(plans[2].decode.len(), 16);
        let blocks = Shape::new(256, 16, false).blocks(16);
        assert!(blocks <= 40, "{blocks} blocks");
        let tiny = warmup_plans(SPEC, Epoch(1), (3, 16), 8192, false);
        assert_eq!(tiny[2].decode.len(), 1);
        assert!(tiny[0].prefill[0].tokens < 256);
        assert!(warmup_plans(SPEC, Epoch(1), (0, 16), 8192, false).is_empty());
    }

    #[test]
    fn a_short_context_caps_the_prefill() {
        let plans = warmup_plans(SPEC, Epoch(1), (10_000, 16), 100, false);
        assert_eq!(
            plans[0].new[0].prompt.len(),
            97,
            "the context less 3 samples"
        );
        assert_eq!(plans[2].decode.len(), 256, "the batch is not halved for it");
    }

    #[test]
    fn no_warmup_asked_is_no_plan() {
        assert!(warmup_plans(Warmup::NONE, Epoch(1), (100, 16), 8192, true).is_empty());
    }
}
