//! The CUDA backend's kernels: CUDA C sources compiled by NVRTC when a shard starts, for
//! its device's compute capability, and cached on disk.
//!
//! cudarc loads the CUDA libraries at run time (`dynamic-loading`): a build never needs
//! CUDA, and a process on a machine without a driver gets a [`CudaError`] naming what is
//! missing — never a panic (cudarc panics when a library it uses is absent, so every
//! entry point checks for it first).
//!
//! - [`source`]: the kernel families, one `.cu` file each under `crates/kernels/cuda/`,
//!   with the entry points each must define.
//! - [`compile`]: NVRTC → PTX, and the on-disk PTX cache.
//! - [`device`]: a device opened, its kernels loaded.
//! - [`gemm`]: bf16 (and the exact path's f32) GEMMs through cuBLAS (and `ops::gemv`: the bf16 GEMV of decode
//!   batches of 1 to 8 tokens, a kernel of its own).
//! - [`graph`]: CUDA graphs — launches captured once, replayed with one launch.
//! - [`held`]: the value types of the device's tables (bf16, or f32 on the exact path).
//! - [`ops`]: typed launches, each checking its buffers against the shape it is given.
//!
//! Every kernel has a CPU twin (named in its file's header comment); the GPU check
//! (`scripts/gpu-check.sh`) compares them.

pub mod compile;
pub mod device;
pub mod gemm;
pub mod graph;
pub mod held;
pub mod ops;
pub mod source;

pub use compile::{PtxCache, compile_family, nvrtc_version};
pub use cudarc::driver::{
    CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceSlice,
};
pub use device::CudaDevice;
pub use gemm::Blas;
pub use graph::Graph;
pub use held::Held;
pub use ops::gemv::GEMV_MAX_TOKENS;
pub use ops::{
    Append, AttentionIndex, AttentionKernel, AttentionTarget, Ops, RopeKv, SampleBuffers, Slots,
};
pub use source::{FAMILIES, KernelFamily};

/// Why the CUDA backend cannot run.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error(
        "no CUDA driver: libcuda.so was not found (install the NVIDIA driver, or run this \
         shard with device = \"cpu\")"
    )]
    NoDriver,
    #[error(
        "NVRTC was not found: libnvrtc.so.12 must be on the library path (from the CUDA \
         toolkit, or the `nvidia-cuda-nvrtc-cu12` wheel's lib directory in LD_LIBRARY_PATH)"
    )]
    NoNvrtc,
    #[error(
        "cuBLAS was not found: libcublas.so.12 must be on the library path (from the CUDA \
         toolkit, or the `nvidia-cublas-cu12` wheel's lib directory in LD_LIBRARY_PATH)"
    )]
    NoCublas,
    #[error("cuda:{ordinal}: {message}")]
    Device { ordinal: usize, message: String },
    #[error("{file} does not compile for {arch}:\n{log}")]
    Compile {
        file: &'static str,
        arch: String,
        log: String,
    },
    #[error("{file} for {arch}: the PTX lacks entry point `{entry}`")]
    MissingEntry {
        file: &'static str,
        arch: String,
        entry: &'static str,
    },
    #[error("{what}: expected {expected}, got {actual}")]
    Shape {
        what: &'static str,
        expected: usize,
        actual: usize,
    },
    #[error(
        "attention kernel `{name}` is unknown: TESSERA_ATTENTION takes legacy (the default), \
         grouped, or flash (prefill; grouped decode)"
    )]
    UnknownAttention { name: String },
    #[error(
        "the bf16 GEMV serves 1 to 8 tokens, not {tokens} tokens (larger batches run as \
         cuBLAS GEMMs, Blas::gemm_bf16)"
    )]
    GemvTokens { tokens: usize },
    #[error("not supported on CUDA yet: {what}")]
    Unsupported { what: String },
    #[error("PTX cache {path}: {message}")]
    Cache {
        path: std::path::PathBuf,
        message: String,
    },
}
