//! Compute kernels for one device.
//!
//! The CPU kernels are the reference and a first-class backend: each has a plain scalar
//! version that tests compare against, and SIMD versions picked at run time from the CPU's
//! features (`cpu::Features`). Work is split across threads with rayon by the caller's pool.
//!
//! - [`dtype`]: element types, including GGML block-quantized formats.
//! - [`quant`]: block layouts, dequantization and dot products for the quantized formats.

pub mod dtype;
pub mod error;
pub mod quant;

pub use dtype::DType;
pub use error::KernelError;
