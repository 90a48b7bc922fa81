//! Errors of model loading and execution. Every variant names the file and, where there is
//! one, the tensor or key involved, so a user knows what to fix.

use std::path::PathBuf;

use tessera_comm::CollectiveError;
use tessera_comm::proto::ErrorClass;

use crate::gguf::GgufError;

/// Loading or running a model failed.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not valid JSON: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{path}: neither a .gguf file nor a directory with config.json")]
    UnknownFormat { path: PathBuf },
    #[error("{path}: missing key `{key}`")]
    MissingKey { path: PathBuf, key: String },
    #[error("{path}: `{key}` {message}")]
    InvalidConfig {
        path: PathBuf,
        key: String,
        message: String,
    },
    /// A config feature the forward pass does not implement (see `config::refuse`).
    #[error("{path}: `{key}` = {found} is not supported; supported: {supported}")]
    Unsupported {
        path: PathBuf,
        key: String,
        found: String,
        supported: String,
    },
    #[error("{path}: tensor `{tensor}` is missing")]
    MissingTensor { path: PathBuf, tensor: String },
    #[error("{path}: tensor `{tensor}` has shape {actual:?}, but the config implies {expected:?}")]
    TensorShape {
        path: PathBuf,
        tensor: String,
        expected: Vec<usize>,
        actual: Vec<usize>,
    },
    /// A fused projection (Phi-3's q|k|v or gate|up) whose rows are not its parts' sum.
    #[error(
        "{path}: fused tensor `{tensor}` has {rows} rows, but the config's {parts} add up to \
         {expected}"
    )]
    FusedRows {
        path: PathBuf,
        tensor: String,
        rows: usize,
        parts: String,
        expected: usize,
    },
    #[error("{path}: tensor `{tensor}` has type {dtype}, which is not supported here")]
    TensorType {
        path: PathBuf,
        tensor: String,
        dtype: String,
    },
    #[error("{path}: {message}")]
    Safetensors { path: PathBuf, message: String },
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Kernel(#[from] tessera_kernels::KernelError),
    #[cfg(feature = "cuda")]
    #[error(transparent)]
    Cuda(#[from] tessera_kernels::cuda::CudaError),
    #[error("{path}: tokenizer: {message}")]
    Tokenizer { path: PathBuf, message: String },
    #[error("invalid request: {message}")]
    InvalidRequest { message: String },
    #[error("tensor-parallel plan: {message}")]
    Plan { message: String },
    #[error(
        "kernel path `{name}` is unknown: TESSERA_FUSED takes 0 (the legacy launches, the \
         default) or 1 (the fused kernels)"
    )]
    UnknownKernelPath { name: String },
    #[error(
        "projection kernel `{name}` is unknown: TESSERA_GEMV takes 0 (cuBLAS GEMMs, the \
         default) or 1 (the bf16 GEMV for batches of at most 8 tokens)"
    )]
    UnknownGemm { name: String },
    #[error(
        "layer launch {launch} made {actual} kernel launches where the launch plan says \
         {expected}"
    )]
    LaunchCount {
        launch: &'static str,
        expected: u64,
        actual: u64,
    },
    #[error("collective failed: {source}")]
    Collective {
        #[from]
        source: CollectiveError,
    },
}

impl ModelError {
    /// Shorthand for an I/O error on `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ModelError::Io {
            path: path.into(),
            source,
        }
    }

    /// The class a caller reports: a bad request, a failed peer (collective), or a fault
    /// of this process or its files.
    pub fn class(&self) -> ErrorClass {
        match self {
            ModelError::InvalidRequest { .. } => ErrorClass::InvalidRequest,
            ModelError::Collective { .. } => ErrorClass::Unavailable,
            _ => ErrorClass::Internal,
        }
    }
}
