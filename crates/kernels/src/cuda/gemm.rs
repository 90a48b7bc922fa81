//! bf16 GEMMs through cuBLAS: weights and activations in bf16, products summed and
//! written in f32 (`cublasGemmEx`, `CUBLAS_COMPUTE_32F`).
//!
//! Layouts are row-major, as everywhere in Tessera: `W` is `rows × cols`, the inputs are
//! `tokens × cols`, the outputs `tokens × rows`. cuBLAS is column-major, so the call
//! computes `Yᵀ = op(W)·Xᵀ` with `W` read transposed: a row-major `rows × cols` matrix is a
//! column-major `cols × rows` one.

use std::sync::Arc;

use cudarc::cublas::{CudaBlas, result, sys};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

use super::CudaError;
use super::ops::{Ops, projection_tokens};

/// Whether libcublas can be loaded.
pub fn cublas_present() -> bool {
    // SAFETY: only tries to dlopen the library's candidate names.
    unsafe { sys::is_culib_present() }
}

/// A cuBLAS handle bound to one stream.
#[derive(Debug)]
pub struct Blas {
    blas: CudaBlas,
    stream: Arc<CudaStream>,
    ordinal: usize,
}

impl Blas {
    /// A handle on `stream` of device `ordinal`; [`CudaError::NoCublas`] where the library
    /// is missing.
    pub fn new(ordinal: usize, stream: Arc<CudaStream>) -> Result<Blas, CudaError> {
        if !cublas_present() {
            return Err(CudaError::NoCublas);
        }
        let blas = CudaBlas::new(Arc::clone(&stream)).map_err(|e| CudaError::Device {
            ordinal,
            message: format!("creating the cuBLAS handle: {e}"),
        })?;
        Ok(Blas {
            blas,
            stream,
            ordinal,
        })
    }

    /// `ys[t, r] = Σ_c W[r, c] · xs[t, c]` for `W` of `rows × cols` (bf16 bits), `xs` of
    /// `tokens × cols` (bf16 bits) and `ys` of `tokens × rows` (f32), on the handle's
    /// stream; buffers or views of them. Counted as one launch of `ops`.
    pub fn gemm_bf16(
        &self,
        ops: &Ops<'_>,
        ys: &mut impl DevicePtrMut<f32>,
        w: &CudaSlice<u16>,
        xs: &impl DevicePtr<u16>,
        (rows, cols): (usize, usize),
    ) -> Result<(), CudaError> {
        let tokens = projection_tokens((w.len(), xs.len(), ys.len()), (rows, cols))?;
        let int = |what: &'static str, n: usize| {
            i32::try_from(n).map_err(|_| CudaError::Shape {
                what,
                expected: i32::MAX as usize,
                actual: n,
            })
        };
        let (m, n, k) = (
            int("gemm rows", rows)?,
            int("gemm tokens", tokens)?,
            int("gemm cols", cols)?,
        );
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (a, _a) = w.device_ptr(&self.stream);
        let (b, _b) = xs.device_ptr(&self.stream);
        let (c, _c) = ys.device_ptr_mut(&self.stream);
        ops.count_launch();
        // SAFETY: W holds m × k values (lda = k, read transposed), X holds k × n
        // (ldb = k), Y holds m × n (ldc = m), all checked above; the pointers stay alive
        // until the guards drop after the call is enqueued on the handle's stream.
        unsafe {
            result::gemm_ex(
                *self.blas.handle(),
                sys::cublasOperation_t::CUBLAS_OP_T,
                sys::cublasOperation_t::CUBLAS_OP_N,
                m,
                n,
                k,
                (&alpha) as *const f32 as *const _,
                a as *const _,
                sys::cudaDataType_t::CUDA_R_16BF,
                k,
                b as *const _,
                sys::cudaDataType_t::CUDA_R_16BF,
                k,
                (&beta) as *const f32 as *const _,
                c as *mut _,
                sys::cudaDataType_t::CUDA_R_32F,
                m,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| CudaError::Device {
            ordinal: self.ordinal,
            message: format!("cuBLAS bf16 GEMM {rows}×{cols} on {tokens} tokens: {e}"),
        })
    }
}
