//! The Llama-family forward pass on one CUDA device: [`CudaLlama`] holds one rank's slice
//! of the weights in device memory (uploaded from a loaded [`Llama`]) and runs a batch
//! through every layer on one stream, with the KV cache in device memory ([`DeviceKv`]).
//!
//! The graph is [`Llama::forward_batch`]'s: embedding gather, fused residual + RMSNorm,
//! q/k/v projections, RoPE, KV write, paged attention (`TESSERA_ATTENTION`), o_proj, the
//! fused gate|up projection, SiLU·mul, down_proj. Each layer runs its launch plan
//! ([`crate::launch_plan`], the executor in `layer`): the legacy sequence, or with
//! `TESSERA_FUSED=1` the fused one (q|k|v stacked, norms and SiLU·mul writing bf16, RoPE,
//! bias and KV write in one kernel or inside the decode attention). Projections are bf16
//! GEMMs on cuBLAS (f32 sums; with `TESSERA_GEMV=1`, batches of at most 8 tokens run the
//! bf16 GEMV kernel) or dequantizing matvecs for Q8_0, Q5_0, Q4_K, Q5_K, Q6_K and FP8 weights. Activations
//! and the residual stream are f32; the KV cache is bf16. A model held in f32 by the
//! topology (`dtype = "f32"`) runs the exact path instead ([`DeviceDtype`]): f32 weights,
//! GEMMs and KV cache.
//!
//! Between ranks, the pass takes its group's collective as a [`SliceComm`]: an NCCL group
//! all-reduces the device buffers where they are; a host
//! [`Collective`](tessera_comm::Collective) is staged through it (device → host → ring →
//! device), which lets tp > 1 run on one GPU. The logits' all-gather goes through the host.
//!
//! A pass ends as the step runner asks for each row that wants logits ([`RowRequest`]):
//! with tp = 1 the device samples those rows and only their token ids cross to the host
//! (`step`); every other row's logits cross.

mod dtype;
mod graph;
mod kv;
mod layer;
mod step;
mod switches;
mod weights;

use std::sync::Arc;
use std::time::Instant;

use tessera_kernels::attention::KvLayout;
use tessera_kernels::cuda::{
    AttentionKernel, AttentionTarget, Blas, CudaDevice, CudaError, CudaSlice, CudaStream, Ops,
};
use tessera_kernels::rope::RopePairing;
use tracing::info;

use crate::batch::BatchIndex;
use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::kv_cache::{DEFAULT_BLOCK_SIZE, SeqChunk};
use crate::launch_plan::{Gemm, KernelPath};
use crate::llama::{Linear, Llama, Sharding, check_kv_layout};
use crate::rows::{RowOutput, RowRequest, check_requests, wanted_rows};
use crate::slice::SliceComm;
pub use dtype::DeviceDtype;
pub use kv::DeviceKv;
use kv::{Scratch, Widths};
use layer::PassBatch;
use step::StepBuffers;
pub use step::{DEFAULT_STEP_ROWS, PassTiming};
use switches::{attention_from_env, gemm_from_env, path_from_env};
use weights::{DeviceLinear, Input};

/// The projections attention reads: q, k and v separately (the legacy path), or stacked
/// into one (the fused path: each token's output is its q rows, then k, then v, and so is
/// the bias).
#[derive(Debug)]
enum AttnIn {
    /// q, k and v, in that order.
    Separate(Box<[DeviceLinear; 3]>),
    Stacked(DeviceLinear),
}

impl AttnIn {
    /// Every projection of the attention's input.
    fn projections(&self) -> Vec<&DeviceLinear> {
        match self {
            AttnIn::Separate(qkv) => qkv.iter().collect(),
            AttnIn::Stacked(qkv) => vec![qkv],
        }
    }
}

/// One decoder block on the device.
#[derive(Debug)]
struct DeviceLayer {
    attn_norm: CudaSlice<f32>,
    attn_in: AttnIn,
    /// Qwen3's per-head q and k norm weights (`head_dim` each).
    qk_norm: Option<Box<[CudaSlice<f32>; 2]>>,
    o: DeviceLinear,
    ffn_norm: CudaSlice<f32>,
    /// gate_proj and up_proj stacked: each token's output is its gate rows, then its up rows.
    gate_up: DeviceLinear,
    down: DeviceLinear,
}

/// One rank's slice of a Llama-family model on a CUDA device.
pub struct CudaLlama {
    device: Arc<CudaDevice>,
    stream: Arc<CudaStream>,
    blas: Blas,
    config: ModelConfig,
    sharding: Sharding,
    /// This rank's query and KV heads.
    heads: usize,
    kv_heads: usize,
    /// This rank's vocabulary rows of the embedding, bf16 (the gather kernel's table).
    embed: DeviceLinear,
    layers: Vec<DeviceLayer>,
    final_norm: CudaSlice<f32>,
    /// `None` when tied to the embedding.
    lm_head: Option<DeviceLinear>,
    inv_freq: CudaSlice<f32>,
    pairing: u32,
    /// The paged-attention kernel of every pass (`TESSERA_ATTENTION`, fitted to the shape).
    attention: AttentionKernel,
    /// The launch sequence of every layer (`TESSERA_FUSED`).
    path: KernelPath,
    /// The kernel of the bf16 projections of small batches (`TESSERA_GEMV`; a batch
    /// of more than [`crate::launch_plan::GEMV_MAX_TOKENS`] tokens runs on cuBLAS whatever it says).
    gemm: Gemm,
    /// What the matrices and the KV cache are held in.
    dtype: DeviceDtype,
}

impl std::fmt::Debug for CudaLlama {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaLlama")
            .field("device", &self.device)
            .field("rank", &self.sharding.plan.rank)
            .field("tp", &self.sharding.tp)
            .field("layers", &self.layers.len())
            .field("device_bytes", &self.device_bytes())
            .finish()
    }
}

/// A weight with no bias, as a projection.
fn bare(weight: &crate::weights::Weight) -> Linear {
    Linear {
        weight: weight.clone(),
        bias: None,
    }
}

impl CudaLlama {
    /// Uploads `llama`'s slice to `device` for the launch sequence `TESSERA_FUSED` names;
    /// the host copy can be dropped afterwards.
    pub fn upload(llama: &Llama, device: Arc<CudaDevice>) -> Result<CudaLlama, ModelError> {
        CudaLlama::upload_for(llama, device, path_from_env()?)
    }

    /// [`CudaLlama::upload`] for the launch sequence `path` (the fused path stacks q, k
    /// and v into one projection, so the weights differ): for tests and benchmarks that
    /// run both in one process.
    pub fn upload_for(
        llama: &Llama,
        device: Arc<CudaDevice>,
        path: KernelPath,
    ) -> Result<CudaLlama, ModelError> {
        layer::refuse_block(&llama.config)?;
        let dtype = DeviceDtype::of(llama);
        // The fused kernels apply no q/k norm (the log below names the path that runs).
        let asked = (
            path.serving(llama.config.qk_norm()),
            attention_from_env()?,
            gemm_from_env()?,
        );
        let (path, requested, gemm) = dtype.fit(asked);
        let stream = device
            .context()
            .new_stream()
            .map_err(|e| CudaError::Device {
                ordinal: device.ordinal(),
                message: format!("creating a stream: {e}"),
            })?;
        let blas = Blas::new(device.ordinal(), Arc::clone(&stream))?;
        let ops = Ops::new(&device, Arc::clone(&stream));
        let converted = match dtype {
            DeviceDtype::Bf16 => weights::dequantized_at_upload(llama.projection_weights()),
            DeviceDtype::F32 => Vec::new(),
        };
        if !converted.is_empty() {
            let names: Vec<&str> = converted.iter().map(|d| d.name()).collect();
            info!(
                types = %names.join(", "),
                "no device kernel reads these weight types: dequantized to bf16 at upload"
            );
        }
        let mut layers = Vec::with_capacity(llama.layers.len());
        for layer in &llama.layers {
            let attn_in = match path {
                KernelPath::Legacy => AttnIn::Separate(Box::new([
                    DeviceLinear::upload(&ops, &[&layer.q], (dtype, true))?,
                    DeviceLinear::upload(&ops, &[&layer.k], (dtype, true))?,
                    DeviceLinear::upload(&ops, &[&layer.v], (dtype, true))?,
                ])),
                KernelPath::Fused => AttnIn::Stacked(DeviceLinear::upload(
                    &ops,
                    &[&layer.q, &layer.k, &layer.v],
                    (dtype, true),
                )?),
            };
            let qk_norm = match (&layer.q_norm, &layer.k_norm) {
                (Some(q), Some(k)) => Some(Box::new([ops.upload(q)?, ops.upload(k)?])),
                _ => None,
            };
            layers.push(DeviceLayer {
                attn_norm: ops.upload(&layer.attn_norm)?,
                attn_in,
                qk_norm,
                o: DeviceLinear::upload(&ops, &[&layer.o], (dtype, true))?,
                ffn_norm: ops.upload(&layer.ffn_norm)?,
                gate_up: DeviceLinear::upload(&ops, &[&layer.gate, &layer.up], (dtype, true))?,
                down: DeviceLinear::upload(&ops, &[&layer.down], (dtype, true))?,
            });
        }
        let embed = DeviceLinear::upload(&ops, &[&bare(&llama.embed)], (dtype, false))?;
        let lm_head = match &llama.lm_head {
            Some(w) => Some(DeviceLinear::upload(&ops, &[&bare(w)], (dtype, true))?),
            None => None,
        };
        let c = &llama.config;
        let plan = &llama.sharding.plan;
        let pairing = match c.rope.pairing {
            RopePairing::Halves => 0,
            RopePairing::Interleaved => 1,
        };
        let final_norm = ops.upload(&llama.final_norm)?;
        let inv_freq = ops.upload(llama.rope.inv_freq())?;
        ops.synchronize()?;
        drop(ops);
        let heads = plan.heads.len();
        let layout = KvLayout {
            block_size: DEFAULT_BLOCK_SIZE,
            kv_heads: plan.kv_heads.len(),
            head_dim: c.head_dim,
        };
        let attention = requested.for_shape(layout, heads);
        if attention != requested {
            info!(
                head_dim = c.head_dim,
                heads,
                kv_heads = layout.kv_heads,
                "the grouped attention kernel does not serve this shape: the legacy one runs"
            );
        }
        let model = CudaLlama {
            attention,
            path,
            gemm,
            dtype,
            blas,
            config: c.clone(),
            sharding: llama.sharding.clone(),
            heads,
            kv_heads: layout.kv_heads,
            embed,
            final_norm,
            lm_head,
            inv_freq,
            pairing,
            layers,
            stream,
            device,
        };
        info!(
            device = %model.device.name(),
            rank = %plan.rank,
            attention = %model.attention,
            path = %model.path,
            gemm = %model.gemm,
            dtype = %model.dtype,
            device_bytes = model.device_bytes(),
            "model slice on the device"
        );
        Ok(model)
    }

    /// Bytes of weights in device memory.
    pub fn device_bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                let mut projections = l.attn_in.projections();
                projections.extend([&l.o, &l.gate_up, &l.down]);
                let qk_norm = l.qk_norm.as_ref().map_or(0, |n| n[0].len() + n[1].len());
                4 * (l.attn_norm.len() + l.ffn_norm.len() + qk_norm)
                    + projections.iter().map(|p| p.device_bytes()).sum::<usize>()
            })
            .sum();
        layers
            + self.embed.device_bytes()
            + self.lm_head.as_ref().map_or(0, DeviceLinear::device_bytes)
            + 4 * (self.final_norm.len() + self.inv_freq.len())
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn device(&self) -> &CudaDevice {
        &self.device
    }

    /// The stream every kernel of this model runs on (an NCCL group joins on it, so that
    /// its collectives are ordered with the kernels).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Bytes one decode step reads from device memory for its weights: every projection,
    /// norm and the LM head (the embedding gather reads only the batch's rows).
    pub fn weight_bytes_per_step(&self) -> usize {
        let untied_embedding = self
            .lm_head
            .as_ref()
            .map_or(0, |_| self.embed.device_bytes());
        self.device_bytes() - untied_embedding
    }

    /// This rank's KV layout: its own KV heads, [`DEFAULT_BLOCK_SIZE`] positions a block.
    pub fn kv_layout(&self) -> KvLayout {
        KvLayout {
            block_size: DEFAULT_BLOCK_SIZE,
            kv_heads: self.kv_heads,
            head_dim: self.config.head_dim,
        }
    }

    /// The paged-attention kernel this model's passes run.
    pub fn attention(&self) -> AttentionKernel {
        self.attention
    }

    /// The launch sequence this model's layers run.
    pub fn path(&self) -> KernelPath {
        self.path
    }

    /// What the matrices and the KV cache are held in (f32: the exact path).
    pub fn dtype(&self) -> DeviceDtype {
        self.dtype
    }

    /// The kernel of the bf16 projections of batches of at most [`crate::launch_plan::GEMV_MAX_TOKENS`]
    /// tokens (larger ones always run on cuBLAS).
    pub fn gemm(&self) -> Gemm {
        self.gemm
    }

    /// This model with `gemm` for the bf16 projections of small batches: for tests and
    /// benchmarks that run both in one process. Call it before making caches: a cache's
    /// decode graphs keep the kernels they were captured with.
    pub fn with_gemm(mut self, gemm: Gemm) -> CudaLlama {
        self.gemm = gemm;
        self
    }

    /// This model with `kernel` for attention where it serves the model's shape, the legacy
    /// kernel where not (as at upload): for tests and benchmarks that run both kernels in
    /// one process. Call it before making caches: a cache's decode graphs keep the kernel
    /// they were captured with.
    pub fn with_attention(mut self, kernel: AttentionKernel) -> CudaLlama {
        self.attention = kernel.for_shape(self.kv_layout(), self.heads);
        self
    }

    /// What an attention index over `kv` is made for: this model's query heads and kernel
    /// (for a `decode` step, [`AttentionKernel::for_decode`]), split as the device's
    /// multiprocessors ask.
    fn attention_target(&self, kv: &DeviceKv, decode: bool) -> AttentionTarget {
        let kernel = if decode {
            self.attention.for_decode(kv.layout(), self.heads)
        } else {
            self.attention
        };
        AttentionTarget {
            layout: kv.layout(),
            cache_blocks: kv.num_blocks(),
            q_heads: self.heads,
            kernel,
            partitions: None,
        }
    }

    /// A KV cache of as many blocks as `budget_bytes` holds (bf16, or f32 on the exact
    /// path), in device memory, with the buffers of a step's end for [`DEFAULT_STEP_ROWS`]
    /// rows.
    pub fn new_cache(&self, budget_bytes: usize) -> Result<DeviceKv, ModelError> {
        let ops = self.ops();
        let step = StepBuffers::new(
            &ops,
            DEFAULT_STEP_ROWS,
            self.config.hidden_size,
            self.head().rows,
        )?;
        ops.synchronize()?;
        DeviceKv::new(
            &ops,
            (self.kv_layout(), self.dtype),
            self.config.num_hidden_layers,
            (budget_bytes, self.device.free_memory()?),
            step,
        )
    }

    fn ops(&self) -> Ops<'_> {
        Ops::new(&self.device, Arc::clone(&self.stream))
    }

    /// [`Llama::forward_batch`] on the device: the same batch, the same collective calls
    /// in the same order, the logits of every chunk that asks for them.
    pub fn forward_batch(
        &self,
        batch: &[SeqChunk<'_>],
        kv: &mut DeviceKv,
        comm: &mut SliceComm<'_>,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let requests = vec![RowRequest::LOGITS; wanted_rows(batch)];
        let rows = self.forward_rows(batch, kv, comm, &requests)?;
        Ok(rows
            .into_iter()
            .filter_map(RowOutput::into_logits)
            .collect())
    }

    /// [`CudaLlama::forward_batch`], each row that wants logits finished as its request
    /// (one per row, in batch order) asks: with tp = 1, a row with a draw is sampled on the
    /// device and only its token (and its logits, where asked) comes back; every other
    /// row's logits come back. Records the pass's launches, allocations and timing.
    pub fn forward_rows(
        &self,
        batch: &[SeqChunk<'_>],
        kv: &mut DeviceKv,
        comm: &mut SliceComm<'_>,
        requests: &[RowRequest],
    ) -> Result<Vec<RowOutput>, ModelError> {
        let started = Instant::now();
        let c = &self.config;
        self.sharding.check_collective(comm.host())?;
        let layout = kv.layout();
        let ix = BatchIndex::checked(batch, c.vocab_size, (layout.block_size, kv.num_blocks()))?;
        check_requests(requests.len(), ix.wanted.len())?;
        check_kv_layout(self.kv_layout(), layout)?;
        let ops = self.ops();
        kv.step.fit(&ops, ix.wanted.len())?;
        let graph = self.decode_by_graph(&ops, &ix, kv, comm.host())?;
        if graph.is_none() {
            let (n, widths) = (ix.tokens.len(), self.widths());
            let mut s = match kv.scratch.take() {
                Some(s) if s.tokens == n && s.widths == widths => s,
                _ => Box::new(Scratch::new(&ops, n, widths)?),
            };
            let result = self.eager(&ops, &ix, &mut s, kv, comm);
            kv.scratch = Some(s);
            result?;
        }
        let (rows, device_wait) = if ix.wanted.is_empty() {
            (Vec::new(), std::time::Duration::ZERO) // nothing waits for the device
        } else {
            let logits = match graph {
                Some(i) => kv.graphs.logits(i),
                None => &kv.step.logits,
            };
            self.finish(&ops, logits, requests, &mut kv.step.finish, comm.host())?
        };
        kv.last_launches = ops.launches();
        kv.last_allocations = ops.allocations();
        kv.last_timing = PassTiming {
            wall: started.elapsed(),
            device_wait,
        };
        Ok(rows)
    }

    fn widths(&self) -> Widths {
        let c = &self.config;
        Widths {
            hidden: c.hidden_size,
            q: self.heads * c.head_dim,
            kv: self.kv_heads * c.head_dim,
            inter: self.sharding.plan.mlp_rows.len(),
            stacked_qkv: self.path == KernelPath::Fused,
            qk_norm: c.qk_norm(),
        }
    }

    /// The LM head: this rank's vocabulary rows (the embedding's when tied).
    fn head(&self) -> &DeviceLinear {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// The batch launched kernel by kernel; the logits of the wanted tokens in the first
    /// rows of the step buffers.
    fn eager(
        &self,
        ops: &Ops<'_>,
        ix: &BatchIndex,
        s: &mut Scratch,
        kv: &mut DeviceKv,
        comm: &mut SliceComm<'_>,
    ) -> Result<(), ModelError> {
        let layout = kv.layout();
        ops.copy_to_device(&ix.tokens, &mut s.ids)?;
        ops.copy_to_device(&ix.positions, &mut s.positions)?;
        let slots = ops.slots(&ix.slots, kv.num_blocks() * layout.block_size)?;
        let decode = ix.one_token_per_sequence();
        let target = self.attention_target(kv, decode);
        let mut index = ops.attention_index(
            &ix.tables,
            ix.max_blocks,
            &ix.query_seq,
            &ix.contexts,
            target,
        )?;
        let mut batch = PassBatch {
            slots: &slots,
            index: &mut index,
            decode,
        };
        self.pass(ops, s, &mut batch, kv, comm)?;
        if ix.wanted.is_empty() {
            return Ok(());
        }
        self.logits(ops, s, &ix.wanted, &mut kv.step)
    }

    /// This rank's vocabulary rows of the logits of the `wanted` rows of `s.h`, into the
    /// first rows of `step`'s logits: gathered, rounded and projected on prefixes of
    /// buffers sized for the largest step.
    fn logits(
        &self,
        ops: &Ops<'_>,
        s: &Scratch,
        wanted: &[usize],
        step: &mut StepBuffers,
    ) -> Result<(), ModelError> {
        let hidden = self.config.hidden_size;
        let head = self.head();
        let n = wanted.len();
        ops.gather_rows(&mut step.normed, &s.h, wanted, hidden)?;
        let normed = step.normed.slice(..n * hidden);
        let mut normed16 = step.normed16.slice_mut(..n * hidden);
        if !head.is_f32() {
            ops.round_bf16(&mut normed16, &normed)?;
        }
        let input = Input {
            f32: &normed,
            bf16: &normed16,
        };
        head.apply(
            ops,
            (&self.blas, self.gemm.for_tokens(n)),
            &input,
            &mut step.logits.slice_mut(..n * head.rows),
        )?;
        Ok(())
    }

    /// Sums `buf` over the group: on the device through NCCL, else through the host
    /// (nothing to do for tp = 1).
    fn all_reduce(
        &self,
        ops: &Ops<'_>,
        buf: &mut CudaSlice<f32>,
        comm: &mut SliceComm<'_>,
    ) -> Result<(), ModelError> {
        if comm.world_size() == 1 {
            return Ok(());
        }
        match comm {
            SliceComm::Nccl(nccl) => nccl
                .all_reduce_sum(buf)
                .map_err(|e| e.in_op(tessera_comm::collective::Op::AllReduce).into()),
            SliceComm::Host(host_comm) => {
                let mut host = ops.download(buf)?;
                host_comm.all_reduce_sum(&mut host)?;
                ops.copy_to_device(&host, buf)?;
                Ok(())
            }
        }
    }
}
