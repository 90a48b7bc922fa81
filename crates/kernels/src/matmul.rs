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
    let per_task = (w.rows / (rayon::current_num_threads() * 4)).max(MIN_ROWS_PER_TASK);
    if n == 1 {
        let prep = RowDot::new(xs, w.dtype);
        return ys
            .par_chunks_mut(per_task)
            .enumerate()
            .try_for_each(|(chunk, out)| {
                for (i, y) in out.iter_mut().enumerate() {
                    *y = prep.dot(w.dtype, w.row(chunk * per_task + i))?;
                }
                Ok(())
            });
    }
    matmul_gemm(w, xs, ys, n)
}

/// Weight values dequantized at once for a batched product: bounds the f32 copy of a large
/// matrix to 16 MiB while keeping each GEMM call large enough to run at full speed.
const GEMM_TILE_VALUES: usize = 4 << 20;

/// `n > 1` tokens: dequantize a tile of rows to f32 and multiply with the `gemm` crate's
/// cache-blocked kernels; the dequantization is shared by the whole batch.
fn matmul_gemm(w: &MatRef<'_>, xs: &[f32], ys: &mut [f32], n: usize) -> Result<(), KernelError> {
    let tile_rows = (GEMM_TILE_VALUES / w.cols).clamp(1, w.rows);
    let mut tile = vec![0.0f32; tile_rows * w.cols];
    let threads = rayon::current_num_threads();
    for r0 in (0..w.rows).step_by(tile_rows) {
        let rows = tile_rows.min(w.rows - r0);
        let tile = &mut tile[..rows * w.cols];
        tile.par_chunks_mut(w.cols)
            .enumerate()
            .try_for_each(|(i, row)| quant::dequantize_row(w.dtype, w.row(r0 + i), row))?;
        let parallelism = if threads > 1 {
            gemm::Parallelism::Rayon(threads)
        } else {
            gemm::Parallelism::None
        };
        // SAFETY: dst is `ys` offset by r0 columns: element (t, r) at t·w.rows + r0 + r with
        // t < n, r < rows, inside `ys` (n × w.rows, checked by `check_lengths`). lhs is `xs`
        // (n × cols, row-major); rhs is the tile transposed: (k, r) at r·cols + k, inside the
        // tile (rows × cols). No two of them overlap; `read_dst` is false.
        unsafe {
            gemm::gemm(
                n,
                rows,
                w.cols,
                ys.as_mut_ptr().add(r0),
                1,
                w.rows as isize,
                false,
                xs.as_ptr(),
                1,
                w.cols as isize,
                tile.as_ptr(),
                w.cols as isize,
                1,
                0.0,
                1.0,
                false,
                false,
                false,
                parallelism,
            );
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
