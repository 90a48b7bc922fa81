//! What a cuda shard holds its matrices and KV cache in: bf16, the GPU default, or f32,
//! the exact path that the topology's `dtype = "f32"` asks for.
//!
//! The exact path computes what the CPU's f32 pass computes, in the same order of
//! operations per token: f32 weights (quantized ones dequantized to f32 at upload), f32
//! GEMMs on cuBLAS without TF32 (`Blas::gemm_f32`), an f32 KV cache, the legacy launch
//! sequence with no `round_bf16`, and the legacy attention kernel (the only one that reads
//! an f32 cache). Its logits then differ from the CPU's only by the order of the sums.

use std::fmt;

use tessera_kernels::DType;
use tessera_kernels::cuda::AttentionKernel;
use tracing::info;

use crate::launch_plan::{Gemm, KernelPath};
use crate::llama::Llama;

/// The type of a cuda shard's matrices and KV cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeviceDtype {
    /// bf16 matrices (Q8_0, Q5_0, Q4_K, Q5_K, Q6_K and FP8 ones kept quantized) and a bf16 KV cache.
    #[default]
    Bf16,
    /// f32 matrices, GEMMs and KV cache (`dtype = "f32"`).
    F32,
}

impl DeviceDtype {
    /// The type for `llama`: f32 when the topology held its matrices in f32
    /// ([`Llama::held`]), else bf16, so that an f32 checkpoint loaded with `auto` runs in
    /// bf16 on a GPU.
    pub fn of(llama: &Llama) -> DeviceDtype {
        match llama.held() {
            Some(DType::F32) => DeviceDtype::F32,
            _ => DeviceDtype::Bf16,
        }
    }

    /// Bytes per value of the KV cache.
    pub fn kv_bytes(self) -> usize {
        match self {
            DeviceDtype::Bf16 => 2,
            DeviceDtype::F32 => 4,
        }
    }

    /// The launch sequence, attention kernel and projection kernel this type runs, given
    /// those asked for (`TESSERA_FUSED`, `TESSERA_ATTENTION`, `TESSERA_GEMV`): bf16 runs
    /// them; f32 runs the legacy ones and cuBLAS, the only kernels that read f32, and says
    /// so in a log line when something else was asked for.
    pub(super) fn fit(
        self,
        (path, attention, gemm): (KernelPath, AttentionKernel, Gemm),
    ) -> (KernelPath, AttentionKernel, Gemm) {
        let exact = (KernelPath::Legacy, AttentionKernel::Legacy, Gemm::Cublas);
        match self {
            DeviceDtype::Bf16 => (path, attention, gemm),
            DeviceDtype::F32 => {
                if (path, attention, gemm) != exact {
                    info!(
                        asked_path = %path,
                        asked_attention = %attention,
                        asked_gemm = %gemm,
                        "dtype = \"f32\": the legacy path, the legacy attention kernel and \
                         cuBLAS run (no other kernel reads f32)"
                    );
                }
                exact
            }
        }
    }
}

impl fmt::Display for DeviceDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DeviceDtype::Bf16 => "bf16",
            DeviceDtype::F32 => "f32",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only an f32 held on purpose runs exact: the f32 checkpoint loaded with `auto` runs
    /// bf16, as does one held in bf16.
    #[test]
    fn the_topologys_f32_alone_picks_the_exact_path() {
        use tessera_topology::ModelDtype;
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let path = dir.join("../../fixtures/models/llama-gqa/f32");
        for (dtype, want) in [
            (ModelDtype::Auto, DeviceDtype::Bf16),
            (ModelDtype::Bf16, DeviceDtype::Bf16),
            (ModelDtype::F32, DeviceDtype::F32),
        ] {
            let mut llama = crate::loader::load_weights(&path).unwrap();
            llama.hold_as(dtype).unwrap();
            assert_eq!(DeviceDtype::of(&llama), want, "{dtype:?}");
        }
    }

    #[test]
    fn the_exact_path_runs_only_the_kernels_that_read_f32() {
        let asked = (KernelPath::Fused, AttentionKernel::Flash, Gemm::Gemv);
        assert_eq!(DeviceDtype::Bf16.fit(asked), asked);
        assert_eq!(
            DeviceDtype::F32.fit(asked),
            (KernelPath::Legacy, AttentionKernel::Legacy, Gemm::Cublas)
        );
        assert_eq!(
            (DeviceDtype::Bf16.kv_bytes(), DeviceDtype::F32.kv_bytes()),
            (2, 4)
        );
    }
}
