//! A rank's weights on the device. Q8_0, Q4_K and FP8 projections stay quantized and run
//! through the dequantizing matvec kernels; every other type is converted to bf16 once,
//! at upload, and runs through cuBLAS (the quantized ones among them are named in one log
//! line, see [`dequantized_at_upload`]). Norms and biases are f32.

use rayon::prelude::*;
use tessera_kernels::DType;
use tessera_kernels::cuda::{Blas, CudaError, CudaSlice, DevicePtr, DevicePtrMut, Ops};

use crate::error::ModelError;
use crate::launch_plan::{Gemm, device_keeps_quantized};
use crate::llama::Linear;
use crate::weights::Weight;

/// The rows of `w` as bf16 bits (dequantized, then rounded to nearest even).
pub(crate) fn bf16_bits(w: &Weight) -> Result<Vec<u16>, ModelError> {
    let m = w.mat();
    let mut out = vec![0u16; w.rows * w.cols];
    out.par_chunks_mut(w.cols.max(1))
        .enumerate()
        .try_for_each_init(
            || vec![0.0f32; w.cols],
            |row, (r, dst)| {
                m.dequantize_row(r, row)?;
                for (d, &x) in dst.iter_mut().zip(row.iter()) {
                    *d = half::bf16::from_f32(x).to_bits();
                }
                Ok::<(), ModelError>(())
            },
        )?;
    Ok(out)
}

/// The quantized types among `weights` that no device kernel reads, so that they are
/// dequantized to bf16 at upload (Q5_0, Q2_K, IQ4_XS, ...), each once, in the order met.
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
    Quantized { bytes: CudaSlice<u8>, dtype: DType },
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
    /// v: each token's output is every part's rows in turn, and so is the bias). Parts of one quantized type stay quantized
    /// if `keep_quantized` (a matvec kernel reads them); all else becomes bf16.
    pub(crate) fn upload(
        ops: &Ops<'_>,
        parts: &[&Linear],
        keep_quantized: bool,
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
        let matrix = if keep_quantized && same_type && device_keeps_quantized(first.dtype) {
            let mut bytes = Vec::with_capacity(parts.iter().map(|p| p.weight.bytes().len()).sum());
            for p in parts {
                bytes.extend_from_slice(p.weight.bytes());
            }
            Matrix::Quantized {
                bytes: ops.upload(&bytes)?,
                dtype: first.dtype,
            }
        } else {
            let mut bits = Vec::with_capacity(rows * cols);
            for p in parts {
                bits.extend(bf16_bits(&p.weight)?);
            }
            Matrix::Bf16(ops.upload(&bits)?)
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

    /// The bf16 table of a bf16 projection.
    pub(crate) fn table(&self) -> Option<&CudaSlice<u16>> {
        match &self.matrix {
            Matrix::Bf16(t) => Some(t),
            Matrix::Quantized { .. } => None,
        }
    }

    /// Bytes of weights on the device (what one pass reads).
    pub(crate) fn device_bytes(&self) -> usize {
        let bias = self.bias.as_ref().map_or(0, |b| b.len() * 4);
        bias + match &self.matrix {
            Matrix::Bf16(t) => t.len() * 2,
            Matrix::Quantized { bytes, .. } => bytes.len(),
        }
    }

    /// Whether the weights run through a dequantizing matvec (which reads f32 input).
    pub(crate) fn is_quantized(&self) -> bool {
        matches!(self.matrix, Matrix::Quantized { .. })
    }

    /// The bias, if the projection has one: a launch of its own (`add_bias_f32`), or
    /// fused into the kernel that reads the output (the q|k|v bias in `rope_kv_write`).
    pub(crate) fn bias(&self) -> Option<&CudaSlice<f32>> {
        self.bias.as_ref()
    }

    /// `y = W·x` for every token of `x` (one launch; the bias is not added here): bf16
    /// weights through cuBLAS or the GEMV, as `gemm` says (the caller has fitted it to the
    /// batch, [`Gemm::for_tokens`]).
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
            DType::Q5_0,
            DType::Q8_0,
            DType::F32,
            DType::IQ4XS,
            DType::Q5_0,
            DType::Q4K,
            DType::BF16,
            DType::Q2K,
        ]
        .map(zeros);
        assert_eq!(
            dequantized_at_upload(&ws),
            [DType::Q5_0, DType::IQ4XS, DType::Q2K]
        );
        let kept = [DType::Q8_0, DType::Q4K, DType::F8E4M3, DType::F16].map(zeros);
        assert!(dequantized_at_upload(&kept).is_empty());
    }
}
