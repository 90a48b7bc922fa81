//! Matrix × vector(s) for weights of any [`DType`]: `y = W·x` for one or more activation
//! vectors, rows split across the rayon pool.
//!
//! Weights stay in their stored type: each row is dotted block by block with a group of
//! vectors at a time (see [`crate::cpu::BatchDot`]), so a quantized model is never expanded
//! to f32 in memory, and a vector's result does not depend on the batch it came in.
//!
//! Two precisions ([`Precision`]): `exact` keeps activations in f32 (the reference, and
//! what agrees with transformers token for token); `fast` quantizes them per 32-value
//! block to 8 bits and dots them with the weights in integers, as llama.cpp does, where
//! the weight type has such a kernel ([`crate::cpu::int8`]); other types stay exact.

use rayon::prelude::*;

use crate::cpu::BatchDot;
use crate::cpu::int8::{self, Q8Acts};
use crate::{DType, KernelError, quant};

/// How activations meet the weights in [`matmul_in`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Precision {
    /// f32 activations: the reference arithmetic.
    #[default]
    Exact,
    /// 8-bit activations per 32-value block and integer dot products, for Q8_0, Q4_0,
    /// Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS weights (every
    /// quantized type); exact for the float types.
    Fast,
}

impl Precision {
    /// Whether a matrix of `dtype` with `cols` columns takes the 8-bit path.
    pub fn quantizes(self, dtype: DType, cols: usize) -> bool {
        self == Precision::Fast && int8::supports(dtype) && cols.is_multiple_of(int8::BLOCK)
    }
}

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

/// Weight bytes of the rows that one vector group runs through before the next group: small
/// enough that the tile stays in L1/L2 while every group of the batch passes over it.
const TILE_BYTES: usize = 16 << 10;

/// Values made by one task of [`Input::make`] without quantization: a longer input is made
/// across the pool.
const PARALLEL_VALUES: usize = 16 * 1024;

/// Tasks per pool thread for a batched matmul: enough that the last ones to finish are short.
const TASKS_PER_THREAD: usize = 8;

/// `ys[t] = W · xs[t]` for `n = xs.len() / cols` vectors laid out one after another;
/// `ys` holds `n × rows` values.
///
/// Batch invariant: `ys[t]` is the same bits for any `n`, any position `t` and any other
/// vectors, and equal to the n = 1 result of `xs[t]` alone. Every (row, vector) dot product
/// runs the same single-vector accumulation; batching only shares the unpacking of each
/// weight block between groups of vectors ([`BatchDot`]), and the row split across threads
/// does not touch any one dot product. Batch invariance holds per code path: the AVX2 and
/// the scalar paths round differently.
pub fn matmul(w: &MatRef<'_>, xs: &[f32], ys: &mut [f32]) -> Result<(), KernelError> {
    matmul_in(w, xs, ys, Precision::Exact)
}

/// [`matmul`] in `precision`. Batch invariant in both (a vector's 8-bit blocks depend on
/// its own values only).
pub fn matmul_in(
    w: &MatRef<'_>,
    xs: &[f32],
    ys: &mut [f32],
    precision: Precision,
) -> Result<(), KernelError> {
    matmul_input(w, &Input::new(xs, precision), ys)
}

/// Activation vectors for one or more matmuls in one precision. In `fast`, their 8-bit
/// blocks are made once, on first use, and shared by every matmul of this input (a
/// layer's q, k and v; gate and up), in buffers reused from input to input on this thread.
#[derive(Debug)]
pub struct Input<'a> {
    xs: &'a [f32],
    precision: Precision,
    q8: std::cell::OnceCell<Q8Acts>,
}

impl<'a> Input<'a> {
    pub fn new(xs: &'a [f32], precision: Precision) -> Input<'a> {
        Input {
            xs,
            precision,
            q8: std::cell::OnceCell::new(),
        }
    }

    /// An input made vector by vector: `row(t, x)` writes vector `t` (`x`, `cols` values of
    /// `xs`). In `fast`, each vector is quantized right after it is made, while it is in
    /// cache (the norm or gated activation before a matmul, fused with its quantization),
    /// for every matmul of this input that takes the 8-bit path; the same bits as making
    /// the vectors, then [`Input::new`]. Vectors are made across the pool when the input is
    /// long.
    pub fn make(
        xs: &'a mut [f32],
        cols: usize,
        precision: Precision,
        row: impl Fn(usize, &mut [f32]) + Sync,
    ) -> Result<Input<'a>, KernelError> {
        if cols == 0 || !xs.len().is_multiple_of(cols) {
            return Err(KernelError::Length {
                what: "an input's vectors (a multiple of its columns)",
                expected: cols,
                actual: xs.len(),
            });
        }
        let q8 = std::cell::OnceCell::new();
        if precision == Precision::Fast && cols.is_multiple_of(int8::BLOCK) {
            let mut acts = SPARE.with_borrow_mut(Option::take).unwrap_or_default();
            acts.make(xs, cols, row)?;
            let _ = q8.set(acts);
        } else if xs.len() < PARALLEL_VALUES {
            xs.chunks_mut(cols).enumerate().for_each(|(t, x)| row(t, x));
        } else {
            (xs.par_chunks_mut(cols).enumerate())
                .with_min_len((PARALLEL_VALUES / 4 / cols).max(1))
                .for_each(|(t, x)| row(t, x));
        }
        Ok(Input { xs, precision, q8 })
    }

    /// Values in all (vectors × columns).
    pub fn len(&self) -> usize {
        self.xs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.xs.is_empty()
    }

    /// Whether a matmul of this input with `w` takes the 8-bit path.
    pub fn quantizes(&self, w: &MatRef<'_>) -> bool {
        self.precision.quantizes(w.dtype, w.cols)
    }

    /// The 8-bit blocks of rows of `cols` values (every matmul of one input has the same).
    fn quantized(&self, cols: usize) -> Result<&Q8Acts, KernelError> {
        if let Some(acts) = self.q8.get() {
            if acts.cols() != cols {
                return Err(KernelError::Length {
                    what: "columns of another matmul of the same input",
                    expected: acts.cols(),
                    actual: cols,
                });
            }
            return Ok(acts);
        }
        let mut acts = SPARE.with_borrow_mut(Option::take).unwrap_or_default();
        acts.requantize(self.xs, cols)?;
        Ok(self.q8.get_or_init(|| acts))
    }
}

impl Drop for Input<'_> {
    fn drop(&mut self) {
        if let Some(acts) = self.q8.take() {
            SPARE.with_borrow_mut(|spare| *spare = Some(acts));
        }
    }
}

thread_local! {
    /// The buffers of the last dropped [`Input`] on this thread, for the next one.
    static SPARE: std::cell::RefCell<Option<Q8Acts>> = const { std::cell::RefCell::new(None) };
}

/// [`matmul`] of `x`'s vectors, in its precision.
pub fn matmul_input(w: &MatRef<'_>, x: &Input<'_>, ys: &mut [f32]) -> Result<(), KernelError> {
    let xs = x.xs;
    let n = check_lengths(w, xs, ys)?;
    if n == 0 || w.rows == 0 {
        return Ok(());
    }
    if x.precision.quantizes(w.dtype, w.cols) {
        let acts = x.quantized(w.cols)?;
        let dot = |rows: &[u8], first, count, out: &mut [f32]| {
            acts.dot_rows(w.dtype, rows, first, count, out)
        };
        return by_rows(w, n, Q8Acts::GROUP, ys, dot);
    }
    let dots = BatchDot::new(xs, w.cols, w.dtype)?;
    let dot = |rows: &[u8], first, count, out: &mut [f32]| dots.dot_rows(rows, first, count, out);
    by_rows(w, n, dots.group(), ys, dot)
}

/// [`matmul_input`] of one input with several matrices (a layer's q, k and v; gate and
/// up): `ys[i] = ws[i]·x`, the same bits as one matmul at a time. For one vector (decode)
/// the matrices' rows are split across the pool together, so the pool synchronizes once
/// for all of them instead of once per matrix; nothing is allocated for it.
pub fn matmul_input_many<const N: usize>(
    ws: &[MatRef<'_>; N],
    x: &Input<'_>,
    ys: [&mut [f32]; N],
) -> Result<(), KernelError> {
    let mut single = true;
    for (w, y) in ws.iter().zip(ys.iter()) {
        single &= check_lengths(w, x.xs, y)? == 1;
    }
    if !single {
        for (w, y) in ws.iter().zip(ys) {
            matmul_input(w, x, y)?;
        }
        return Ok(());
    }
    /// How one matrix meets the input.
    enum Dots<'a> {
        Int8(&'a Q8Acts),
        Float(BatchDot<'a>),
    }
    let dots = ws.each_ref().map(|w| match x.quantizes(w) {
        true => x.quantized(w.cols).map(Dots::Int8),
        false => BatchDot::new(x.xs, w.cols, w.dtype).map(Dots::Float),
    });
    if let Some(Err(e)) = dots.iter().find(|d| d.is_err()) {
        return Err(e.clone());
    }
    let rows: usize = ws.iter().map(|w| w.rows).sum();
    let per_task = rows
        .div_ceil(rayon::current_num_threads())
        .max(MIN_ROWS_PER_TASK);
    // Each matrix's rows in runs of `per_task` (the last one shorter): one task each,
    // numbered matrix after matrix.
    let runs = ws.map(|w| w.rows.div_ceil(per_task));
    let outs = ys.map(|y| Scatter(y.as_mut_ptr()));
    (0..runs.iter().sum::<usize>())
        .into_par_iter()
        .try_for_each(|mut task| {
            let mut m = 0;
            while task >= runs[m] {
                task -= runs[m];
                m += 1;
            }
            let w = &ws[m];
            let (first, end) = (task * per_task, ((task + 1) * per_task).min(w.rows));
            // SAFETY: `ys[m]` holds `w.rows` values (checked above, one vector), and each
            // task writes its own run of them.
            let out = unsafe { std::slice::from_raw_parts_mut(outs[m].at(first), end - first) };
            let row_bytes = w.dtype.row_bytes(w.cols)?;
            let rows = &w.data[first * row_bytes..end * row_bytes];
            match &dots[m] {
                Ok(Dots::Int8(acts)) => acts.dot_rows(w.dtype, rows, 0, 1, out),
                Ok(Dots::Float(dots)) => dots.dot_rows(rows, 0, 1, out),
                Err(e) => Err(e.clone()),
            }
        })
}

/// [`matmul_input`] in the 8-bit path, summed in f64 ([`int8::Sum`]): this rank's part of
/// a row-parallel projection, whose partial sums the group adds before rounding them to
/// f32. An error where the input does not take the 8-bit path with `w`
/// ([`Input::quantizes`]).
pub fn matmul_input_wide(w: &MatRef<'_>, x: &Input<'_>, ys: &mut [f64]) -> Result<(), KernelError> {
    let n = check_lengths(w, x.xs, ys)?;
    if !x.quantizes(w) {
        return Err(KernelError::NoIntegerKernel {
            dtype: w.dtype,
            cols: w.cols,
            precision: x.precision,
        });
    }
    if n == 0 || w.rows == 0 {
        return Ok(());
    }
    let acts = x.quantized(w.cols)?;
    let dot = |rows: &[u8], first, count, out: &mut [f64]| {
        acts.dot_rows(w.dtype, rows, first, count, out)
    };
    by_rows(w, n, Q8Acts::GROUP, ys, dot)
}

/// Splits `w`'s rows across the pool and calls `dot(rows, first, count, out)` for groups of
/// `group` vectors over tiles of rows (`out`: the tile's `n` results per row).
fn by_rows<Y: Copy + Default + Send + Sync>(
    w: &MatRef<'_>,
    n: usize,
    group: usize,
    ys: &mut [Y],
    dot: impl Fn(&[u8], usize, usize, &mut [Y]) -> Result<(), KernelError> + Sync,
) -> Result<(), KernelError> {
    let threads = rayon::current_num_threads();
    let row_bytes = w.dtype.row_bytes(w.cols)?;
    // One group (decode): a task per thread, since each task costs a few µs of the pool's
    // time and a decode step runs hundreds of small matmuls (seen on SmolLM2 at 2 threads:
    // 10% more tokens/s than four tasks per thread). Nothing to reuse a tile for, so a
    // task's rows are one call.
    let per_thread = w.rows.div_ceil(threads).max(MIN_ROWS_PER_TASK);
    if n == 1 {
        return ys
            .par_chunks_mut(per_thread)
            .enumerate()
            .try_for_each(|(task, out)| {
                let r = task * per_thread;
                dot(
                    &w.data[r * row_bytes..(r + out.len()) * row_bytes],
                    0,
                    1,
                    out,
                )
            });
    }
    // Larger batches: each task runs a span of the vectors (whole groups) through a tile
    // of rows, which stays in cache for every group of the span. Spans split the vectors
    // only as far as the pool needs tasks to balance: a long prefill would otherwise end
    // each matmul with one thread running a last tile through the whole batch.
    let groups = n.div_ceil(group);
    let (tile_rows, spans) = if groups == 1 {
        (per_thread, 1)
    } else {
        let tile_rows = (TILE_BYTES / row_bytes.max(1)).clamp(1, w.rows);
        let tasks = if threads > 1 {
            threads * TASKS_PER_THREAD
        } else {
            1
        };
        (
            tile_rows,
            tasks.div_ceil(w.rows.div_ceil(tile_rows)).min(groups),
        )
    };
    let span = groups.div_ceil(spans) * group;
    let (tiles, spans) = (w.rows.div_ceil(tile_rows), n.div_ceil(span));
    // The one check the raw writes rely on:
    assert_eq!(ys.len(), n * w.rows, "matmul output");
    let out = Scatter(ys.as_mut_ptr());
    (0..tiles * spans)
        .into_par_iter()
        .try_for_each_init(Vec::new, |tile, task| {
            let (r0, v0) = (task / spans * tile_rows, task % spans * span);
            let (r1, v1) = ((r0 + tile_rows).min(w.rows), (v0 + span).min(n));
            // Only this span's values are written and read: no need to clear the rest.
            let len = (r1 - r0) * n;
            if tile.len() < len {
                tile.resize(len, Y::default());
            }
            let tile = &mut tile[..len];
            let rows = &w.data[r0 * row_bytes..r1 * row_bytes];
            for first in (v0..v1).step_by(group) {
                // A span's last part group is run as a whole group that ends with the span,
                // its first vectors computed twice (to the same bits): cheaper than running
                // them one by one.
                let first = if first + group > v1 && v1 - v0 >= group {
                    v1 - group
                } else {
                    first
                };
                dot(rows, first, group.min(v1 - first), tile)?;
            }
            // Vector by vector, so that the writes run along `ys`.
            for t in v0..v1 {
                for (r, results) in (r0..r1).zip(tile.chunks_exact(n)) {
                    // SAFETY: t < n and r < rows index inside `ys` (n × rows values,
                    // asserted above), and only this task writes (t, r).
                    unsafe { out.at(t * w.rows + r).write(results[t]) };
                }
            }
            Ok::<(), KernelError>(())
        })
}

/// `ys` written by the tasks of [`by_rows`], each at indices of its own.
struct Scatter<Y>(*mut Y);

// SAFETY: the tasks write disjoint indices of a buffer that outlives them (`by_rows`).
unsafe impl<Y: Send> Sync for Scatter<Y> {}

impl<Y> Scatter<Y> {
    /// The address of value `i` (a method, so that closures capture the wrapper).
    fn at(&self, i: usize) -> *mut Y {
        self.0.wrapping_add(i)
    }
}

fn check_lengths<Y>(w: &MatRef<'_>, xs: &[f32], ys: &[Y]) -> Result<usize, KernelError> {
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
