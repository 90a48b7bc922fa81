//! The Llama-family decoder (Touvron et al. 2023, <https://arxiv.org/abs/2302.13971>):
//! pre-norm blocks of grouped-query attention with RoPE and a SwiGLU MLP. Mistral and
//! Qwen2 are the same graph with other defaults (Qwen2: q/k/v biases, tied embeddings);
//! Qwen3 (<https://arxiv.org/abs/2505.09388>) adds an RMSNorm over every q and k head
//! between the projections and RoPE ([`head_rms_norm`]). Gemma 2
//! (<https://arxiv.org/abs/2408.00118>) varies the block more ([`BlockConfig`]): a GeGLU
//! MLP, an RMSNorm of each branch's output before it joins the residual, soft-capped
//! attention and output logits, sliding windows on alternate layers, and an embedding
//! scaled by `√hidden`. Phi-3 (<https://arxiv.org/abs/2404.14219>) is the Llama graph with
//! q|k|v and gate|up fused in its checkpoint (split at load), a sliding window on every
//! layer when set, and LongRoPE ([`Rope`]).
//!
//! [`Llama::forward`] runs a chunk of tokens of one sequence through every layer, writing
//! their K/V into the paged cache, and returns the logits of the last token. This file is
//! that pass; building a model (mapping and slicing its tensors) is the `load` submodule.
//!
//! Tensor parallelism follows Megatron-LM (Shoeybi et al. 2019,
//! <https://arxiv.org/abs/1909.08053>); the slicing arithmetic is `tessera_topology`'s
//! [`RankPlan`]. A rank loaded with [`Llama::load_rank`] holds:
//! - q/k/v (and their biases), gate and up: its rows (column-parallel: its attention heads,
//!   its KV heads, its MLP rows) — sub-ranges of the memory map, nothing copied; Phi-3's
//!   fused tensors give each part's rows the same way;
//! - o_proj and down_proj: the matching columns of every row (row-parallel), each followed
//!   by an all-reduce of the partial sums over the group;
//! - embedding and LM head: its vocabulary rows. A token outside them embeds as zeros and
//!   the all-reduce fills it in; each rank's logits are padded to `ceil(vocab / tp)` with
//!   −∞, all-gathered, and un-padded, so every rank returns the full vocabulary;
//! - norms: whole (replicated), Qwen3's q/k norms too (one `head_dim` vector shared by every
//!   head).
//!
//! Its KV cache holds only its own KV heads; attention maps local query head `h` to local
//! KV head `h / (local heads / local KV heads)`, which is the right one both when KV heads
//! are split and when they are replicated (tp > KV heads: one KV head per rank).

mod convert;
mod load;
mod rounding;
mod sharding;

use std::sync::Mutex;

use tessera_comm::Collective;
use tessera_kernels::activation::{gelu_tanh_mul_row, silu_mul_row};
use tessera_kernels::attention::{KvLayout, paged_attention};
use tessera_kernels::matmul::{
    Input, Precision as KernelPrecision, matmul_input, matmul_input_many, matmul_input_wide,
};
use tessera_kernels::norm::{head_rms_norm, rms_norm};
use tessera_kernels::rope::{Rope, RopeTables};
use tessera_topology::{Precision, RankPlan};

use crate::batch::BatchIndex;
#[cfg(doc)]
use crate::config::BlockConfig;
use crate::config::{Activation, ModelConfig};
use crate::error::ModelError;
use crate::kv_cache::{KvCache, SeqCache, SeqChunk};
use crate::weights::Weight;

pub use load::LoadProgress;
pub use rounding::DeviceRounding;
pub(crate) use sharding::{Sharding, check_kv_layout};

/// A projection with an optional bias.
#[derive(Debug)]
pub(crate) struct Linear {
    pub(crate) weight: Weight,
    pub(crate) bias: Option<Vec<f32>>,
}

impl Linear {
    /// `ys[i] = W_i·x (+ bias_i)` for the input's `len / cols` tokens and each of
    /// `linears`: one input's projections (q, k and v; gate and up) as one parallel region
    /// ([`matmul_input_many`]).
    fn apply_many<const N: usize>(
        linears: [&Linear; N],
        x: &Input<'_>,
        ys: [&mut Vec<f32>; N],
    ) -> Result<(), ModelError> {
        let ws = linears.map(|l| l.weight.mat());
        let mut ys = ys;
        for (l, y) in linears.iter().zip(ys.iter_mut()) {
            y.resize(x.len() / l.weight.cols * l.weight.rows, 0.0);
        }
        matmul_input_many(&ws, x, ys.each_mut().map(|y| y.as_mut_slice()))?;
        for (l, y) in linears.iter().zip(ys) {
            l.add_bias(y);
        }
        Ok(())
    }

    /// A row-parallel projection (o, down): `ys = W·x (+ bias)` summed over the group,
    /// each rank holding some of the columns. Where the weights take `fast`'s 8-bit path,
    /// this rank's sums stay in f64 (`wide`) until the group has added them and are then
    /// rounded to f32 once, so the total is the same bits at any tp. `fast` needs that: a
    /// last-bit difference here can move the next layer's rounding to 8 bits by a whole
    /// step, and such steps grow over the layers (seen on SmolLM2 at tp 3: logits 0.6 apart).
    fn apply_summed(
        &self,
        x: &Input<'_>,
        ys: &mut Vec<f32>,
        wide: &mut Vec<f64>,
        comm: &mut dyn Collective,
    ) -> Result<(), ModelError> {
        let w = self.weight.mat();
        if x.quantizes(&w) {
            wide.resize(x.len() / self.weight.cols * self.weight.rows, 0.0);
            matmul_input_wide(&w, x, wide)?;
            comm.all_reduce_sum_f64(wide)?;
            ys.clear();
            ys.extend(wide.iter().map(|&v| v as f32));
        } else {
            ys.resize(x.len() / self.weight.cols * self.weight.rows, 0.0);
            matmul_input(&w, x, ys)?;
            comm.all_reduce_sum(ys)?;
        }
        self.add_bias(ys);
        Ok(())
    }

    fn add_bias(&self, ys: &mut [f32]) {
        if let Some(bias) = &self.bias {
            for y in ys.chunks_exact_mut(bias.len()) {
                y.iter_mut().zip(bias).for_each(|(y, b)| *y += b);
            }
        }
    }
}

#[derive(Debug)]
pub(crate) struct Layer {
    pub(crate) attn_norm: Vec<f32>,
    pub(crate) q: Linear,
    pub(crate) k: Linear,
    pub(crate) v: Linear,
    /// Qwen3's per-head RMSNorm weights for q and k (`head_dim` each).
    pub(crate) q_norm: Option<Vec<f32>>,
    pub(crate) k_norm: Option<Vec<f32>>,
    pub(crate) o: Linear,
    /// Gemma 2's norm of the attention output, before the residual add.
    pub(crate) post_attn_norm: Option<Vec<f32>>,
    pub(crate) ffn_norm: Vec<f32>,
    /// Gemma 2's norm of the MLP output, before the residual add.
    pub(crate) post_ffn_norm: Option<Vec<f32>>,
    pub(crate) gate: Linear,
    pub(crate) up: Linear,
    pub(crate) down: Linear,
}

/// What every layer of one forward pass shares.
struct Pass<'a> {
    config: &'a ModelConfig,
    rope: &'a Rope,
    rope_tables: &'a RopeTables,
    positions: &'a [usize],
    /// Positions each token attends to (causal: its own position + 1).
    visible: &'a [usize],
    /// The block table of each token's sequence.
    tables: Vec<&'a [u32]>,
    /// This rank's query heads and KV heads.
    heads: usize,
    kv_heads: usize,
    precision: KernelPrecision,
    rounding: DeviceRounding,
}

impl Layer {
    /// One decoder block over the pass's tokens: `x += attn(norm(x)); x += mlp(norm(x))`,
    /// each branch summed over the group after its row-parallel projection (and, in
    /// Gemma 2, normalized again before the add).
    fn run(
        &self,
        l: usize,
        pass: &Pass<'_>,
        s: &mut Scratch,
        cache: &mut KvCache,
        comm: &mut dyn Collective,
    ) -> Result<(), ModelError> {
        let c = pass.config;
        let (hidden, eps, p, round) =
            (c.hidden_size, c.rms_norm_eps, pass.precision, pass.rounding);
        // One input for q, k and v: in `fast`, quantized once, each token as it is normed.
        let x = &s.x;
        let h = Input::make(&mut s.h, hidden, p, |t, h| {
            rms_norm(&x[t * hidden..][..hidden], &self.attn_norm, eps, h);
            round.apply(h);
        })?;
        Linear::apply_many(
            [&self.q, &self.k, &self.v],
            &h,
            [&mut s.q, &mut s.k, &mut s.v],
        )?;
        drop(h);
        let q_len = pass.heads * c.head_dim;
        let kv_len = pass.kv_heads * c.head_dim;
        let rows =
            s.q.chunks_exact_mut(q_len)
                .zip(s.k.chunks_exact_mut(kv_len));
        for (t, ((q, k), v)) in rows.zip(s.v.chunks_exact_mut(kv_len)).enumerate() {
            if let Some(w) = &self.q_norm {
                head_rms_norm(q, w, c.rms_norm_eps);
            }
            if let Some(w) = &self.k_norm {
                head_rms_norm(k, w, c.rms_norm_eps);
            }
            pass.rope.apply(pass.rope_tables, t, q);
            pass.rope.apply(pass.rope_tables, t, k);
            round.apply(k);
            round.apply(v);
            cache.write(l, pass.tables[t], pass.positions[t], k, v);
        }
        s.attn.resize(s.q.len(), 0.0);
        let kv = cache.layer(l);
        paged_attention(
            &s.q,
            &kv,
            &pass.tables,
            pass.visible,
            pass.heads,
            &c.block.attention(l),
            &mut s.attn,
        );
        round.apply(&mut s.attn);
        (self.o).apply_summed(&Input::new(&s.attn, p), &mut s.o, &mut s.wide, comm)?;
        post_norm(&mut s.o, self.post_attn_norm.as_deref(), c, &mut s.h);
        s.x.iter_mut().zip(&s.o).for_each(|(x, o)| *x += o);
        let x = &s.x;
        let h = Input::make(&mut s.h, hidden, p, |t, h| {
            rms_norm(&x[t * hidden..][..hidden], &self.ffn_norm, eps, h);
            round.apply(h);
        })?;
        Linear::apply_many([&self.gate, &self.up], &h, [&mut s.gate, &mut s.up])?;
        drop(h);
        let (up, inter) = (&s.up, self.up.weight.rows);
        let gated = Input::make(&mut s.gate, inter, p, |t, gate| {
            let up = &up[t * inter..][..inter];
            match c.block.activation {
                Activation::Silu => silu_mul_row(gate, up),
                Activation::GeluTanh => gelu_tanh_mul_row(gate, up),
            }
            round.apply(gate);
        })?;
        (self.down).apply_summed(&gated, &mut s.down, &mut s.wide, comm)?;
        drop(gated);
        post_norm(&mut s.down, self.post_ffn_norm.as_deref(), c, &mut s.h);
        s.x.iter_mut().zip(&s.down).for_each(|(x, d)| *x += d);
        Ok(())
    }
}

/// Normalizes each row of a branch's output in place when the block has a norm there,
/// through `scratch` (free at that point of the block).
fn post_norm(rows: &mut [f32], norm: Option<&[f32]>, c: &ModelConfig, scratch: &mut [f32]) {
    let Some(w) = norm else {
        return;
    };
    let hidden = c.hidden_size;
    for (row, tmp) in rows
        .chunks_exact_mut(hidden)
        .zip(scratch.chunks_exact_mut(hidden))
    {
        rms_norm(row, w, c.rms_norm_eps, tmp);
        row.copy_from_slice(tmp);
    }
}

/// A loaded Llama-family model: the whole model (tp = 1) or one rank's slice of it.
#[derive(Debug)]
pub struct Llama {
    pub(crate) config: ModelConfig,
    pub(crate) rope: Rope,
    /// This rank's vocabulary rows of the token embedding.
    pub(crate) embed: Weight,
    pub(crate) layers: Vec<Layer>,
    pub(crate) final_norm: Vec<f32>,
    /// This rank's vocabulary rows of the LM head; `None` when tied to the embedding.
    pub(crate) lm_head: Option<Weight>,
    pub(crate) sharding: Sharding,
    weight_bytes: usize,
    /// Tensors whose column slice was not block-aligned and was dequantized to f32.
    dequantized: Vec<String>,
    /// How its CPU matmuls treat activations (the GPU path ignores it).
    precision: Precision,
    /// The type [`Llama::hold_as`] converted every matrix to (`None`: as loaded).
    held: Option<tessera_kernels::DType>,
    /// What the CPU pass rounds as the cuda path does ([`Llama::round_like_cuda`]).
    rounding: DeviceRounding,
    /// What the CPU pass keeps from step to step.
    workspace: Mutex<Workspace>,
}

/// What a CPU forward pass keeps from one call to the next: its index arrays and
/// activations, so that a decode step allocates nothing in its layers and kernels. Kept
/// after steps of up to [`KEPT_TOKENS`] tokens (decode); a longer step's (prefill) is let go.
#[derive(Debug, Default)]
struct Workspace {
    ix: BatchIndex,
    positions: Vec<usize>,
    /// Each token's sequence length at the end of the call: LongRoPE picks by it.
    lengths: Vec<usize>,
    visible: Vec<usize>,
    rope: RopeTables,
    acts: Scratch,
    /// The final norm of the tokens whose logits are wanted, and their logits on this rank.
    normed: Vec<f32>,
    rows: Vec<f32>,
}

/// The most tokens of a step whose [`Workspace`] is kept for the next one.
const KEPT_TOKENS: usize = 64;

/// Activations of one forward pass, reused across layers.
#[derive(Debug, Default)]
struct Scratch {
    x: Vec<f32>,
    h: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    o: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    down: Vec<f32>,
    /// A row-parallel projection's f64 sums (see [`Linear::apply_summed`]).
    wide: Vec<f64>,
}

impl Llama {
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The slice of the model this rank holds.
    pub fn plan(&self) -> &RankPlan {
        &self.sharding.plan
    }

    /// Computes in `precision` from now on (on the CPU; see [`Precision`]).
    pub fn set_precision(&mut self, precision: Precision) {
        self.precision = precision;
    }

    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// Every matrix: the token embedding first, then the LM head (when not tied), then
    /// each layer's q, k, v, o, gate, up and down.
    pub(crate) fn matrices_mut(&mut self) -> Vec<&mut Weight> {
        let mut matrices = vec![&mut self.embed];
        matrices.extend(self.lm_head.as_mut());
        for l in &mut self.layers {
            let linears = [
                &mut l.q,
                &mut l.k,
                &mut l.v,
                &mut l.o,
                &mut l.gate,
                &mut l.up,
                &mut l.down,
            ];
            matrices.extend(linears.map(|l| &mut l.weight));
        }
        matrices
    }

    fn kernel_precision(&self) -> KernelPrecision {
        match self.precision {
            Precision::Exact => KernelPrecision::Exact,
            Precision::Fast => KernelPrecision::Fast,
        }
    }

    /// Ranks in this model's tensor-parallel group.
    pub fn tp(&self) -> usize {
        self.sharding.tp
    }

    /// Bytes of weights this rank holds, as stored (the bytes its slice takes from the
    /// model files, or their f32 expansion for a dequantized slice).
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    /// Tensors whose column slice fell inside quantization blocks and were dequantized to
    /// f32 at load (empty when every slice kept its stored type).
    pub fn dequantized_tensors(&self) -> &[String] {
        &self.dequantized
    }

    /// Every matrix of this rank: the embedding, each layer's projections, the LM head.
    #[cfg(feature = "cuda")]
    pub(crate) fn projection_weights(&self) -> impl Iterator<Item = &Weight> {
        let layers = self
            .layers
            .iter()
            .flat_map(|l| [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down].map(|p| &p.weight));
        std::iter::once(&self.embed)
            .chain(layers)
            .chain(self.lm_head.as_ref())
    }

    /// The KV cache layout of this rank: its own KV heads only.
    pub fn kv_layout(&self, block_size: usize) -> KvLayout {
        KvLayout {
            block_size,
            kv_heads: self.sharding.plan.kv_heads.len(),
            head_dim: self.config.head_dim,
        }
    }

    /// Runs one batch through the model: each [`SeqChunk`] is the next tokens of one
    /// sequence. Their K/V are written to the cache through the chunks' block tables, and
    /// the logits of the last token of every chunk that asks for them are returned over
    /// the whole vocabulary, in batch order.
    ///
    /// Every token's result is computed the same way whatever else is in the batch
    /// (batch-invariant kernels), so a sequence's tokens do not depend on its neighbours.
    /// Every rank of the group calls this with the same batch; `comm` is the group's
    /// collective ([`tessera_comm::Solo`] for tp = 1), and every rank gets the same logits.
    pub fn forward_batch(
        &self,
        batch: &[SeqChunk<'_>],
        cache: &mut KvCache,
        comm: &mut dyn Collective,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        // Another call running on this model (tests may share one) gets a workspace of its
        // own rather than waiting.
        let mut kept = self.workspace.try_lock();
        let mut own = None;
        let ws = match kept.as_deref_mut() {
            Ok(ws) => ws,
            Err(_) => own.insert(Workspace::default()),
        };
        let logits = self.forward_in(batch, cache, comm, ws);
        if ws.ix.tokens.len() > KEPT_TOKENS || logits.is_err() {
            *ws = Workspace::default();
        }
        logits
    }

    /// [`Llama::forward_batch`] in `ws`.
    fn forward_in(
        &self,
        batch: &[SeqChunk<'_>],
        cache: &mut KvCache,
        comm: &mut dyn Collective,
        ws: &mut Workspace,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let c = &self.config;
        self.check_group(cache, comm)?;
        let layout = cache.layout();
        let blocks = (layout.block_size, cache.num_blocks());
        ws.ix.check_and_fill(batch, c.vocab_size, blocks)?;
        let Workspace {
            ix,
            positions,
            lengths,
            visible,
            rope,
            acts: s,
            normed,
            rows,
        } = ws;
        let n = ix.tokens.len();
        positions.clear();
        positions.extend(ix.positions.iter().map(|&p| p as usize));
        lengths.clear();
        lengths.extend(ix.query_seq.iter().map(|&q| {
            let chunk = &batch[q as usize];
            chunk.start + chunk.tokens.len()
        }));
        visible.clear();
        visible.extend(ix.contexts.iter().map(|&v| v as usize));
        self.rope.fill_tables(positions, lengths, rope);
        let hidden = c.hidden_size;
        s.x.resize(n * hidden, 0.0);
        s.h.resize(n * hidden, 0.0);
        self.embed_tokens(&ix.tokens, &mut s.x, comm)?;
        let plan = &self.sharding.plan;
        let pass = Pass {
            config: c,
            rope: &self.rope,
            rope_tables: rope,
            tables: (ix.query_seq.iter())
                .map(|&q| batch[q as usize].block_table)
                .collect(),
            positions,
            visible,
            heads: plan.heads.len(),
            kv_heads: plan.kv_heads.len(),
            precision: self.kernel_precision(),
            rounding: self.rounding,
        };
        for (l, layer) in self.layers.iter().enumerate() {
            layer.run(l, &pass, s, cache, comm)?;
        }
        let wanted = &ix.wanted;
        normed.resize(wanted.len() * hidden, 0.0);
        for (&t, out) in wanted.iter().zip(normed.chunks_exact_mut(hidden)) {
            let x = &s.x[t * hidden..(t + 1) * hidden];
            rms_norm(x, &self.final_norm, c.rms_norm_eps, out);
            self.rounding.apply(out);
        }
        self.logits(normed, rows, comm)
    }

    /// Runs `tokens` (the next positions of `seq`) through the model and returns the
    /// logits of the last token: one sequence that owns `cache` from block 0 (single-
    /// sequence generation and tests; the shard's allocator hands out blocks otherwise).
    pub fn forward(
        &self,
        tokens: &[u32],
        seq: &mut SeqCache,
        cache: &mut KvCache,
        comm: &mut dyn Collective,
    ) -> Result<Vec<f32>, ModelError> {
        seq.grow(seq.len + tokens.len(), cache)?;
        let chunk = SeqChunk {
            tokens,
            start: seq.len,
            block_table: &seq.block_table,
            logits: true,
        };
        let mut logits = self.forward_batch(&[chunk], cache, comm)?;
        seq.len += tokens.len();
        logits.pop().ok_or_else(|| ModelError::InvalidRequest {
            message: "no tokens to run".into(),
        })
    }

    /// Refuses a collective or cache that does not belong to this rank's slice: a wrong
    /// group size would deadlock or mis-sum, a wrong cache layout would scramble K/V.
    fn check_group(&self, cache: &KvCache, comm: &dyn Collective) -> Result<(), ModelError> {
        self.sharding.check_collective(comm)?;
        self.check_layout(cache.layout())
    }

    /// Refuses a KV cache laid out for other heads than this rank's.
    fn check_layout(&self, layout: KvLayout) -> Result<(), ModelError> {
        check_kv_layout(self.kv_layout(layout.block_size), layout)
    }

    /// Vocabulary-parallel lookup: this rank's rows, zeros elsewhere, summed over the group.
    fn embed_tokens(
        &self,
        tokens: &[u32],
        x: &mut [f32],
        comm: &mut dyn Collective,
    ) -> Result<(), ModelError> {
        let vocab = &self.sharding.plan.vocab_rows;
        let embed = self.embed.mat();
        for (t, row) in tokens
            .iter()
            .zip(x.chunks_exact_mut(self.config.hidden_size))
        {
            let t = *t as usize;
            if vocab.contains(&t) {
                embed.dequantize_row(t - vocab.start, row)?;
            } else {
                row.fill(0.0);
            }
        }
        comm.all_reduce_sum(x)?;
        if let Some(scale) = self.config.block.embed_scale {
            x.iter_mut().for_each(|v| *v *= scale);
        }
        Ok(())
    }

    /// Logits of the tokens `normed` holds (final-normed): this rank's vocabulary rows
    /// (into `rows`), gathered from every rank.
    fn logits(
        &self,
        normed: &[f32],
        rows: &mut Vec<f32>,
        comm: &mut dyn Collective,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let n = normed.len() / self.config.hidden_size;
        if n == 0 {
            return Ok(Vec::new());
        }
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        rows.resize(n * head.rows, 0.0);
        let normed = Input::new(normed, self.kernel_precision());
        matmul_input(&head.mat(), &normed, rows)?;
        let mut logits = self.sharding.gather_logits(rows, n, comm)?;
        if let Some(cap) = self.config.block.final_softcap {
            // After the gather: a cap would turn the padding's −∞ into −cap.
            for v in logits.iter_mut().flatten() {
                *v = (*v / cap).tanh() * cap;
            }
        }
        Ok(logits)
    }
}
