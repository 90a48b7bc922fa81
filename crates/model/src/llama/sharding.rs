//! Where a rank sits in its tensor-parallel group, and the steps of a forward pass that
//! depend on it: checking the collective and the KV cache against the rank's slice, and
//! gathering the vocabulary-parallel logits. The CPU pass and the CUDA one share these.

use std::ops::Range;

use tessera_comm::Collective;
use tessera_kernels::attention::KvLayout;
use tessera_topology::{RankPlan, plan_group};

use crate::config::ModelConfig;
use crate::error::ModelError;

/// Where a model sits in its tensor-parallel group.
#[derive(Clone, Debug)]
pub(crate) struct Sharding {
    pub(crate) tp: usize,
    pub(crate) plan: RankPlan,
    /// Vocabulary rows of every rank, in rank order: how to un-pad the gathered logits.
    pub(crate) vocab_parts: Vec<Range<usize>>,
}

impl Sharding {
    /// Checks `plan` against the group's plan for this model and keeps what forward needs.
    pub(super) fn new(
        config: &ModelConfig,
        plan: &RankPlan,
        tp: usize,
    ) -> Result<Sharding, ModelError> {
        let plans = plan_group(tp, &config.shape()).map_err(|e| ModelError::Plan {
            message: e.to_string(),
        })?;
        if plans.get(plan.rank.0 as usize) != Some(plan) {
            return Err(ModelError::Plan {
                message: format!(
                    "rank {}'s plan {plan:?} is not the split of this model over {tp} ranks",
                    plan.rank
                ),
            });
        }
        Ok(Sharding {
            tp,
            plan: plan.clone(),
            vocab_parts: plans.into_iter().map(|p| p.vocab_rows).collect(),
        })
    }

    /// Refuses a collective of another group size or rank than this slice's.
    pub(crate) fn check_collective(&self, comm: &dyn Collective) -> Result<(), ModelError> {
        if comm.world_size() != self.tp || comm.rank() != self.plan.rank {
            return Err(ModelError::Plan {
                message: format!(
                    "the model is rank {} of {}, the collective is rank {} of {}",
                    self.plan.rank,
                    self.tp,
                    comm.rank(),
                    comm.world_size()
                ),
            });
        }
        Ok(())
    }

    /// The logits of `n` tokens over the whole vocabulary from this rank's `rows`
    /// (`n × its vocabulary rows`). Each token's part is padded with −∞ to one length for
    /// the all-gather, then un-padded in rank order.
    pub(crate) fn gather_logits(
        &self,
        rows: &[f32],
        n: usize,
        comm: &mut dyn Collective,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let parts = &self.vocab_parts;
        let mine_rows = self.plan.vocab_rows.len();
        let vocab = parts.last().map_or(0, |p| p.end);
        if parts.len() == 1 {
            return Ok(rows.chunks_exact(mine_rows).map(<[f32]>::to_vec).collect());
        }
        let padded = vocab.div_ceil(parts.len());
        let mut mine = vec![f32::NEG_INFINITY; n * padded];
        for (dst, src) in mine
            .chunks_exact_mut(padded)
            .zip(rows.chunks_exact(mine_rows))
        {
            dst[..mine_rows].copy_from_slice(src);
        }
        // Rank-major after the gather: rank r's block holds its part of every token.
        let mut gathered = vec![0.0; n * padded * parts.len()];
        comm.all_gather(&mine, &mut gathered)?;
        let mut logits = vec![Vec::with_capacity(vocab); n];
        for (block, range) in gathered.chunks_exact(n * padded).zip(parts) {
            for (out, part) in logits.iter_mut().zip(block.chunks_exact(padded)) {
                out.extend_from_slice(&part[..range.len()]);
            }
        }
        Ok(logits)
    }
}

/// Refuses a KV cache whose heads (`got`) are not the rank's (`want`): K/V would scramble.
pub(crate) fn check_kv_layout(want: KvLayout, got: KvLayout) -> Result<(), ModelError> {
    if (got.kv_heads, got.head_dim) != (want.kv_heads, want.head_dim) {
        return Err(ModelError::Plan {
            message: format!(
                "the KV cache holds {} KV heads of {} values per position; this rank has {} of {}",
                got.kv_heads, got.head_dim, want.kv_heads, want.head_dim
            ),
        });
    }
    Ok(())
}
