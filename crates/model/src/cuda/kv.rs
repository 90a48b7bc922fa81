//! A rank's paged KV cache in device memory (bf16, or f32 on the exact path; the layout of
//! `attention.cu`: `[blocks][block_size][kv_heads][head_dim]` per layer), the activations
//! of one pass,
//! kept between passes of the same token count, and the buffers of a step's end
//! ([`StepBuffers`]), made with the cache, so that a decode step allocates nothing.

use tessera_kernels::attention::KvLayout;
use tessera_kernels::cuda::{CudaSlice, Held, Ops};

use super::DeviceDtype;
use super::step::{PassTiming, StepBuffers};
use crate::error::ModelError;
use crate::kv_cache::blocks_for_budget;

/// The K and V pools of every layer, of one value type: `[k, v]` a layer.
#[derive(Debug)]
pub(crate) enum Pools {
    Bf16(Vec<[CudaSlice<u16>; 2]>),
    /// The exact path's.
    F32(Vec<[CudaSlice<f32>; 2]>),
}

impl Pools {
    /// `layers` layers of `pool` values each, zeroed.
    fn new(
        ops: &Ops<'_>,
        dtype: DeviceDtype,
        layers: usize,
        pool: usize,
    ) -> Result<Pools, ModelError> {
        fn each<T: Held>(
            ops: &Ops<'_>,
            layers: usize,
            pool: usize,
        ) -> Result<Vec<[CudaSlice<T>; 2]>, ModelError> {
            (0..layers)
                .map(|_| Ok([ops.alloc(pool)?, ops.alloc(pool)?]))
                .collect()
        }
        Ok(match dtype {
            DeviceDtype::Bf16 => Pools::Bf16(each(ops, layers, pool)?),
            DeviceDtype::F32 => Pools::F32(each(ops, layers, pool)?),
        })
    }

    /// Layer `l`'s bf16 pools, for the kernels that read and write bf16 only (the fused
    /// path's); refused for an f32 cache.
    pub(crate) fn bf16(&mut self, l: usize) -> Result<&mut [CudaSlice<u16>; 2], ModelError> {
        match self {
            Pools::Bf16(p) => Ok(&mut p[l]),
            Pools::F32(_) => Err(ModelError::Plan {
                message: "a fused kernel over an f32 KV cache (the exact path runs the \
                          legacy launches)"
                    .into(),
            }),
        }
    }
}

/// K and V pools of every layer, on the device.
#[derive(Debug)]
pub struct DeviceKv {
    layout: KvLayout,
    num_blocks: usize,
    pub(crate) pools: Pools,
    pub(crate) scratch: Option<Box<Scratch>>,
    /// Captured decode passes over this cache.
    pub(crate) graphs: super::graph::DecodeGraphs,
    /// The end of every step: final-normed rows, logits, sampling.
    pub(crate) step: Box<StepBuffers>,
    /// Kernel launches of the last pass (cuBLAS calls counted one each).
    pub(crate) last_launches: u64,
    /// Device buffers the last pass allocated.
    pub(crate) last_allocations: u64,
    pub(crate) last_timing: PassTiming,
}

impl DeviceKv {
    /// A cache of values of `dtype`, as many blocks as `budget_bytes` holds for `layers`
    /// layers, with the step buffers `step`; refused when the budget is not free on the
    /// device (`free_bytes`, after the step buffers) or holds no block.
    pub(crate) fn new(
        ops: &Ops<'_>,
        (layout, dtype): (KvLayout, DeviceDtype),
        layers: usize,
        (budget_bytes, free_bytes): (usize, usize),
        step: StepBuffers,
    ) -> Result<DeviceKv, ModelError> {
        let value_bytes = dtype.kv_bytes();
        let num_blocks = blocks_for_budget(layout, layers, budget_bytes, value_bytes);
        let pool = num_blocks * layout.block_len();
        let bytes = 2 * layers * pool * value_bytes;
        if num_blocks == 0 {
            return Err(ModelError::Plan {
                message: format!(
                    "a KV budget of {budget_bytes} bytes holds no block of {} positions \
                     ({} bytes over {layers} layers)",
                    layout.block_size,
                    2 * layers * layout.block_len() * value_bytes
                ),
            });
        }
        if bytes > free_bytes {
            return Err(ModelError::Plan {
                message: format!(
                    "the KV budget needs {bytes} bytes of device memory; {free_bytes} are free \
                     after the weights and {} bytes of step buffers (lower kv_memory in the \
                     topology)",
                    step.device_bytes()
                ),
            });
        }
        Ok(DeviceKv {
            layout,
            num_blocks,
            pools: Pools::new(ops, dtype, layers, pool)?,
            scratch: None,
            graphs: super::graph::DecodeGraphs::from_env(),
            step: Box::new(step),
            last_launches: 0,
            last_allocations: 0,
            last_timing: PassTiming::default(),
        })
    }

    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// The type of its values.
    pub fn dtype(&self) -> DeviceDtype {
        match self.pools {
            Pools::Bf16(_) => DeviceDtype::Bf16,
            Pools::F32(_) => DeviceDtype::F32,
        }
    }

    /// Kernel launches of the last forward pass (a replayed graph counts one).
    pub fn last_launches(&self) -> u64 {
        self.last_launches
    }

    /// Device buffers the last forward pass allocated (0 for a decode step through a
    /// graph once its batch size is captured).
    pub fn last_allocations(&self) -> u64 {
        self.last_allocations
    }

    /// Where the host's time went in the last forward pass.
    pub fn last_timing(&self) -> PassTiming {
        self.last_timing
    }

    /// Rows that want logits a step may have before the step buffers grow.
    pub fn step_rows(&self) -> usize {
        self.step.rows()
    }
}

/// Widths of one pass's activations, per token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Widths {
    pub(crate) hidden: usize,
    pub(crate) q: usize,
    pub(crate) kv: usize,
    /// This rank's MLP rows.
    pub(crate) inter: usize,
    /// q, k and v come out of one stacked projection (the fused path).
    pub(crate) stacked_qkv: bool,
    /// q and k are RMS-normalized per head before RoPE (Qwen3): their projections write
    /// `q_pre` / `k_pre`, the norm writes `q` / `k`.
    pub(crate) qk_norm: bool,
}

/// The activations of a pass over `tokens` tokens.
#[derive(Debug)]
pub(crate) struct Scratch {
    pub(crate) tokens: usize,
    pub(crate) widths: Widths,
    /// The residual stream.
    pub(crate) x: CudaSlice<f32>,
    /// Normalized x, and its bf16 rounding.
    pub(crate) h: CudaSlice<f32>,
    pub(crate) h16: CudaSlice<u16>,
    /// The rotated queries (the legacy path's q projection, or `rope_kv_write`'s output).
    pub(crate) q: CudaSlice<f32>,
    pub(crate) k: CudaSlice<f32>,
    pub(crate) v: CudaSlice<f32>,
    /// The q and k projections' outputs before the per-head norm (Qwen3 only).
    pub(crate) q_pre: Option<CudaSlice<f32>>,
    pub(crate) k_pre: Option<CudaSlice<f32>>,
    /// The stacked q|k|v projection's output (the fused path only).
    pub(crate) qkv: Option<CudaSlice<f32>>,
    pub(crate) attn: CudaSlice<f32>,
    pub(crate) attn16: CudaSlice<u16>,
    /// The row-parallel outputs (o_proj, then down_proj), summed over the group.
    pub(crate) o: CudaSlice<f32>,
    pub(crate) gate_up: CudaSlice<f32>,
    pub(crate) act: CudaSlice<f32>,
    pub(crate) act16: CudaSlice<u16>,
    pub(crate) ids: CudaSlice<u32>,
    pub(crate) positions: CudaSlice<u32>,
}

impl Scratch {
    pub(crate) fn new(ops: &Ops<'_>, tokens: usize, w: Widths) -> Result<Scratch, ModelError> {
        Ok(Scratch {
            tokens,
            widths: w,
            x: ops.alloc(tokens * w.hidden)?,
            h: ops.alloc(tokens * w.hidden)?,
            h16: ops.alloc(tokens * w.hidden)?,
            q: ops.alloc(tokens * w.q)?,
            k: ops.alloc(tokens * w.kv)?,
            v: ops.alloc(tokens * w.kv)?,
            q_pre: w.qk_norm.then(|| ops.alloc(tokens * w.q)).transpose()?,
            k_pre: w.qk_norm.then(|| ops.alloc(tokens * w.kv)).transpose()?,
            qkv: if w.stacked_qkv {
                Some(ops.alloc(tokens * (w.q + 2 * w.kv))?)
            } else {
                None
            },
            attn: ops.alloc(tokens * w.q)?,
            attn16: ops.alloc(tokens * w.q)?,
            o: ops.alloc(tokens * w.hidden)?,
            gate_up: ops.alloc(tokens * 2 * w.inter)?,
            act: ops.alloc(tokens * w.inter)?,
            act16: ops.alloc(tokens * w.inter)?,
            ids: ops.alloc(tokens)?,
            positions: ops.alloc(tokens)?,
        })
    }
}
