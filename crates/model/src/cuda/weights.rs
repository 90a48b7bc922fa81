//! A rank's weights on the device. Q8_0, Q5_0, Q4_K, Q5_K, Q6_K and FP8 projections stay quantized and run
//! through the dequantizing matvec kernels; every other type is converted to bf16 once,
//! at upload, and runs through cuBLAS (the quantized ones among them are named in one log
//! line, see [`dequantized_at_upload`]). On the exact path ([`DeviceDtype::F32`]) every
//! matrix is f32 and runs through cuBLAS's f32 GEMM. Norms and biases are f32.

use rayon::prelude::*;
use tessera_kernels::DType;
use tessera_kernels::cuda::{Blas, CudaError, CudaSlice, DevicePtr, DevicePtrMut, Held, Ops};

use super::DeviceDtype;
use crate::error::ModelError;
use crate::launch_plan::{Gemm, device_keeps_quantized};
use crate::llama::Linear;
use crate::weights::Weight;

/// The rows of `w` dequantized, each value as `convert` makes it (bf16 bits, rounded to
/// nearest even, or the f32 itself).
fn rows_as<T: Held + Send>(w: &Weight, convert: fn(f32) -> T) -> Result<Vec<T>, ModelError> {
    let m = w.mat();
    let mut out = vec![T::default(); w.rows * w.cols];
    out.par_chunks_mut(w.cols.max(1))
        .enumerate()
        .try_for_each_init(
            || vec![0.0f32; w.cols],
            |row, (r, dst)| {
                m.dequantize_row(r, row)?;
                for (d, &x) in dst.iter_mut().zip(row.iter()) {
                    *d = convert(x);
                }
                Ok::<(), ModelError>(())
            },
        )?;
    Ok(out)
}

/// Every part's rows, in turn, as `convert` makes each value.
fn stacked<T: Held + Send>(parts: &[&Linear], convert: fn(f32) -> T) -> Result<Vec<T>, ModelError> {
    let mut all = Vec::new();
    for p in parts {
        all.extend(rows_as(&p.weight, convert)?);
    }
    Ok(all)
}

/// The quantized types among `weights` that no device kernel reads, so that they are
/// dequantized to bf16 at upload (Q5_1, Q2_K, IQ4_XS, ...), each once, in the order met.
pub(crate) fn dequantized_at_upload<'w>(
    weights: impl IntoIterator<Item = &'w Weight>,
) -> Vec<DType> {
    let mut types = Vec::new();
    for w in weights {
        if w.dtype.is_quantized() && !device_keeps_quantized(w.dtype) && !types.contains(&w.dtype) {
            types.push(w.dtype);
        }
    }
    types
}

/// A weight matrix on the device.
#[derive(Debug)]
enum Matrix {
    Bf16(CudaSlice<u16>),
    /// The exact path's.
    F32(CudaSlice<f32>),
    Quantized {
        bytes: CudaSlice<u8>,
        dtype: DType,
    },
}

/// A projection on the device: `rows × cols`, with an optional f32 bias.
#[derive(Debug)]
pub(crate) struct DeviceLinear {
    matrix: Matrix,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    bias: Option<CudaSlice<f32>>,
}

/// The input of a projection: f32 activations and their bf16 rounding (computed once per
/// input and shared by every projection that reads it); whole buffers, or views of their
/// first rows.
pub(crate) struct Input<'a, F = CudaSlice<f32>, B = CudaSlice<u16>> {
    pub(crate) f32: &'a F,
    pub(crate) bf16: &'a B,
}

impl DeviceLinear {
    /// Uploads `parts` stacked row-wise as one projection (gate and up fused, or q, k and
    /// v: each token's output is every part's rows in turn, and so is the bias), held as
    /// `dtype` says. Under bf16, parts of one quantized type stay quantized if
    /// `keep_quantized` (a matvec kernel reads them) and all else becomes bf16; under f32,
    /// everything becomes f32.
    pub(crate) fn upload(
        ops: &Ops<'_>,
        parts: &[&Linear],
        (dtype, keep_quantized): (DeviceDtype, bool),
    ) -> Result<DeviceLinear, ModelError> {
        let first = &parts[0].weight;
        let cols = first.cols;
        let rows = parts.iter().map(|p| p.weight.rows).sum();
        if parts.iter().any(|p| p.weight.cols != cols) {
            return Err(ModelError::Plan {
                message: format!("{}: fused projections of different widths", first.name),
            });
        }
        let same_type = parts.iter().all(|p| p.weight.dtype == first.dtype);
        let quantized = keep_quantized && same_type && device_keeps_quantized(first.dtype);
        let matrix = if dtype == DeviceDtype::F32 {
            Matrix::F32(ops.upload(&stacked(parts, |x| x)?)?)
        } else if quantized {
            let mut bytes = Vec::with_capacity(parts.iter().map(|p| p.weight.bytes().len()).sum());
            for p in parts {
                bytes.extend_from_slice(p.weight.bytes());
            }
            Matrix::Quantized {
                bytes: ops.upload(&bytes)?,
                dtype: first.dtype,
            }
        } else {
            Matrix::Bf16(ops.upload(&stacked(parts, |x| half::bf16::from_f32(x).to_bits())?)?)
        };
        let bias = if parts.iter().any(|p| p.bias.is_some()) {
            let mut all = Vec::with_capacity(rows);
            for p in parts {
                match &p.bias {
                    Some(b) => all.extend_from_slice(b),
                    None => all.extend(std::iter::repeat_n(0.0, p.weight.rows)),
                }
            }
            Some(ops.upload(&all)?)
        } else {
            None
        };
        Ok(DeviceLinear {
            matrix,
            rows,
            cols,
            bias,
        })
    }

    /// `out[t]` = row `ids[t] − vocab_start` of this matrix (the embedding: bf16 or f32,
    /// never quantized), zero for ids outside its rows.
    pub(crate) fn gather(
        &self,
        ops: &Ops<'_>,
        out: &mut CudaSlice<f32>,
        ids: &CudaSlice<u32>,
        vocab_start: u32,
    ) -> Result<(), CudaError> {
        match &self.matrix {
            Matrix::Bf16(t) => ops.embedding(out, t, ids, self.cols, vocab_start),
            Matrix::F32(t) => ops.embedding(out, t, ids, self.cols, vocab_start),
            Matrix::Quantized { dtype, .. } => Err(CudaError::Unsupported {
                what: format!("an embedding gather from {} weights", dtype.name()),
            }),
        }
    }

    /// Bytes of weights on the device (what one pass reads).
    pub(crate) fn device_bytes(&self) -> usize {
        let bias = self.bias.as_ref().map_or(0, |b| b.len() * 4);
        bias + match &self.matrix {
            Matrix::Bf16(t) => t.len() * 2,
            Matrix::F32(t) => t.len() * 4,
            Matrix::Quantized { bytes, .. } => bytes.len(),
        }
    }

    /// Whether the weights run through a dequantizing matvec (which reads f32 input).
    pub(crate) fn is_quantized(&self) -> bool {
        matches!(self.matrix, Matrix::Quantized { .. })
    }

    /// Whether the weights are f32 (the exact path), read with f32 input.
    pub(crate) fn is_f32(&self) -> bool {
        matches!(self.matrix, Matrix::F32(_))
    }

    /// The bias, if the projection has one: a launch of its own (`add_bias_f32`), or
    /// fused into the kernel that reads the output (the q|k|v bias in `rope_kv_write`).
    pub(crate) fn bias(&self) -> Option<&CudaSlice<f32>> {
        self.bias.as_ref()
    }

    /// `y = W·x` for every token of `x` (one launch; the bias is not added here): bf16
    /// weights through cuBLAS or the GEMV, as `gemm` says (the caller has fitted it to the
    /// batch, [`Gemm::for_tokens`]); f32 weights through cuBLAS's f32 GEMM.
    pub(crate) fn apply<F: DevicePtr<f32>, B: DevicePtr<u16>>(
        &self,
        ops: &Ops<'_>,
        (blas, gemm): (&Blas, Gemm),
        x: &Input<'_, F, B>,
        y: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), CudaError> {
        let shape = (self.rows, self.cols);
        match &self.matrix {
            Matrix::Bf16(w) => match gemm {
                Gemm::Cublas => blas.gemm_bf16(ops, y, w, x.bf16, shape),
                Gemm::Gemv => ops.gemv_bf16(y, w, x.bf16, shape),
            },
            Matrix::F32(w) => blas.gemm_f32(ops, y, w, x.f32, shape),
            Matrix::Quantized { bytes, dtype } => {
                ops.matvec_quantized(y, bytes, *dtype, x.f32, self.rows, self.cols)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::weights::Storage;

    fn zeros(dtype: DType) -> Weight {
        let cols = dtype.block_elems().max(32);
        let bytes = vec![0u8; dtype.row_bytes(cols).unwrap()];
        Weight::new(
            Path::new("t"),
            "w",
            dtype,
            1,
            cols,
            Storage::from_vec(bytes),
        )
        .unwrap()
    }

    #[test]
    fn types_without_a_device_kernel_are_named_once_each() {
        let ws = [
            DType::Q5_1,
            DType::Q8_0,
            DType::F32,
            DType::IQ4XS,
            DType::Q5_1,
            DType::Q4K,
            DType::BF16,
            DType::Q2K,
        ]
        .map(zeros);
        assert_eq!(
            dequantized_at_upload(&ws),
            [DType::Q5_1, DType::IQ4XS, DType::Q2K]
        );
        let kept = [
            DType::Q8_0,
            DType::Q5_0,
            DType::Q4K,
            DType::Q5K,
            DType::Q6K,
            DType::F8E4M3,
            DType::F16,
        ]
        .map(zeros);
        assert!(dequantized_at_upload(&kept).is_empty());
    }
}
