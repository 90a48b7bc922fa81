//! The Llama-family decoder (Touvron et al. 2023, <https://arxiv.org/abs/2302.13971>):
//! pre-norm blocks of grouped-query attention with RoPE and a SwiGLU MLP. Mistral and
//! Qwen2 are the same graph with other defaults (Qwen2: q/k/v biases, tied embeddings).
//!
//! [`Llama::forward`] runs a chunk of tokens of one sequence through every layer, writing
//! their K/V into the paged cache, and returns the logits of the last token.

use tessera_kernels::activation::silu_mul;
use tessera_kernels::attention::paged_attention;
use tessera_kernels::matmul::matmul;
use tessera_kernels::norm::{add_rms_norm, rms_norm};
use tessera_kernels::rope::{Rope, RopeTables};

use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::kv_cache::{KvCache, SeqCache};
use crate::weights::{TensorId, TensorSource, Weight, check_shape};

/// A projection with an optional bias.
#[derive(Debug)]
struct Linear {
    weight: Weight,
    bias: Option<Vec<f32>>,
}

impl Linear {
    fn load(
        source: &dyn TensorSource,
        id: TensorId,
        bias: Option<TensorId>,
        rows: usize,
        cols: usize,
    ) -> Result<Linear, ModelError> {
        let weight = source.require_shape(id, rows, cols)?;
        let bias = match bias {
            Some(b) => Some(source.require_shape(b, 1, rows)?.to_f32()?),
            None => None,
        };
        Ok(Linear { weight, bias })
    }

    /// `ys = W·xs (+ bias)` for `xs.len() / cols` tokens.
    fn apply(&self, xs: &[f32], ys: &mut Vec<f32>) -> Result<(), ModelError> {
        let n = xs.len() / self.weight.cols;
        ys.resize(n * self.weight.rows, 0.0);
        matmul(&self.weight.mat(), xs, ys)?;
        if let Some(bias) = &self.bias {
            for y in ys.chunks_exact_mut(bias.len()) {
                y.iter_mut().zip(bias).for_each(|(y, b)| *y += b);
            }
        }
        Ok(())
    }
}

#[derive(Debug)]
struct Layer {
    attn_norm: Vec<f32>,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    ffn_norm: Vec<f32>,
    gate: Linear,
    up: Linear,
    down: Linear,
}

/// What every layer of one forward pass shares.
struct Pass<'a> {
    config: &'a ModelConfig,
    rope: &'a Rope,
    tables: RopeTables,
    positions: Vec<usize>,
    /// Positions each token attends to (causal: its own position + 1).
    visible: Vec<usize>,
}

impl Layer {
    /// One decoder block over the pass's tokens: `x += attn(norm(x)); x += mlp(norm(x))`.
    fn run(
        &self,
        l: usize,
        pass: &Pass<'_>,
        s: &mut Scratch,
        seq: &SeqCache,
        cache: &mut KvCache,
    ) -> Result<(), ModelError> {
        let c = pass.config;
        let hidden = c.hidden_size;
        for (x, h) in s.x.chunks_exact(hidden).zip(s.h.chunks_exact_mut(hidden)) {
            rms_norm(x, &self.attn_norm, c.rms_norm_eps, h);
        }
        self.q.apply(&s.h, &mut s.q)?;
        self.k.apply(&s.h, &mut s.k)?;
        self.v.apply(&s.h, &mut s.v)?;
        let q_len = c.num_attention_heads * c.head_dim;
        let kv_len = c.num_key_value_heads * c.head_dim;
        let rows =
            s.q.chunks_exact_mut(q_len)
                .zip(s.k.chunks_exact_mut(kv_len));
        for (t, ((q, k), v)) in rows.zip(s.v.chunks_exact(kv_len)).enumerate() {
            pass.rope.apply(&pass.tables, t, q);
            pass.rope.apply(&pass.tables, t, k);
            cache.write(l, seq, pass.positions[t], k, v);
        }
        s.attn.resize(s.q.len(), 0.0);
        let kv = cache.layer(l);
        paged_attention(
            &s.q,
            &kv,
            &seq.block_table,
            &pass.visible,
            c.num_attention_heads,
            &mut s.attn,
        );
        self.o.apply(&s.attn, &mut s.o)?;
        let rows = s.x.chunks_exact_mut(hidden).zip(s.o.chunks_exact(hidden));
        for ((x, o), h) in rows.zip(s.h.chunks_exact_mut(hidden)) {
            add_rms_norm(x, o, &self.ffn_norm, c.rms_norm_eps, h);
        }
        self.gate.apply(&s.h, &mut s.gate)?;
        self.up.apply(&s.h, &mut s.up)?;
        silu_mul(&mut s.gate, &s.up);
        self.down.apply(&s.gate, &mut s.down)?;
        s.x.iter_mut().zip(&s.down).for_each(|(x, d)| *x += d);
        Ok(())
    }
}

/// A loaded Llama-family model.
#[derive(Debug)]
pub struct Llama {
    config: ModelConfig,
    rope: Rope,
    embed: Weight,
    layers: Vec<Layer>,
    final_norm: Vec<f32>,
    /// `None` when tied to the embedding.
    lm_head: Option<Weight>,
}

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
}

impl Llama {
    /// Loads (maps) every tensor the config implies, checking each shape.
    pub fn load(source: &dyn TensorSource, config: ModelConfig) -> Result<Llama, ModelError> {
        let c = &config;
        let (hidden, hd) = (c.hidden_size, c.head_dim);
        let (q_rows, kv_rows) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
        let bias = |id: TensorId| c.attention_bias.then_some(id);
        let norm = |id: TensorId| source.require_shape(id, 1, hidden)?.to_f32();
        let layers = (0..c.num_hidden_layers)
            .map(|l| {
                Ok(Layer {
                    attn_norm: norm(TensorId::AttnNorm(l))?,
                    q: Linear::load(
                        source,
                        TensorId::Q(l),
                        bias(TensorId::QBias(l)),
                        q_rows,
                        hidden,
                    )?,
                    k: Linear::load(
                        source,
                        TensorId::K(l),
                        bias(TensorId::KBias(l)),
                        kv_rows,
                        hidden,
                    )?,
                    v: Linear::load(
                        source,
                        TensorId::V(l),
                        bias(TensorId::VBias(l)),
                        kv_rows,
                        hidden,
                    )?,
                    o: Linear::load(source, TensorId::O(l), None, hidden, q_rows)?,
                    ffn_norm: norm(TensorId::FfnNorm(l))?,
                    gate: Linear::load(
                        source,
                        TensorId::Gate(l),
                        None,
                        c.intermediate_size,
                        hidden,
                    )?,
                    up: Linear::load(source, TensorId::Up(l), None, c.intermediate_size, hidden)?,
                    down: Linear::load(
                        source,
                        TensorId::Down(l),
                        None,
                        hidden,
                        c.intermediate_size,
                    )?,
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        let embed = source.require_shape(TensorId::Embed, c.vocab_size, hidden)?;
        let lm_head = match source.get(TensorId::LmHead)? {
            Some(w) => Some(check_shape(source.path(), w, c.vocab_size, hidden)?),
            None if c.tie_word_embeddings => None,
            None => {
                return Err(ModelError::MissingTensor {
                    path: source.path().into(),
                    tensor: TensorId::LmHead.hf_name(),
                });
            }
        };
        let rope = Rope::new(hd, c.rope.theta, &c.rope.scaling, c.rope.pairing);
        Ok(Llama {
            rope,
            embed,
            layers,
            final_norm: norm(TensorId::FinalNorm)?,
            lm_head,
            config,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Runs `tokens` (the next positions of `seq`) through the model, appends their K/V to
    /// the cache and returns the logits of the last token.
    pub fn forward(
        &self,
        tokens: &[u32],
        seq: &mut SeqCache,
        cache: &mut KvCache,
    ) -> Result<Vec<f32>, ModelError> {
        let c = &self.config;
        let n = tokens.len();
        if n == 0 {
            return Err(ModelError::InvalidRequest {
                message: "no tokens to run".into(),
            });
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(ModelError::InvalidRequest {
                message: format!(
                    "token id {bad} is outside the vocabulary of {}",
                    c.vocab_size
                ),
            });
        }
        let start = seq.len;
        cache.reserve(seq, start + n)?;
        let positions: Vec<usize> = (start..start + n).collect();
        let visible: Vec<usize> = positions.iter().map(|p| p + 1).collect();
        let tables = self.rope.tables(&positions);
        let hidden = c.hidden_size;
        let mut s = Scratch {
            x: vec![0.0; n * hidden],
            h: vec![0.0; n * hidden],
            ..Default::default()
        };
        let embed = self.embed.mat();
        for (t, x) in tokens.iter().zip(s.x.chunks_exact_mut(hidden)) {
            embed.dequantize_row(*t as usize, x)?;
        }
        let pass = Pass {
            config: c,
            rope: &self.rope,
            tables,
            positions,
            visible,
        };
        for (l, layer) in self.layers.iter().enumerate() {
            layer.run(l, &pass, &mut s, seq, cache)?;
        }
        seq.len = start + n;
        let last = &s.x[(n - 1) * hidden..];
        let mut normed = vec![0.0; hidden];
        rms_norm(last, &self.final_norm, c.rms_norm_eps, &mut normed);
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        let mut logits = vec![0.0; c.vocab_size];
        matmul(&head.mat(), &normed, &mut logits)?;
        Ok(logits)
    }
}
