//! A rank's model slice on the device its shard runs on, and the KV cache that goes with
//! it: what a shard's engine drives, whichever the device.

use std::sync::Arc;

use tessera_comm::Collective;
use tessera_kernels::cuda::CudaDevice;

use crate::config::ModelConfig;
use crate::cuda::{CudaLlama, DeviceKv};
use crate::error::ModelError;
use crate::kv_cache::{DEFAULT_BLOCK_SIZE, KvCache, SeqChunk};
use crate::llama::Llama;

/// The weights of one rank, on the CPU or on a CUDA device.
#[allow(clippy::large_enum_variant)] // one per process, never moved in a hot path
#[derive(Debug)]
pub enum ModelSlice {
    Cpu(Llama),
    Cuda(CudaLlama),
}

/// The KV cache of a [`ModelSlice`]: host memory (f32) or device memory (bf16).
#[derive(Debug)]
pub enum SliceCache {
    Cpu(KvCache),
    Cuda(DeviceKv),
}

impl ModelSlice {
    /// `llama` where it is (`device` `None`), or uploaded to `device` (the host copy is
    /// dropped once uploaded).
    pub fn place(llama: Llama, device: Option<Arc<CudaDevice>>) -> Result<ModelSlice, ModelError> {
        match device {
            None => Ok(ModelSlice::Cpu(llama)),
            Some(device) => Ok(ModelSlice::Cuda(CudaLlama::upload(&llama, device)?)),
        }
    }

    /// The device stream of a CUDA slice (`None` on the CPU).
    pub fn cuda_stream(&self) -> Option<Arc<tessera_kernels::cuda::CudaStream>> {
        match self {
            ModelSlice::Cpu(_) => None,
            ModelSlice::Cuda(m) => Some(Arc::clone(m.stream())),
        }
    }

    pub fn config(&self) -> &ModelConfig {
        match self {
            ModelSlice::Cpu(m) => m.config(),
            ModelSlice::Cuda(m) => m.config(),
        }
    }

    /// Bytes of weights this rank holds where it runs.
    pub fn weight_bytes(&self) -> usize {
        match self {
            ModelSlice::Cpu(m) => m.weight_bytes(),
            ModelSlice::Cuda(m) => m.device_bytes(),
        }
    }

    /// A KV cache of as many [`DEFAULT_BLOCK_SIZE`]-position blocks as `budget_bytes`
    /// holds. On the CPU a budget too small for one block gives an empty cache (the
    /// scheduler then admits nothing); on a GPU it is an error, as is a budget larger than
    /// the device's free memory.
    pub fn new_cache(&self, budget_bytes: usize) -> Result<SliceCache, ModelError> {
        match self {
            ModelSlice::Cpu(m) => {
                let layout = m.kv_layout(DEFAULT_BLOCK_SIZE);
                let layers = m.config().num_hidden_layers;
                let blocks = KvCache::blocks_for_budget(layout, layers, budget_bytes);
                Ok(SliceCache::Cpu(KvCache::new(layout, layers, blocks)))
            }
            ModelSlice::Cuda(m) => Ok(SliceCache::Cuda(m.new_cache(budget_bytes)?)),
        }
    }

    /// One batched forward pass (see [`Llama::forward_batch`]).
    pub fn forward_batch(
        &self,
        batch: &[SeqChunk<'_>],
        cache: &mut SliceCache,
        comm: &mut dyn Collective,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        match (self, cache) {
            (ModelSlice::Cpu(m), SliceCache::Cpu(c)) => m.forward_batch(batch, c, comm),
            (ModelSlice::Cuda(m), SliceCache::Cuda(c)) => m.forward_batch(batch, c, comm),
            _ => Err(ModelError::Plan {
                message: "the KV cache is on another device than the model".into(),
            }),
        }
    }
}

impl SliceCache {
    pub fn num_blocks(&self) -> usize {
        match self {
            SliceCache::Cpu(c) => c.num_blocks(),
            SliceCache::Cuda(c) => c.num_blocks(),
        }
    }

    pub fn block_size(&self) -> usize {
        match self {
            SliceCache::Cpu(c) => c.layout().block_size,
            SliceCache::Cuda(c) => c.layout().block_size,
        }
    }
}
