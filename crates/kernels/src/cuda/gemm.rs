//! GEMMs through cuBLAS (`cublasGemmEx`), products summed and written in f32:
//! - [`Blas::gemm_bf16`]: weights and activations in bf16 (`CUBLAS_COMPUTE_32F`), the
//!   default path;
//! - [`Blas::gemm_f32`]: both in f32 with `CUBLAS_COMPUTE_32F_PEDANTIC`, which keeps
//!   cuBLAS from TF32 tensor cores and reduced-precision sums whatever the handle's math
//!   mode or `NVIDIA_TF32_OVERRIDE` say: the exact path (`dtype = "f32"`).
//!
//! Layouts are row-major, as everywhere in Tessera: `W` is `rows × cols`, the inputs are
//! `tokens × cols`, the outputs `tokens × rows`. cuBLAS is column-major, so the call
//! computes `Yᵀ = op(W)·Xᵀ` with `W` read transposed: a row-major `rows × cols` matrix is a
//! column-major `cols × rows` one.

use std::sync::Arc;

use cudarc::cublas::{CudaBlas, result, sys};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

use super::ops::{Ops, projection_tokens};
use super::{CudaError, Held};

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
        shape: (usize, usize),
    ) -> Result<(), CudaError> {
        let compute = sys::cublasComputeType_t::CUBLAS_COMPUTE_32F;
        self.gemm_ex(ops, ys, w, xs, shape, compute)
    }

    /// [`Blas::gemm_bf16`] with `W` and `xs` in f32, summed in f32 without TF32.
    pub fn gemm_f32(
        &self,
        ops: &Ops<'_>,
        ys: &mut impl DevicePtrMut<f32>,
        w: &CudaSlice<f32>,
        xs: &impl DevicePtr<f32>,
        shape: (usize, usize),
    ) -> Result<(), CudaError> {
        let compute = sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_PEDANTIC;
        self.gemm_ex(ops, ys, w, xs, shape, compute)
    }

    /// The GEMM of either: `W` and `xs` in bf16 or f32 (as `T` is), summed as `compute`
    /// says.
    fn gemm_ex<T: Held>(
        &self,
        ops: &Ops<'_>,
        ys: &mut impl DevicePtrMut<f32>,
        w: &CudaSlice<T>,
        xs: &impl DevicePtr<T>,
        (rows, cols): (usize, usize),
        compute: sys::cublasComputeType_t,
    ) -> Result<(), CudaError> {
        let (input, name) = if T::F32 {
            (sys::cudaDataType_t::CUDA_R_32F, "f32")
        } else {
            (sys::cudaDataType_t::CUDA_R_16BF, "bf16")
        };
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
                input,
                k,
                b as *const _,
                input,
                k,
                (&beta) as *const f32 as *const _,
                c as *mut _,
                sys::cudaDataType_t::CUDA_R_32F,
                m,
                compute,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| CudaError::Device {
            ordinal: self.ordinal,
            message: format!("cuBLAS {name} GEMM {rows}×{cols} on {tokens} tokens: {e}"),
        })
    }
}
