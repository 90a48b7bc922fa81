//! Matrix × vector(s) for weights of any [`DType`]: `y = W·x` for one or more activation
//! vectors, rows split across the rayon pool.
//!
//! Weights stay in their stored type: each row is dotted block by block (see
//! [`crate::cpu::RowDot`]), so a quantized model is never expanded to f32 in memory.

use rayon::prelude::*;

use crate::cpu::RowDot;
use crate::{DType, KernelError, quant};

/// A borrowed row-major weight matrix: `rows` rows of `cols` values of `dtype`.
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a> {
    dtype: DType,
    rows: usize,
    cols: usize,
    data: &'a [u8],
}

impl<'a> MatRef<'a> {
    /// Checks that `data` holds exactly `rows × cols` values of `dtype`.
    pub fn new(
        dtype: DType,
        rows: usize,
        cols: usize,
        data: &'a [u8],
    ) -> Result<Self, KernelError> {
        let expected = dtype.row_bytes(cols)? * rows;
        if data.len() != expected {
            return Err(KernelError::ByteLength {
                what: "weight matrix",
                expected,
                actual: data.len(),
            });
        }
        Ok(MatRef {
            dtype,
            rows,
            cols,
            data,
        })
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The stored bytes of row `r`.
    pub fn row(&self, r: usize) -> &'a [u8] {
        let n = self.data.len() / self.rows.max(1);
        &self.data[r * n..(r + 1) * n]
    }

    /// Dequantizes row `r` into `out` (`cols` values): an embedding lookup.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) -> Result<(), KernelError> {
        if r >= self.rows {
            return Err(KernelError::Length {
                what: "row index",
                expected: self.rows,
                actual: r,
            });
        }
        quant::dequantize_row(self.dtype, self.row(r), out)
    }
}

/// Rows per rayon task: large enough to amortise scheduling, small enough to balance.
const MIN_ROWS_PER_TASK: usize = 16;

/// `ys[t] = W · xs[t]` for `n = xs.len() / cols` vectors laid out one after another;
/// `ys` holds `n × rows` values.
pub fn matmul(w: &MatRef<'_>, xs: &[f32], ys: &mut [f32]) -> Result<(), KernelError> {
    let n = check_lengths(w, xs, ys)?;
    let preps: Vec<RowDot<'_>> = xs
        .chunks_exact(w.cols)
        .map(|x| RowDot::new(x, w.dtype))
        .collect();
    let per_task = (w.rows / (rayon::current_num_threads() * 4)).max(MIN_ROWS_PER_TASK);
    if n == 1 {
        return ys
            .par_chunks_mut(per_task)
            .enumerate()
            .try_for_each(|(chunk, out)| {
                for (i, y) in out.iter_mut().enumerate() {
                    *y = preps[0].dot(w.dtype, w.row(chunk * per_task + i))?;
                }
                Ok(())
            });
    }
    // Row-major over (row, token) so each weight row is read from memory once and reused
    // from L1 for every token; transposed into `ys` afterwards.
    let mut by_row = vec![0.0f32; w.rows * n];
    by_row
        .par_chunks_mut(per_task * n)
        .enumerate()
        .try_for_each(|(chunk, out)| {
            for (i, row_out) in out.chunks_exact_mut(n).enumerate() {
                let row = w.row(chunk * per_task + i);
                for (y, prep) in row_out.iter_mut().zip(&preps) {
                    *y = prep.dot(w.dtype, row)?;
                }
            }
            Ok::<(), KernelError>(())
        })?;
    for (r, row_out) in by_row.chunks_exact(n).enumerate() {
        for (t, y) in row_out.iter().enumerate() {
            ys[t * w.rows + r] = *y;
        }
    }
    Ok(())
}

fn check_lengths(w: &MatRef<'_>, xs: &[f32], ys: &[f32]) -> Result<usize, KernelError> {
    if w.cols == 0 || !xs.len().is_multiple_of(w.cols) {
        return Err(KernelError::Length {
            what: "matmul input (a multiple of the weight's columns)",
            expected: w.cols,
            actual: xs.len(),
        });
    }
    let n = xs.len() / w.cols;
    if ys.len() != n * w.rows {
        return Err(KernelError::Length {
            what: "matmul output",
            expected: n * w.rows,
            actual: ys.len(),
        });
    }
    Ok(n)
}

/// The plain reference for [`matmul`]: scalar dot products, one thread.
pub fn matmul_reference(w: &MatRef<'_>, xs: &[f32], ys: &mut [f32]) -> Result<(), KernelError> {
    let n = check_lengths(w, xs, ys)?;
    for t in 0..n {
        let x = &xs[t * w.cols..(t + 1) * w.cols];
        for r in 0..w.rows {
            ys[t * w.rows + r] = quant::dot_row(w.dtype, w.row(r), x)?;
        }
    }
    Ok(())
}
