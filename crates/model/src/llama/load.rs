//! Loading a [`Llama`]: the whole model, or one rank's tensor-parallel slice of it, taken
//! tensor by tensor from a [`TensorSource`] and checked against the config's shapes.
//!
//! The forward pass (the parent module) only reads what this builds; [`Slicer`] is the one
//! place that knows which rows or columns of each tensor a rank keeps (see the parent
//! module's docs for the split). `crate::loader` and the shard's model assignment call
//! [`Llama::load_rank_with_progress`] and report [`LoadProgress`].

use std::mem::{Discriminant, discriminant};
use std::ops::Range;

use tessera_kernels::mmap::prefault;
use tessera_kernels::rope::Rope;
use tessera_topology::{RankPlan, plan_group};
use tracing::{info, warn};

use super::{Layer, Linear, Llama, Sharding};
use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::weights::{TensorId, TensorSource, Weight, check_shape};

/// Takes one rank's slice of each tensor from a source, counting the bytes it keeps.
struct Slicer<'a> {
    source: &'a dyn TensorSource,
    bytes: usize,
    dequantized: Vec<String>,
    /// Tensor kinds already warned about (one warning per kind, not per layer).
    warned: Vec<Discriminant<TensorId>>,
}

impl Slicer<'_> {
    /// `w`, kept: its bytes counted, and its pages in a file's map populated now
    /// ([`prefault`]) rather than on the first forward pass.
    fn keep(&mut self, w: Weight) -> Weight {
        self.bytes += w.storage_bytes();
        if w.is_mapped() {
            prefault(w.bytes());
        }
        w
    }

    /// The whole `rows × cols` tensor (norms: replicated on every rank).
    fn whole(&mut self, id: TensorId, rows: usize, cols: usize) -> Result<Weight, ModelError> {
        let w = self.source.require_shape(id, rows, cols)?;
        Ok(self.keep(w))
    }

    /// An RMSNorm's weights, with the config's offset added (Gemma's `1 + w`).
    fn norm(&mut self, id: TensorId, len: usize, c: &ModelConfig) -> Result<Vec<f32>, ModelError> {
        let mut w = self.whole(id, 1, len)?.to_f32()?;
        if c.block.norm_offset != 0.0 {
            w.iter_mut().for_each(|v| *v += c.block.norm_offset);
        }
        Ok(w)
    }

    /// Gemma 2's norm after a branch, when the config has them.
    fn post_norm(&mut self, id: TensorId, c: &ModelConfig) -> Result<Option<Vec<f32>>, ModelError> {
        c.block
            .post_norms
            .then(|| self.norm(id, c.hidden_size, c))
            .transpose()
    }

    /// A per-head norm (Qwen3's q/k norm) when the config has one: `head_dim` weights that
    /// every head shares, so every rank holds them whole whatever heads it owns.
    fn head_norm(&mut self, id: TensorId, c: &ModelConfig) -> Result<Option<Vec<f32>>, ModelError> {
        c.qk_norm()
            .then(|| self.norm(id, c.head_dim, c))
            .transpose()
    }

    /// Rows `take` of the `rows × cols` tensor `id`, borrowed from the map.
    fn rows(
        &mut self,
        id: TensorId,
        (rows, cols): (usize, usize),
        take: Range<usize>,
    ) -> Result<Weight, ModelError> {
        let w = self.source.require_shape(id, rows, cols)?;
        self.keep_rows(w, take)
    }

    fn keep_rows(&mut self, w: Weight, take: Range<usize>) -> Result<Weight, ModelError> {
        let w = if take == (0..w.rows) {
            w
        } else {
            w.rows_slice(take)?
        };
        Ok(self.keep(w))
    }

    /// Columns `take` of every row of the `rows × cols` tensor `id`, copied out; dequantized
    /// to f32 (with a warning) when `take` does not fall on the type's block boundaries.
    fn cols(
        &mut self,
        id: TensorId,
        (rows, cols): (usize, usize),
        take: Range<usize>,
    ) -> Result<Weight, ModelError> {
        let w = self.source.require_shape(id, rows, cols)?;
        let w = if take == (0..cols) {
            w
        } else {
            if !w.cols_aligned(&take) {
                if !self.warned.contains(&discriminant(&id)) {
                    self.warned.push(discriminant(&id));
                    warn!(
                        tensor = %w.name,
                        dtype = %w.dtype,
                        cols = ?take,
                        block_elems = w.dtype.block_elems(),
                        "column slice is not block-aligned: dequantized to f32"
                    );
                }
                self.dequantized.push(w.name.clone());
            }
            w.cols_slice(take)?
        };
        Ok(self.keep(w))
    }

    /// A column-parallel projection: rows `take` of the weight and of its bias.
    fn column_parallel(
        &mut self,
        (id, bias): (TensorId, Option<TensorId>),
        (rows, cols): (usize, usize),
        take: Range<usize>,
    ) -> Result<Linear, ModelError> {
        let weight = self.rows(id, (rows, cols), take.clone())?;
        let bias = match bias {
            // A bias is one row: its slice is a column range.
            Some(b) => Some(self.cols(b, (1, rows), take)?.to_f32()?),
            None => None,
        };
        Ok(Linear { weight, bias })
    }

    /// The parts of the fused tensor `id` (Phi-3's q|k|v or gate|up), `cols` wide: part `i`
    /// is `parts[i].1` rows after the ones before it, of which this rank keeps the rows
    /// `parts[i].2`. Whole-row slices of the one map, so a quantized block is never cut and
    /// each part is sliced over the group as its own tensor would be.
    fn fused<const N: usize>(
        &mut self,
        id: TensorId,
        cols: usize,
        parts: [(&str, usize, Range<usize>); N],
    ) -> Result<[Linear; N], ModelError> {
        let w = self.source.require(id)?;
        let expected: usize = parts.iter().map(|p| p.1).sum();
        if w.rows != expected {
            let names: Vec<&str> = parts.iter().map(|p| p.0).collect();
            let sizes: Vec<String> = parts.iter().map(|p| p.1.to_string()).collect();
            return Err(ModelError::FusedRows {
                path: self.source.path().into(),
                tensor: w.name,
                rows: w.rows,
                parts: format!("{} = {}", names.join(" + "), sizes.join(" + ")),
                expected,
            });
        }
        let w = check_shape(self.source.path(), w, expected, cols)?;
        let mut start = 0;
        let mut out = Vec::with_capacity(N);
        for (_, rows, take) in parts {
            let take = start + take.start..start + take.end;
            out.push(Linear {
                weight: self.keep_rows(w.clone(), take)?,
                bias: None,
            });
            start += rows;
        }
        out.try_into().map_err(|_| ModelError::Plan {
            message: "a fused tensor split into the wrong number of parts".into(),
        })
    }

    /// A row-parallel projection (no bias in this family): columns `take` of every row.
    fn row_parallel(
        &mut self,
        id: TensorId,
        (rows, cols): (usize, usize),
        take: Range<usize>,
    ) -> Result<Linear, ModelError> {
        let weight = self.cols(id, (rows, cols), take)?;
        Ok(Linear { weight, bias: None })
    }

    /// This rank's q, k and v projections of layer `l`: three tensors, or Phi-3's one.
    fn qkv(
        &mut self,
        l: usize,
        c: &ModelConfig,
        plan: &RankPlan,
    ) -> Result<[Linear; 3], ModelError> {
        let (hidden, hd) = (c.hidden_size, c.head_dim);
        let (q_rows, kv_rows) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
        if c.fused_projections() {
            let (q, kv) = (plan.q_rows(hd), plan.kv_rows(hd));
            let parts = [
                ("q", q_rows, q),
                ("k", kv_rows, kv.clone()),
                ("v", kv_rows, kv),
            ];
            return self.fused(TensorId::Qkv(l), hidden, parts);
        }
        let bias = |id: TensorId| c.attention_bias.then_some(id);
        Ok([
            self.column_parallel(
                (TensorId::Q(l), bias(TensorId::QBias(l))),
                (q_rows, hidden),
                plan.q_rows(hd),
            )?,
            self.column_parallel(
                (TensorId::K(l), bias(TensorId::KBias(l))),
                (kv_rows, hidden),
                plan.kv_rows(hd),
            )?,
            self.column_parallel(
                (TensorId::V(l), bias(TensorId::VBias(l))),
                (kv_rows, hidden),
                plan.kv_rows(hd),
            )?,
        ])
    }

    /// This rank's gate and up projections of layer `l`: two tensors, or Phi-3's one.
    fn gate_up(
        &mut self,
        l: usize,
        c: &ModelConfig,
        plan: &RankPlan,
    ) -> Result<[Linear; 2], ModelError> {
        let (hidden, inter, rows) = (c.hidden_size, c.intermediate_size, &plan.mlp_rows);
        if c.fused_projections() {
            let parts = [("gate", inter, rows.clone()), ("up", inter, rows.clone())];
            return self.fused(TensorId::GateUp(l), hidden, parts);
        }
        Ok([
            self.column_parallel((TensorId::Gate(l), None), (inter, hidden), rows.clone())?,
            self.column_parallel((TensorId::Up(l), None), (inter, hidden), rows.clone())?,
        ])
    }

    fn layer(&mut self, l: usize, c: &ModelConfig, plan: &RankPlan) -> Result<Layer, ModelError> {
        let (hidden, hd, inter) = (c.hidden_size, c.head_dim, c.intermediate_size);
        let q_rows = c.num_attention_heads * hd;
        let attn_norm = self.norm(TensorId::AttnNorm(l), hidden, c)?;
        let [q, k, v] = self.qkv(l, c, plan)?;
        let [gate, up] = self.gate_up(l, c, plan)?;
        Ok(Layer {
            attn_norm,
            q,
            k,
            v,
            q_norm: self.head_norm(TensorId::QNorm(l), c)?,
            k_norm: self.head_norm(TensorId::KNorm(l), c)?,
            o: self.row_parallel(TensorId::O(l), (hidden, q_rows), plan.q_rows(hd))?,
            post_attn_norm: self.post_norm(TensorId::PostAttnNorm(l), c)?,
            // Gemma 2 names its pre-MLP norm apart from its post-attention one.
            ffn_norm: match c.block.post_norms {
                true => self.norm(TensorId::PreFfnNorm(l), hidden, c)?,
                false => self.norm(TensorId::FfnNorm(l), hidden, c)?,
            },
            post_ffn_norm: self.post_norm(TensorId::PostFfnNorm(l), c)?,
            gate,
            up,
            down: self.row_parallel(TensorId::Down(l), (hidden, inter), plan.mlp_rows.clone())?,
        })
    }
}

/// How far [`Llama::load_rank_with_progress`] has come.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadProgress {
    pub layers_done: usize,
    pub layers: usize,
    /// Bytes of this rank's slice taken so far.
    pub weight_bytes: usize,
}

impl Llama {
    /// Loads (maps) every tensor the config implies, checking each shape: the whole model,
    /// a group of one.
    pub fn load(source: &dyn TensorSource, config: ModelConfig) -> Result<Llama, ModelError> {
        let plans = plan_group(1, &config.shape()).map_err(|e| ModelError::Plan {
            message: e.to_string(),
        })?;
        Llama::load_rank(source, config, &plans[0], 1)
    }

    /// Loads rank `plan.rank`'s slice of the model for a group of `tp` ranks (see the
    /// `llama` module docs). Column-parallel slices borrow the map; row-parallel ones copy
    /// only their columns. `plan` must be the one `plan_group(tp, config.shape())` gives.
    pub fn load_rank(
        source: &dyn TensorSource,
        config: ModelConfig,
        plan: &RankPlan,
        tp: usize,
    ) -> Result<Llama, ModelError> {
        Llama::load_rank_with_progress(source, config, plan, tp, &mut |_| {})
    }

    /// [`Llama::load_rank`], calling `progress` after each layer.
    pub fn load_rank_with_progress(
        source: &dyn TensorSource,
        config: ModelConfig,
        plan: &RankPlan,
        tp: usize,
        progress: &mut dyn FnMut(LoadProgress),
    ) -> Result<Llama, ModelError> {
        let sharding = Sharding::new(&config, plan, tp)?;
        let c = &config;
        let hidden = c.hidden_size;
        let mut slicer = Slicer {
            source,
            bytes: 0,
            dequantized: Vec::new(),
            warned: Vec::new(),
        };
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for l in 0..c.num_hidden_layers {
            layers.push(slicer.layer(l, c, plan)?);
            progress(LoadProgress {
                layers_done: l + 1,
                layers: c.num_hidden_layers,
                weight_bytes: slicer.bytes,
            });
        }
        let vocab = plan.vocab_rows.clone();
        let embed = slicer.rows(TensorId::Embed, (c.vocab_size, hidden), vocab.clone())?;
        let lm_head = match source.get(TensorId::LmHead)? {
            Some(w) => {
                let w = check_shape(source.path(), w, c.vocab_size, hidden)?;
                Some(slicer.keep_rows(w, vocab)?)
            }
            None if c.tie_word_embeddings => None,
            None => {
                return Err(ModelError::MissingTensor {
                    path: source.path().into(),
                    tensor: TensorId::LmHead.hf_name(),
                });
            }
        };
        let final_norm = slicer.norm(TensorId::FinalNorm, hidden, c)?;
        let rope = Rope::new(c.head_dim, c.rope.theta, &c.rope.scaling, c.rope.pairing);
        info!(
            rank = %plan.rank,
            tp,
            weight_bytes = slicer.bytes,
            dequantized_tensors = slicer.dequantized.len(),
            "model slice loaded"
        );
        Ok(Llama {
            rope,
            embed,
            layers,
            final_norm,
            lm_head,
            sharding,
            weight_bytes: slicer.bytes,
            dequantized: slicer.dequantized,
            precision: tessera_topology::Precision::Exact,
            held: None,
            rounding: Default::default(),
            config,
            workspace: Default::default(),
        })
    }
}
