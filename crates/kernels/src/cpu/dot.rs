//! Dot products of one stored weight row with one or more activation vectors, dispatched on
//! the weight's [`DType`] and the CPU's [`Features`].
//!
//! [`BatchDot`] holds `n` vectors and dots a row with a run of them at once: each weight
//! block is unpacked once per group of up to [`BatchDot::group`] vectors. A vector's result
//! is the same bits whatever the group, the run or the other vectors (see `avx2.rs`); the
//! scalar path is [`quant::dot_rows`], which has the same property.

use super::Features;
use crate::{DType, KernelError, quant};

/// Activation vectors prepared for many row dot products: `n` vectors of `cols` values laid
/// out one after another, plus what a type's kernel wants of each vector, made once instead
/// of once per row: the per-32-block sums of the Q4_1 and Q5_1 min terms, or the vector in
/// the lane order of the AVX2 Q2_K kernel (`interleave_q2_k`).
#[derive(Debug)]
pub struct BatchDot<'a> {
    dtype: DType,
    cols: usize,
    xs: &'a [f32],
    /// The same number of values per vector (empty for other types).
    prepared: Vec<f32>,
    features: Features,
}

impl<'a> BatchDot<'a> {
    /// Prepares the `xs.len() / cols` vectors of `xs` for rows of `cols` values of `dtype`.
    pub fn new(xs: &'a [f32], cols: usize, dtype: DType) -> Result<BatchDot<'a>, KernelError> {
        dtype.row_bytes(cols)?;
        if cols == 0 || !xs.len().is_multiple_of(cols) {
            return Err(KernelError::Length {
                what: "activation vectors (a multiple of the row's columns)",
                expected: cols,
                actual: xs.len(),
            });
        }
        let features = Features::get();
        let mut prepared = Vec::new();
        match dtype {
            DType::Q4_1 | DType::Q5_1 => {
                prepared = spare_buffer();
                prepared.extend(xs.chunks(32).map(|c| c.iter().sum::<f32>()));
            }
            DType::Q2K if features.avx2 => {
                prepared = spare_buffer();
                interleave_q2_k(xs, &mut prepared);
            }
            _ => {}
        }
        Ok(BatchDot {
            dtype,
            cols,
            xs,
            prepared,
            features,
        })
    }

    /// The number of vectors.
    pub fn len(&self) -> usize {
        self.xs.len() / self.cols
    }

    pub fn is_empty(&self) -> bool {
        self.xs.is_empty()
    }

    /// How many vectors one kernel call takes: runs of this many share each unpacked weight
    /// block. Chosen so that the accumulators of the whole group fit in the 16 AVX registers.
    pub fn group(&self) -> usize {
        match self.dtype {
            DType::F32 => 3,
            _ => 4,
        }
    }

    /// Dots each of the whole rows in `rows` (`cols` values of the prepared type each) with
    /// vectors `first..first + count`: `out[i·n + j] = row_i · x_j` for those `j`, where `n`
    /// is [`BatchDot::len`]; `out` holds `n` values per row, and the others stay untouched.
    pub fn dot_rows(
        &self,
        rows: &[u8],
        first: usize,
        count: usize,
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        let row_bytes = self.dtype.row_bytes(self.cols)?;
        if row_bytes == 0 || !rows.len().is_multiple_of(row_bytes) {
            return Err(KernelError::ByteLength {
                what: "weight rows (a multiple of the row size)",
                expected: row_bytes,
                actual: rows.len(),
            });
        }
        let n = self.len();
        if out.len() != rows.len() / row_bytes * n {
            return Err(KernelError::Length {
                what: "row dot outputs (rows × vectors)",
                expected: rows.len() / row_bytes * n,
                actual: out.len(),
            });
        }
        if first + count > n {
            return Err(KernelError::Length {
                what: "vectors to dot (first + count)",
                expected: n,
                actual: first + count,
            });
        }
        let run = RowRun {
            rows,
            row_bytes,
            first,
            count,
        };
        match self.group() {
            3 => self.dot_run::<3>(run, out),
            _ => self.dot_run::<4>(run, out),
        }
    }

    /// The `count` vectors from `first` on, as `T` slices of `cols` values.
    fn xs<const T: usize>(&self, first: usize) -> [&'a [f32]; T] {
        let cols = self.cols;
        std::array::from_fn(|j| &self.xs[(first + j) * cols..][..cols])
    }

    /// What the type's kernel wants of `T` vectors from `first` on (empty slices for other
    /// types).
    fn prepared<const T: usize>(&self, first: usize) -> [&[f32]; T] {
        let each = self.prepared.len() / self.len().max(1);
        std::array::from_fn(|j| &self.prepared[(first + j) * each..][..each])
    }

    /// Each row with the run's vectors in groups of `T`, then one at a time: a vector's bits
    /// depend on neither. Dispatches on the path and type once per run, not once per row.
    fn dot_run<const T: usize>(&self, run: RowRun<'_>, out: &mut [f32]) -> Result<(), KernelError> {
        let n = self.len();
        // `$call` computes the dot products of `$row` with the vectors `$xs` (and their block
        // sums `$sums`), as many as its destination holds: groups of T, then single vectors.
        // Groups run outside rows so that a group's slices are made once per run.
        macro_rules! each_row {
            ($row:ident, $xs:ident, $sums:ident, $call:expr) => {{
                let groups_end = run.first + run.count / T * T;
                for first in (run.first..groups_end).step_by(T) {
                    let ($xs, $sums) = (self.xs::<T>(first), self.prepared::<T>(first));
                    let rows = run.rows.chunks_exact(run.row_bytes);
                    for ($row, out) in rows.zip(out.chunks_exact_mut(n)) {
                        if let Some(ys) = out[first..].first_chunk_mut::<T>() {
                            *ys = $call;
                        }
                    }
                }
                for first in groups_end..run.first + run.count {
                    let ($xs, $sums) = (self.xs::<1>(first), self.prepared::<1>(first));
                    let rows = run.rows.chunks_exact(run.row_bytes);
                    for ($row, out) in rows.zip(out.chunks_exact_mut(n)) {
                        [out[first]] = $call;
                    }
                }
            }};
        }
        #[cfg(target_arch = "x86_64")]
        if self.features.avx2 {
            use super::avx2;
            // SAFETY: `features.avx2` says AVX2, FMA and F16C are present; `dot_rows` checked
            // that every row holds exactly the bytes of `cols` values of `dtype`, and every
            // `x` is `cols` long (sliced by `xs`), with `cols / 32` block sums each for Q4_1 and
            // Q5_1, and `cols` interleaved values each for Q2_K.
            unsafe {
                match self.dtype {
                    DType::F32 => each_row!(row, xs, _s, avx2::dot_f32(&bytemuck_f32(row), xs)),
                    DType::F16 => each_row!(row, xs, _s, avx2::dot_f16(row, xs)),
                    DType::BF16 => each_row!(row, xs, _s, avx2::dot_bf16(row, xs)),
                    DType::Q8_0 => each_row!(row, xs, _s, avx2::dot_q8_0(row, xs)),
                    DType::Q4_0 => each_row!(row, xs, _s, avx2::dot_q4_0(row, xs)),
                    DType::Q4_1 => each_row!(row, xs, sums, avx2::dot_q4_1(row, xs, sums)),
                    DType::Q5_0 => each_row!(row, xs, _s, avx2::dot_q5_0(row, xs)),
                    DType::Q5_1 => each_row!(row, xs, sums, avx2::dot_q5_1(row, xs, sums)),
                    DType::Q4K => each_row!(row, xs, _s, avx2::dot_q4_k(row, xs)),
                    DType::Q5K => each_row!(row, xs, _s, avx2::dot_q5_k(row, xs)),
                    DType::Q3K => each_row!(row, xs, _s, avx2::dot_q3_k(row, xs)),
                    DType::Q2K => each_row!(row, _x, lanes, avx2::dot_q2_k(row, lanes)),
                    DType::IQ4NL => each_row!(row, xs, _s, avx2::dot_iq4_nl(row, xs)),
                    DType::IQ4XS => each_row!(row, xs, _s, avx2::dot_iq4_xs(row, xs)),
                    DType::F8E4M3 => each_row!(row, xs, _s, avx2::dot_f8_e4m3(row, xs)),
                    DType::Q6K => each_row!(row, xs, _s, avx2::dot_q6_k(row, xs)),
                }
            }
            return Ok(());
        }
        each_row!(row, xs, _s, quant::dot_rows(self.dtype, row, xs)?);
        Ok(())
    }
}

impl Drop for BatchDot<'_> {
    /// Keeps the prepared buffer for this thread's next [`BatchDot`] (a decode step makes
    /// hundreds), unless it is long or enough are kept.
    fn drop(&mut self) {
        let mut buffer = std::mem::take(&mut self.prepared);
        if buffer.capacity() == 0 || buffer.capacity() > SPARE_VALUES {
            return;
        }
        buffer.clear();
        // Nothing to keep while the thread is exiting.
        let _ = SPARE.try_with(|spare| {
            let mut spare = spare.borrow_mut();
            if spare.len() < SPARE_BUFFERS {
                spare.push(buffer);
            }
        });
    }
}

/// Prepared buffers kept per thread: one for each matrix that [`crate::matmul`] runs on one
/// input at once (q, k and v), and one more.
const SPARE_BUFFERS: usize = 4;

/// The longest prepared buffer kept (in values): a decode step's, not a long prefill's.
const SPARE_VALUES: usize = 1 << 16;

thread_local! {
    /// Prepared buffers of dropped [`BatchDot`]s, for the next ones on this thread.
    static SPARE: std::cell::RefCell<Vec<Vec<f32>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// An empty buffer, kept from an earlier [`BatchDot`] where this thread has one.
fn spare_buffer() -> Vec<f32> {
    SPARE
        .try_with(|spare| spare.borrow_mut().pop())
        .ok()
        .flatten()
        .unwrap_or_default()
}

/// Appends `xs` to `out` with each 32 values `v` reordered so that position `8k + i` holds
/// `v[4i + k]`: the order in which the AVX2 Q2_K kernel unpacks a block's 2-bit values, 8
/// per register (`k`: the byte of each 32-bit lane it shifts down, `i`: the lane).
fn interleave_q2_k(xs: &[f32], out: &mut Vec<f32>) {
    out.reserve(xs.len());
    out.extend((xs.chunks_exact(32)).flat_map(|v| (0..32).map(move |p| v[4 * (p % 8) + p / 8])));
}

/// The rows and the run of vectors of one [`BatchDot::dot_rows`] call, checked.
#[derive(Clone, Copy)]
struct RowRun<'r> {
    rows: &'r [u8],
    row_bytes: usize,
    first: usize,
    count: usize,
}

/// An activation vector prepared for many row dot products: a [`BatchDot`] of one vector.
#[derive(Debug)]
pub struct RowDot<'a> {
    x: &'a [f32],
    batch: Option<BatchDot<'a>>,
}

impl<'a> RowDot<'a> {
    /// Prepares `x` for rows of type `dtype`.
    pub fn new(x: &'a [f32], dtype: DType) -> RowDot<'a> {
        RowDot {
            x,
            batch: BatchDot::new(x, x.len(), dtype).ok(),
        }
    }

    /// Σ row·x where `row` holds one row of `dtype` values, `x.len()` of them.
    pub fn dot(&self, dtype: DType, row: &[u8]) -> Result<f32, KernelError> {
        let mut out = [0.0];
        match &self.batch {
            Some(batch) if batch.dtype == dtype => batch.dot_rows(row, 0, 1, &mut out)?,
            // An empty `x` is no batch: the scalar product (0, or a length error).
            _ if self.x.is_empty() => return quant::dot_rows(dtype, row, [self.x]).map(|[v]| v),
            // Prepared for another type: prepare again (which reports a partial block).
            _ => BatchDot::new(self.x, self.x.len(), dtype)?.dot_rows(row, 0, 1, &mut out)?,
        }
        Ok(out[0])
    }
}

/// Σ a·b with the best kernel this CPU has.
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if Features::get().avx2 {
        // SAFETY: AVX2 and FMA are present.
        return unsafe { super::avx2::dot_f32(a, [b])[0] };
    }
    a.iter().zip(b).map(|(a, b)| a * b).sum()
}

/// Views little-endian f32 bytes as floats, copying only when the bytes are misaligned.
fn bytemuck_f32(bytes: &[u8]) -> std::borrow::Cow<'_, [f32]> {
    match bytemuck::try_cast_slice(bytes) {
        Ok(floats) => std::borrow::Cow::Borrowed(floats),
        Err(_) => std::borrow::Cow::Owned(
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        ),
    }
}
