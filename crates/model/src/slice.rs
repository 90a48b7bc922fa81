//! A rank's model slice on the device its shard runs on, and the KV cache that goes with
//! it: what a shard's engine drives, whichever the device.

#[cfg(feature = "cuda")]
use std::sync::Arc;

use tessera_comm::Collective;
#[cfg(feature = "cuda")]
use tessera_comm::nccl::NcclGroup;
#[cfg(feature = "cuda")]
use tessera_kernels::cuda::{CudaDevice, CudaStream};

use crate::config::ModelConfig;
#[cfg(feature = "cuda")]
use crate::cuda::{CudaLlama, DeviceKv};
use crate::error::ModelError;
use crate::kv_cache::{DEFAULT_BLOCK_SIZE, KvCache, SeqChunk};
use crate::llama::Llama;
use crate::rows::{RowOutput, RowRequest, check_requests, wanted_rows};

/// The weights of one rank, on the CPU or (feature `cuda`) on a CUDA device.
#[allow(clippy::large_enum_variant)] // one per process, never moved in a hot path
#[derive(Debug)]
pub enum ModelSlice {
    Cpu(Llama),
    #[cfg(feature = "cuda")]
    Cuda(CudaLlama),
}

/// The KV cache of a [`ModelSlice`]: host memory (f32) or device memory (bf16).
#[derive(Debug)]
pub enum SliceCache {
    Cpu(KvCache),
    #[cfg(feature = "cuda")]
    Cuda(DeviceKv),
}

/// The group's collective, as a forward pass takes it.
#[derive(Debug)]
pub enum SliceComm<'a> {
    /// A collective on host memory (shared memory, the TCP ring, the group of one). A pass
    /// on a GPU stages its all-reduces through the host.
    Host(&'a mut dyn Collective),
    /// The group's NCCL communicator: a pass on a GPU reduces device buffers where they
    /// are. Host buffers (the CPU pass, the logits' all-gather) go through its
    /// [`Collective`] side.
    #[cfg(feature = "cuda")]
    Nccl(&'a mut NcclGroup),
}

impl SliceComm<'_> {
    /// The group as a collective on host memory.
    pub fn host(&mut self) -> &mut dyn Collective {
        match self {
            SliceComm::Host(comm) => &mut **comm,
            #[cfg(feature = "cuda")]
            SliceComm::Nccl(group) => &mut **group,
        }
    }

    pub fn world_size(&self) -> usize {
        match self {
            SliceComm::Host(comm) => comm.world_size(),
            #[cfg(feature = "cuda")]
            SliceComm::Nccl(group) => group.world_size(),
        }
    }
}

impl ModelSlice {
    /// `llama` on the CPU, where it was loaded.
    pub fn cpu(llama: Llama) -> ModelSlice {
        ModelSlice::Cpu(llama)
    }

    /// `llama` uploaded to `device` (the host copy is dropped once uploaded).
    #[cfg(feature = "cuda")]
    pub fn upload(llama: Llama, device: Arc<CudaDevice>) -> Result<ModelSlice, ModelError> {
        Ok(ModelSlice::Cuda(CudaLlama::upload(&llama, device)?))
    }

    /// The device stream of a CUDA slice (`None` on the CPU).
    #[cfg(feature = "cuda")]
    pub fn cuda_stream(&self) -> Option<Arc<CudaStream>> {
        match self {
            ModelSlice::Cpu(_) => None,
            ModelSlice::Cuda(m) => Some(Arc::clone(m.stream())),
        }
    }

    /// Whether decode steps capture a CUDA graph per batch size the first time that size
    /// runs: a CUDA slice (unless `TESSERA_CUDA_GRAPHS=0`, when it runs them eagerly).
    pub fn captures_decode_graphs(&self) -> bool {
        match self {
            ModelSlice::Cpu(_) => false,
            #[cfg(feature = "cuda")]
            ModelSlice::Cuda(_) => true,
        }
    }

    pub fn config(&self) -> &ModelConfig {
        match self {
            ModelSlice::Cpu(m) => m.config(),
            #[cfg(feature = "cuda")]
            ModelSlice::Cuda(m) => m.config(),
        }
    }

    /// Bytes of weights this rank holds where it runs.
    pub fn weight_bytes(&self) -> usize {
        match self {
            ModelSlice::Cpu(m) => m.weight_bytes(),
            #[cfg(feature = "cuda")]
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
            #[cfg(feature = "cuda")]
            ModelSlice::Cuda(m) => Ok(SliceCache::Cuda(m.new_cache(budget_bytes)?)),
        }
    }

    /// One batched forward pass (see [`Llama::forward_batch`]), each row that wants logits
    /// answered as `requests` (one per row, in batch order) asks. The CPU gives every row
    /// its logits; a GPU of a one-rank group samples the rows with a draw where their
    /// logits are (see [`RowRequest`]).
    pub fn forward_rows(
        &self,
        batch: &[SeqChunk<'_>],
        cache: &mut SliceCache,
        comm: &mut SliceComm<'_>,
        requests: &[RowRequest],
    ) -> Result<Vec<RowOutput>, ModelError> {
        match (self, cache) {
            (ModelSlice::Cpu(m), SliceCache::Cpu(c)) => {
                check_requests(requests.len(), wanted_rows(batch))?;
                let logits = m.forward_batch(batch, c, comm.host())?;
                Ok(logits.into_iter().map(RowOutput::Logits).collect())
            }
            #[cfg(feature = "cuda")]
            (ModelSlice::Cuda(m), SliceCache::Cuda(c)) => m.forward_rows(batch, c, comm, requests),
            #[cfg(feature = "cuda")]
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
            #[cfg(feature = "cuda")]
            SliceCache::Cuda(c) => c.num_blocks(),
        }
    }

    pub fn block_size(&self) -> usize {
        match self {
            SliceCache::Cpu(c) => c.layout().block_size,
            #[cfg(feature = "cuda")]
            SliceCache::Cuda(c) => c.layout().block_size,
        }
    }
}
