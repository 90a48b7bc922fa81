//! The kernel switches a model reads from the environment at upload: `TESSERA_ATTENTION`,
//! `TESSERA_FUSED` and `TESSERA_GEMV`, each once per process.

use std::sync::OnceLock;

use tessera_kernels::cuda::{AttentionKernel, CudaError};

use crate::error::ModelError;
use crate::launch_plan::{GEMV_MAX_TOKENS, Gemm, KernelPath};

/// The kernel switch `var` names, read from the environment once per process into
/// `chosen` and parsed by `parse` (unset is `None`); Err: the value `parse` refused, for
/// the caller's error, which says what to change. The switches are read at a model's
/// upload, so a bad value fails it.
fn switch_from_env<T: Copy, E>(
    chosen: &'static OnceLock<Result<T, String>>,
    var: &str,
    parse: impl FnOnce(Option<&str>) -> Result<T, E>,
) -> Result<T, String> {
    chosen
        .get_or_init(|| {
            let value = std::env::var(var).ok();
            parse(value.as_deref()).map_err(|_| value.unwrap_or_default())
        })
        .clone()
}

/// The attention kernel `TESSERA_ATTENTION` names: `legacy` (unset or empty: the default,
/// until the others have run on a GPU), `grouped`, or `flash` (prefill; grouped decode).
pub(super) fn attention_from_env() -> Result<AttentionKernel, CudaError> {
    static CHOSEN: OnceLock<Result<AttentionKernel, String>> = OnceLock::new();
    switch_from_env(&CHOSEN, "TESSERA_ATTENTION", |value| match value {
        Some(name) if !name.is_empty() => name.parse(),
        _ => Ok(AttentionKernel::default()),
    })
    .map_err(|name| CudaError::UnknownAttention { name })
}

/// The launch sequence `TESSERA_FUSED` names: `0` (unset or empty: the default, until the
/// fused kernels have run on a GPU) or `1`.
pub(super) fn path_from_env() -> Result<KernelPath, ModelError> {
    static CHOSEN: OnceLock<Result<KernelPath, String>> = OnceLock::new();
    switch_from_env(&CHOSEN, "TESSERA_FUSED", KernelPath::from_env_value)
        .map_err(|name| ModelError::UnknownKernelPath { name })
}

/// The kernel of small batches' bf16 projections `TESSERA_GEMV` names: `0` (unset or
/// empty: cuBLAS, the default until the GEMV has run on a GPU) or `1` (the GEMV for
/// batches of at most 8 tokens).
pub(super) fn gemm_from_env() -> Result<Gemm, ModelError> {
    static CHOSEN: OnceLock<Result<Gemm, String>> = OnceLock::new();
    switch_from_env(&CHOSEN, "TESSERA_GEMV", Gemm::from_env_value)
        .map_err(|name| ModelError::UnknownGemm { name })
}

// The launch plan decides the GEMV without the kernels' CUDA module; the two agree.
const _: () = assert!(GEMV_MAX_TOKENS == tessera_kernels::cuda::GEMV_MAX_TOKENS);
