//! A pass's layers on the device, launch by launch, as the launch plan lists them
//! ([`crate::launch_plan`]): the plan is the launch sequence, and every step is checked
//! to launch the kernels it counts, so the count a test takes of the plan without a GPU
//! is the count of what runs here.

use tessera_kernels::cuda::{
    Append, AttentionIndex, AttentionKernel, CudaError, CudaSlice, Ops, RopeKv, Slots,
};
use tessera_kernels::rope::RopeScaling;

use super::kv::{DeviceKv, Pools, Scratch};
use super::weights::{DeviceLinear, Input};
use super::{AttnIn, CudaLlama, DeviceDtype, DeviceLayer};
use crate::config::{Activation, ModelConfig};
use crate::error::ModelError;
use crate::launch_plan::{Biases, Launch, LayerShape, Norm, Proj, Rounded, layer_launches};
use crate::slice::SliceComm;

/// Refuses a model whose block the device launches do not compute, rather than run it
/// wrong: Gemma 2's GeGLU, post-norms, soft caps and embedding scale, and LongRoPE (its
/// frequencies change with a sequence's length and it scales cos/sin; the device rotates by
/// one fixed `inv_freq`). Sliding windows run: each layer's attention slides its own
/// ([`AttentionIndex::set_window`]). Phi-3 with plain RoPE is the Llama graph once its fused
/// q|k|v and gate|up are split at load, and runs.
pub(super) fn refuse_block(c: &ModelConfig) -> Result<(), ModelError> {
    let b = &c.block;
    let what = if matches!(c.rope.scaling, RopeScaling::LongRope(_)) {
        format!("LongRoPE ({:?}'s `longrope` rope scaling)", c.architecture)
    } else if b.activation != Activation::Silu
        || b.post_norms
        || b.attn_softcap.is_some()
        || b.final_softcap.is_some()
        || b.embed_scale.is_some()
    {
        format!(
            "the {:?} block (GeGLU, post-norms, soft caps)",
            c.architecture
        )
    } else {
        return Ok(());
    };
    Err(CudaError::Unsupported {
        what: format!("{what} on cuda shards; run this model's groups on cpu devices"),
    }
    .into())
}

/// `body` over layer `l`'s K and V pools (`&mut CudaSlice` of the cache's type), bf16 or
/// f32: one generic call, written once.
macro_rules! on_layer_pools {
    ($pools:expr, $l:expr, |$k:ident, $v:ident| $body:expr) => {
        match $pools {
            Pools::Bf16(p) => {
                let [$k, $v] = &mut p[$l];
                $body
            }
            Pools::F32(p) => {
                let [$k, $v] = &mut p[$l];
                $body
            }
        }
    };
}

/// The batch's attention inputs: its cache slots, its attention index, and whether it is
/// a decode step (every query the one new token of its sequence).
pub(super) struct PassBatch<'a> {
    pub(super) slots: &'a Slots,
    pub(super) index: &'a mut AttentionIndex,
    pub(super) decode: bool,
}

/// What the launches of a layer read and write.
struct Run<'r, 'c> {
    s: &'r mut Scratch,
    batch: &'r mut PassBatch<'r>,
    kv: &'r mut DeviceKv,
    comm: &'r mut SliceComm<'c>,
    /// The last row-parallel output (in `s.o`) not yet added to the residual stream.
    pending: bool,
}

impl DeviceLayer {
    /// The projection `p` of this layer; the stacked q|k|v only on the fused path, the
    /// separate ones only on the legacy path.
    fn proj(&self, p: Proj) -> Result<&DeviceLinear, ModelError> {
        let found = match (p, &self.attn_in) {
            (Proj::Q, AttnIn::Separate(qkv)) => Some(&qkv[0]),
            (Proj::K, AttnIn::Separate(qkv)) => Some(&qkv[1]),
            (Proj::V, AttnIn::Separate(qkv)) => Some(&qkv[2]),
            (Proj::Qkv, AttnIn::Stacked(qkv)) => Some(qkv),
            (Proj::O, _) => Some(&self.o),
            (Proj::GateUp, _) => Some(&self.gate_up),
            (Proj::Down, _) => Some(&self.down),
            _ => None,
        };
        found.ok_or_else(|| ModelError::Plan {
            message: format!("the launch plan asks for projection {p:?}, not uploaded"),
        })
    }

    /// Projections reading the normed rows.
    fn reads_hidden(&self) -> Vec<&DeviceLinear> {
        let mut all = self.attn_in.projections();
        all.push(&self.gate_up);
        all
    }
}

impl CudaLlama {
    /// The shape that decides a layer's launches for a pass of `tokens` tokens over
    /// `index`.
    pub(super) fn layer_shape(
        &self,
        index: &AttentionIndex,
        (tokens, decode): (usize, bool),
        tp: bool,
    ) -> LayerShape {
        // Every layer has the same projections and biases (a model without layers launches
        // none), but not the same types: a GGUF preset keeps some layers' projections in a
        // type the device reads quantized and others not, so the f32 rows a matvec reads
        // are written if any layer's does.
        let first = self.layers.first();
        let has_bias = |p: Proj| {
            first
                .and_then(|f| f.proj(p).ok())
                .is_some_and(|l| l.bias().is_some())
        };
        let quantized = |l: &DeviceLinear| l.is_quantized();
        // The stacked projection has one bias for q|k|v (zeros where a part has none).
        let stacked = has_bias(Proj::Qkv);
        // The flash kernel writes bf16 and never splits, as the grouped one unsplit; it
        // never serves a decode step (`AttentionKernel::for_decode`), so never appends.
        let grouped = index.kernel() != AttentionKernel::Legacy;
        LayerShape {
            path: self.path,
            biases: Biases {
                q: stacked || has_bias(Proj::Q),
                k: stacked || has_bias(Proj::K),
                v: stacked || has_bias(Proj::V),
                o: has_bias(Proj::O),
                gate_up: has_bias(Proj::GateUp),
                down: has_bias(Proj::Down),
            },
            f32_hidden: (self.layers.iter()).any(|l| l.reads_hidden().into_iter().any(quantized)),
            f32_activation: self.layers.iter().any(|l| quantized(&l.down)),
            grouped_attention: grouped,
            attention_split: !grouped || index.partitions() > 1,
            tensor_parallel: tp,
            decode,
            gemm: self.gemm.for_tokens(tokens),
            qk_norm: self.config.qk_norm(),
            exact: self.dtype == DeviceDtype::F32,
        }
    }

    /// Every layer over the batch, from the embedding of `s.ids` to the final norm (in
    /// `s.h`). Launches only: no allocation, no copy between host and device unless a
    /// collective stages through the host, so a decode pass can be captured in a graph.
    pub(super) fn pass(
        &self,
        ops: &Ops<'_>,
        s: &mut Scratch,
        batch: &mut PassBatch<'_>,
        kv: &mut DeviceKv,
        comm: &mut SliceComm<'_>,
    ) -> Result<(), ModelError> {
        let c = &self.config;
        let vocab_start = self.sharding.plan.vocab_rows.start as u32;
        self.embed.gather(ops, &mut s.x, &s.ids, vocab_start)?;
        self.all_reduce(ops, &mut s.x, comm)?;
        let shape = self.layer_shape(batch.index, (s.tokens, batch.decode), comm.world_size() > 1);
        let plan = layer_launches(&shape);
        let mut batch = PassBatch {
            slots: batch.slots,
            index: &mut *batch.index,
            decode: batch.decode,
        };
        let mut run = Run {
            s,
            batch: &mut batch,
            kv,
            comm,
            pending: false,
        };
        for (l, layer) in self.layers.iter().enumerate() {
            for &launch in &plan {
                let before = ops.launches();
                self.launch(ops, launch, l, layer, &mut run)?;
                let actual = ops.launches() - before;
                if actual != launch.kernels() {
                    return Err(ModelError::LaunchCount {
                        launch: launch.name(),
                        expected: launch.kernels(),
                        actual,
                    });
                }
            }
            run.pending = true;
        }
        let s = &mut *run.s;
        ops.rmsnorm_residual(
            &mut s.h,
            &mut s.x,
            run.pending.then_some(&s.o),
            &self.final_norm,
            c.rms_norm_eps,
        )?;
        Ok(())
    }

    /// One step of layer `l`'s plan.
    fn launch(
        &self,
        ops: &Ops<'_>,
        launch: Launch,
        l: usize,
        layer: &DeviceLayer,
        run: &mut Run<'_, '_>,
    ) -> Result<(), ModelError> {
        let eps = self.config.rms_norm_eps;
        let s = &mut *run.s;
        let norm_weight = |n: Norm| match n {
            Norm::Attention => &layer.attn_norm,
            Norm::Mlp => &layer.ffn_norm,
        };
        // What a norm adds first: the pending output before attention (none in the first
        // layer), o_proj's before the MLP.
        let adds = |n: Norm| n == Norm::Mlp || run.pending;
        match launch {
            Launch::Norm(n) => {
                let x = adds(n).then_some(&s.o);
                ops.rmsnorm_residual(&mut s.h, &mut s.x, x, norm_weight(n), eps)?;
            }
            Launch::NormBf16 { norm, f32_out } => {
                let x = adds(norm).then_some(&s.o);
                let out32 = f32_out.then_some(&mut s.h);
                ops.rmsnorm_residual_bf16(&mut s.h16, out32, &mut s.x, x, norm_weight(norm), eps)?;
            }
            Launch::RoundBf16(r) => match r {
                Rounded::Hidden => ops.round_bf16(&mut s.h16, &s.h)?,
                Rounded::Attention => ops.round_bf16(&mut s.attn16, &s.attn)?,
                Rounded::Activation => ops.round_bf16(&mut s.act16, &s.act)?,
            },
            Launch::Project(p, gemm) => {
                let (input, out) = io(s, p)?;
                layer.proj(p)?.apply(ops, (&self.blas, gemm), &input, out)?;
            }
            Launch::AddBias(p) => {
                let bias = layer.proj(p)?.bias().ok_or_else(|| ModelError::Plan {
                    message: format!("the launch plan adds a bias {p:?} does not have"),
                })?;
                ops.add_bias(io(s, p)?.1, bias)?;
            }
            Launch::QkNorm => {
                let norm = layer.qk_norm.as_ref().ok_or_else(|| ModelError::Plan {
                    message: "the launch plan asks for q/k norms the model does not have".into(),
                })?;
                let missing = || ModelError::Plan {
                    message: "the q/k norm's input buffers are missing".into(),
                };
                let q_pre = s.q_pre.as_mut().ok_or_else(missing)?;
                ops.rmsnorm_residual(&mut s.q, q_pre, None, &norm[0], eps)?;
                let k_pre = s.k_pre.as_mut().ok_or_else(missing)?;
                ops.rmsnorm_residual(&mut s.k, k_pre, None, &norm[1], eps)?;
            }
            Launch::Rope => ops.rope(
                &mut s.q,
                &mut s.k,
                &s.positions,
                &self.inv_freq,
                self.heads,
                self.kv_heads,
                self.pairing,
            )?,
            Launch::KvWrite => on_layer_pools!(&mut run.kv.pools, l, |k, v| {
                ops.kv_write(k, v, &s.k, &s.v, run.batch.slots, s.widths.kv)
            })?,
            Launch::RopeKvWrite { bias } => {
                let qkv_proj = layer.proj(Proj::Qkv)?;
                let bias = if bias { qkv_proj.bias() } else { None };
                let qkv = s.qkv.as_ref().ok_or_else(no_qkv)?;
                let [k, v] = run.kv.pools.bf16(l)?;
                let cache = (k, v);
                let rope = self.rope_kv(&s.positions);
                ops.rope_kv_write(&mut s.q, cache, qkv, bias, run.batch.slots, rope)?;
            }
            Launch::Attention {
                bf16_out,
                append,
                bias,
                ..
            } => {
                let layout = run.kv.layout();
                let out16 = bf16_out.then_some(&mut s.attn16);
                run.batch
                    .index
                    .set_window(self.config.block.attention(l).window)?;
                if append {
                    let bias = if bias {
                        layer.proj(Proj::Qkv)?.bias()
                    } else {
                        None
                    };
                    let append = Append {
                        qkv: s.qkv.as_ref().ok_or_else(no_qkv)?,
                        bias,
                        rope: self.rope_kv(&s.positions),
                        slots: run.batch.slots,
                    };
                    let [k, v] = run.kv.pools.bf16(l)?;
                    let cache = (k, v);
                    ops.paged_attention_append(
                        &mut s.attn,
                        out16,
                        cache,
                        layout,
                        run.batch.index,
                        append,
                    )?;
                } else {
                    let index = &mut *run.batch.index;
                    on_layer_pools!(&mut run.kv.pools, l, |k, v| {
                        let cache = (&*k, &*v);
                        ops.paged_attention_with_bf16(
                            &mut s.attn,
                            out16,
                            &s.q,
                            cache,
                            layout,
                            index,
                        )
                    })?;
                }
            }
            Launch::SiluMul => ops.silu_mul(&mut s.act, &s.gate_up, s.widths.inter)?,
            Launch::SiluMulBf16 { f32_out } => {
                let out32 = f32_out.then_some(&mut s.act);
                ops.silu_mul_bf16(&mut s.act16, out32, &s.gate_up, s.widths.inter)?;
            }
            Launch::AllReduce => self.all_reduce(ops, &mut s.o, run.comm)?,
        }
        Ok(())
    }

    /// The rotation of a `rope_kv_write` (or the attention's append) over `positions`.
    fn rope_kv<'a>(&'a self, positions: &'a CudaSlice<u32>) -> RopeKv<'a> {
        RopeKv {
            positions,
            inv_freq: &self.inv_freq,
            pairing: self.pairing,
            q_heads: self.heads,
            kv_heads: self.kv_heads,
        }
    }
}

/// Projection `p`'s input (the normed rows, the attention output or the activation) and
/// its output buffer, borrowed apart.
fn io(s: &mut Scratch, p: Proj) -> Result<(Input<'_>, &mut CudaSlice<f32>), ModelError> {
    let Scratch {
        h,
        h16,
        attn,
        attn16,
        act,
        act16,
        q,
        k,
        v,
        q_pre,
        k_pre,
        qkv,
        o,
        gate_up,
        ..
    } = s;
    let hidden = Input {
        f32: &*h,
        bf16: &*h16,
    };
    Ok(match p {
        // With per-head q/k norms the projections write the norm's input.
        Proj::Q => (hidden, q_pre.as_mut().unwrap_or(q)),
        Proj::K => (hidden, k_pre.as_mut().unwrap_or(k)),
        Proj::V => (hidden, v),
        Proj::Qkv => (hidden, qkv.as_mut().ok_or_else(no_qkv)?),
        Proj::O => (
            Input {
                f32: &*attn,
                bf16: &*attn16,
            },
            o,
        ),
        Proj::GateUp => (hidden, gate_up),
        Proj::Down => (
            Input {
                f32: &*act,
                bf16: &*act16,
            },
            o,
        ),
    })
}

fn no_qkv() -> ModelError {
    ModelError::Plan {
        message: "the fused path's q|k|v buffer is missing".into(),
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn fixture_config(rel: &str) -> ModelConfig {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/models");
        ModelConfig::from_path(&dir.join(rel)).unwrap()
    }

    /// Decided without a GPU: what a cuda shard refuses to run wrong, and that Phi-3 with
    /// plain RoPE, its 8-position window included, is not among it.
    #[test]
    fn longrope_and_gemma2_are_refused_plain_phi3_is_not() {
        let phi3 = fixture_config("phi3/f32");
        let e = refuse_block(&phi3).unwrap_err().to_string();
        assert!(e.contains("LongRoPE") && e.contains("cpu devices"), "{e}");
        let mut plain = phi3.clone();
        plain.rope.scaling = RopeScaling::None;
        assert_eq!(plain.block.shortest_window(), Some(8));
        refuse_block(&plain).unwrap();
        let e = refuse_block(&fixture_config("gemma2/f32"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("Gemma2 block"), "{e}");
    }
}
