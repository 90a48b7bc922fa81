//! The tensor-parallel slicing arithmetic (Megatron-style), in one place: which attention
//! heads, KV heads, MLP rows and vocabulary rows each rank of a group holds. The model
//! loader slices weights with these ranges; `tessera topology check` prints them.
//!
//! For `tp` ranks and rank `r`:
//! - query heads: `tp` must divide `num_attention_heads`; rank `r` holds the `heads / tp`
//!   heads starting at `r * heads / tp` (q_proj rows, o_proj columns).
//! - KV heads: if `tp` divides `num_key_value_heads`, rank `r` holds `kv / tp` of them the
//!   same way. If instead `num_key_value_heads` divides `tp` (tp > kv), each KV head is
//!   replicated on `tp / kv` consecutive ranks: rank `r` holds KV head `r / (tp / kv)`, the
//!   one its query heads attend with. Both cases keep every rank's query heads and their KV
//!   heads on the same rank.
//! - MLP: `tp` must divide `intermediate_size`; rank `r` holds rows
//!   `r * inter / tp .. (r + 1) * inter / tp` of gate_proj and up_proj (and those columns of
//!   down_proj).
//! - Vocabulary (embedding and LM head rows): split into `tp` contiguous ranges that may be
//!   uneven: with `vocab = q * tp + m`, the first `m` ranks hold `q + 1` rows and the others
//!   `q`. `tp` must be at most `vocab_size` so that no rank is empty.

use std::ops::Range;

use serde::Serialize;

use crate::error::PlanError;
use crate::topology::Rank;

/// The hyper-parameters of a model that decide how it splits. Built by the caller from the
/// model's config (crate `model`); this crate reads no files.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct ModelShape {
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
}

/// The slice of the model that one rank holds. Ranges are in units of heads or rows.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct RankPlan {
    pub rank: Rank,
    /// Query heads (rows of q_proj in units of head_dim; columns of o_proj).
    pub heads: Range<usize>,
    /// KV heads (rows of k_proj and v_proj in units of head_dim).
    pub kv_heads: Range<usize>,
    /// True when tp > num_key_value_heads: other ranks hold copies of the same KV heads.
    pub kv_replicated: bool,
    /// Rows of gate_proj and up_proj; columns of down_proj.
    pub mlp_rows: Range<usize>,
    /// Rows of the token embedding and the LM head.
    pub vocab_rows: Range<usize>,
}

impl RankPlan {
    /// `heads` in rows of q_proj for a head dimension of `head_dim`.
    pub fn q_rows(&self, head_dim: usize) -> Range<usize> {
        self.heads.start * head_dim..self.heads.end * head_dim
    }

    /// `kv_heads` in rows of k_proj / v_proj for a head dimension of `head_dim`.
    pub fn kv_rows(&self, head_dim: usize) -> Range<usize> {
        self.kv_heads.start * head_dim..self.kv_heads.end * head_dim
    }
}

/// Splits a model over `tp` ranks, or says why it cannot (the first problem; see
/// [`check_tp`] for all of them).
pub fn plan_group(tp: usize, shape: &ModelShape) -> Result<Vec<RankPlan>, PlanError> {
    if let Some(problem) = check_tp(tp, shape).into_iter().next() {
        return Err(problem);
    }
    let heads_per_rank = shape.num_attention_heads / tp;
    let kv = shape.num_key_value_heads;
    let mlp_per_rank = shape.intermediate_size / tp;
    let plans = (0..tp)
        .map(|r| {
            let (kv_heads, kv_replicated) = if kv.is_multiple_of(tp) {
                let per_rank = kv / tp;
                (r * per_rank..(r + 1) * per_rank, false)
            } else {
                let head = r / (tp / kv);
                (head..head + 1, true)
            };
            RankPlan {
                // A group has at most `num_attention_heads` ranks; heads counts fit in u32.
                rank: Rank(u32::try_from(r).unwrap_or(u32::MAX)),
                heads: r * heads_per_rank..(r + 1) * heads_per_rank,
                kv_heads,
                kv_replicated,
                mlp_rows: r * mlp_per_rank..(r + 1) * mlp_per_rank,
                vocab_rows: even_split(shape.vocab_size, tp, r),
            }
        })
        .collect();
    Ok(plans)
}

/// Every reason `tp` cannot split this model (empty when it can).
pub(crate) fn check_tp(tp: usize, shape: &ModelShape) -> Vec<PlanError> {
    if let Some(problem) = shape_problem(shape) {
        return vec![problem];
    }
    if tp == 0 {
        return vec![PlanError::TpZero];
    }
    let fits = || fitting_tps(shape);
    let mut problems = Vec::new();
    let heads = shape.num_attention_heads;
    let kv_heads = shape.num_key_value_heads;
    if !heads.is_multiple_of(tp) {
        problems.push(PlanError::Heads {
            tp,
            heads,
            fits: fits(),
        });
    }
    if !kv_heads.is_multiple_of(tp) && !tp.is_multiple_of(kv_heads) {
        problems.push(PlanError::KvHeads {
            tp,
            kv_heads,
            fits: fits(),
        });
    }
    if !shape.intermediate_size.is_multiple_of(tp) {
        problems.push(PlanError::MlpRows {
            tp,
            intermediate_size: shape.intermediate_size,
            fits: fits(),
        });
    }
    if tp > shape.vocab_size {
        problems.push(PlanError::VocabRows {
            tp,
            vocab_size: shape.vocab_size,
            fits: fits(),
        });
    }
    problems
}

/// Every tp that splits this model, in increasing order (empty for an invalid shape).
pub fn fitting_tps(shape: &ModelShape) -> Vec<usize> {
    if shape_problem(shape).is_some() {
        return Vec::new();
    }
    let kv = shape.num_key_value_heads;
    (1..=shape.num_attention_heads)
        .filter(|&tp| {
            shape.num_attention_heads.is_multiple_of(tp)
                && (kv.is_multiple_of(tp) || tp.is_multiple_of(kv))
                && shape.intermediate_size.is_multiple_of(tp)
                && tp <= shape.vocab_size
        })
        .collect()
}

fn shape_problem(shape: &ModelShape) -> Option<PlanError> {
    let fields = [
        ("num_attention_heads", shape.num_attention_heads),
        ("num_key_value_heads", shape.num_key_value_heads),
        ("intermediate_size", shape.intermediate_size),
        ("vocab_size", shape.vocab_size),
        ("hidden_size", shape.hidden_size),
        ("num_hidden_layers", shape.num_hidden_layers),
    ];
    if let Some((field, _)) = fields.iter().find(|(_, v)| *v == 0) {
        return Some(PlanError::EmptyShape { field });
    }
    if !shape
        .num_attention_heads
        .is_multiple_of(shape.num_key_value_heads)
    {
        return Some(PlanError::UngroupedHeads {
            heads: shape.num_attention_heads,
            kv_heads: shape.num_key_value_heads,
        });
    }
    None
}

/// Part `r` of `n` items split into `parts` contiguous ranges, the first `n % parts` one
/// item longer.
fn even_split(n: usize, parts: usize, r: usize) -> Range<usize> {
    let base = n / parts;
    let extra = n % parts;
    let start = r * base + r.min(extra);
    let len = base + usize::from(r < extra);
    start..start + len
}

#[cfg(test)]
mod tests {
    use super::*;

    const LLAMA_70B: ModelShape = ModelShape {
        num_attention_heads: 64,
        num_key_value_heads: 8,
        intermediate_size: 28672,
        vocab_size: 128256,
        hidden_size: 8192,
        num_hidden_layers: 80,
    };

    const SMOLLM2_135M: ModelShape = ModelShape {
        num_attention_heads: 9,
        num_key_value_heads: 3,
        intermediate_size: 1536,
        vocab_size: 49152,
        hidden_size: 576,
        num_hidden_layers: 30,
    };

    /// Every head, KV head, row is held, ranges are contiguous and in rank order.
    fn assert_covers(plans: &[RankPlan], shape: &ModelShape) {
        let tp = plans.len();
        for (r, plan) in plans.iter().enumerate() {
            assert_eq!(plan.rank, Rank(r as u32));
        }
        let tile = |get: fn(&RankPlan) -> Range<usize>, total: usize| {
            let mut next = 0;
            for plan in plans {
                let range = get(plan);
                assert_eq!(range.start, next, "{plans:?}");
                assert!(!range.is_empty(), "{plans:?}");
                next = range.end;
            }
            assert_eq!(next, total);
        };
        tile(|p| p.heads.clone(), shape.num_attention_heads);
        tile(|p| p.mlp_rows.clone(), shape.intermediate_size);
        tile(|p| p.vocab_rows.clone(), shape.vocab_size);
        if tp <= shape.num_key_value_heads {
            tile(|p| p.kv_heads.clone(), shape.num_key_value_heads);
        }
        // Every query head of a rank attends with a KV head the rank holds.
        let group = shape.num_attention_heads / shape.num_key_value_heads;
        for plan in plans {
            for q in plan.heads.clone() {
                assert!(plan.kv_heads.contains(&(q / group)), "rank {:?}", plan.rank);
            }
        }
    }

    #[test]
    fn llama_70b_on_8_ranks() {
        let plans = plan_group(8, &LLAMA_70B).expect("fits");
        assert_covers(&plans, &LLAMA_70B);
        assert_eq!(plans[3].heads, 24..32);
        assert_eq!(plans[3].kv_heads, 3..4);
        assert!(!plans[3].kv_replicated);
        assert_eq!(plans[3].mlp_rows, 10752..14336);
        assert_eq!(plans[3].vocab_rows, 48096..64128);
        assert_eq!(plans[3].q_rows(128), 3072..4096);
        assert_eq!(plans[3].kv_rows(128), 384..512);
    }

    #[test]
    fn kv_heads_are_replicated_when_tp_exceeds_them() {
        let plans = plan_group(16, &LLAMA_70B).expect("fits");
        assert_covers(&plans, &LLAMA_70B);
        let kv: Vec<_> = plans.iter().map(|p| p.kv_heads.start).collect();
        assert_eq!(kv, vec![0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7]);
        assert!(
            plans
                .iter()
                .all(|p| p.kv_replicated && p.kv_heads.len() == 1)
        );

        let plans = plan_group(
            9,
            &ModelShape {
                intermediate_size: 1539,
                ..SMOLLM2_135M
            },
        )
        .expect("fits");
        let kv: Vec<_> = plans.iter().map(|p| p.kv_heads.start).collect();
        assert_eq!(kv, vec![0, 0, 0, 1, 1, 1, 2, 2, 2]);
    }

    #[test]
    fn smollm2_on_3_ranks_and_uneven_vocab() {
        let plans = plan_group(3, &SMOLLM2_135M).expect("fits");
        assert_covers(&plans, &SMOLLM2_135M);
        assert_eq!(plans[1].heads, 3..6);
        assert_eq!(plans[1].kv_heads, 1..2);
        assert_eq!(plans[1].mlp_rows, 512..1024);

        let odd = ModelShape {
            vocab_size: 10,
            ..SMOLLM2_135M
        };
        let plans = plan_group(3, &odd).expect("fits");
        let vocab: Vec<_> = plans.iter().map(|p| p.vocab_rows.clone()).collect();
        assert_eq!(vocab, vec![0..4, 4..7, 7..10]);
    }

    #[test]
    fn tp_one_holds_everything() {
        let plans = plan_group(1, &LLAMA_70B).expect("fits");
        assert_eq!(plans.len(), 1);
        assert_eq!(plans[0].heads, 0..64);
        assert_eq!(plans[0].kv_heads, 0..8);
        assert_eq!(plans[0].vocab_rows, 0..128256);
    }

    #[test]
    fn every_fitting_tp_covers_the_model() {
        for shape in [LLAMA_70B, SMOLLM2_135M] {
            for tp in fitting_tps(&shape) {
                let plans = plan_group(tp, &shape).expect("fitting tp");
                assert_eq!(plans.len(), tp);
                assert_covers(&plans, &shape);
            }
        }
        assert_eq!(fitting_tps(&SMOLLM2_135M), vec![1, 3]);
        assert_eq!(fitting_tps(&LLAMA_70B), vec![1, 2, 4, 8, 16, 32, 64]);
    }

    #[test]
    fn each_rule_refuses_its_tp() {
        let problems = check_tp(3, &LLAMA_70B);
        let classes: Vec<_> = problems.iter().map(PlanError::class).collect();
        assert_eq!(classes, vec!["tp-heads", "tp-kv-heads", "tp-mlp-rows"]);
        assert_eq!(
            problems[0].to_string(),
            "tp = 3 does not divide num_attention_heads = 64"
        );

        let no_mlp = ModelShape {
            intermediate_size: 100,
            ..LLAMA_70B
        };
        assert_eq!(
            plan_group(8, &no_mlp).map_err(|e| e.class()),
            Err("tp-mlp-rows")
        );

        let tiny_vocab = ModelShape {
            vocab_size: 4,
            ..LLAMA_70B
        };
        assert_eq!(
            plan_group(8, &tiny_vocab).map_err(|e| e.class()),
            Err("tp-vocab-rows")
        );

        // kv = 6, tp = 4: neither divides the other.
        let kv6 = ModelShape {
            num_attention_heads: 24,
            num_key_value_heads: 6,
            ..LLAMA_70B
        };
        assert_eq!(
            plan_group(4, &kv6).map_err(|e| e.class()),
            Err("tp-kv-heads")
        );
        assert_eq!(plan_group(0, &LLAMA_70B), Err(PlanError::TpZero));
    }

    #[test]
    fn invalid_shapes_are_refused() {
        let zero = ModelShape {
            num_key_value_heads: 0,
            ..LLAMA_70B
        };
        assert_eq!(
            plan_group(1, &zero),
            Err(PlanError::EmptyShape {
                field: "num_key_value_heads"
            })
        );
        let ungrouped = ModelShape {
            num_key_value_heads: 7,
            ..LLAMA_70B
        };
        assert_eq!(
            plan_group(1, &ungrouped).map_err(|e| e.class()),
            Err("model-shape")
        );
        assert!(fitting_tps(&ungrouped).is_empty());
    }
}
