//! Compute kernels for one device.
//!
//! The CPU kernels are the reference and a first-class backend: each has a plain scalar
//! version that tests compare against, and SIMD versions picked at run time from the CPU's
//! features ([`cpu::Features`]). Work is split across threads with rayon; the caller picks
//! the pool.
//!
//! - [`dtype`]: element types, including GGML block-quantized formats.
//! - [`quant`]: block layouts, dequantization and reference dot products.
//! - [`cpu`]: feature detection and SIMD row-dot products.
//! - [`matmul`]: weight matrix × activation vectors, in the weight's stored type.
//! - [`shm`]: shared-memory segments and futexes for ranks on one host (Linux).
//! - `cuda` (feature `cuda`): the CUDA kernels (NVRTC-compiled CUDA C, loaded through
//!   cudarc at run time: no build needs CUDA). Without the feature the module and cudarc
//!   are absent, so a process that runs nothing on a GPU links no GPU crate.
//! - [`norm`], [`rope`], [`activation`], [`attention`], [`sampling`]: the rest of a
//!   Llama-family decoder step.
//! - [`fused`]: the CPU twins of the CUDA kernels that fuse several of those steps (and
//!   round their output to bf16), built from the steps above.

pub mod activation;
pub mod attention;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dtype;
pub mod error;
pub mod fused;
pub mod matmul;
pub mod mmap;
pub mod norm;
pub mod quant;
pub mod rope;
pub mod sampling;
#[cfg(target_os = "linux")]
pub mod shm;

pub use dtype::DType;
pub use error::KernelError;
