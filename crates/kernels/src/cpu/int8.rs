//! The `fast` precision's row dots, as llama.cpp computes them: each activation vector is
//! quantized per 32-value block to 8 bits ([`Q8Acts`]), and each weight block is dotted
//! with it in integers. For every quantized type: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K,
//! Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS (Q4_K's and Q5_K's 32-value sub-blocks are the
//! activation blocks, each with its own scale and min, IQ4_XS's each with its scale; the
//! 16-value sub-blocks of Q6_K, Q3_K and Q2_K enter the integer sum with their scales, and
//! their `d` is the block's factor; Q2_K's mins multiply the vector's sums of each 16
//! values, [`Q8Row::hsum`], in an integer sum of their own under `dmin`; IQ4's levels are
//! 8-bit integers). The float types keep the exact f32 kernels in `fast` mode.
//!
//! **The arithmetic, shared by every path to the bit.** Each 32-value block `b` gives its
//! whole integer sum `Σ w·x` (exact: below 2^24 in magnitude); it is multiplied by the
//! block's factor `d_w·d_x` (rounded once, in the sum's type [`Sum`]) and added with one
//! fused multiply-add into chain [`chain`]`(b)` (`b mod 4`, but for the blocks after the
//! last whole quad); a row's min terms (Q4_1's and Q5_1's `m_w·(d_x·Σq_x)`,
//! Q4_K's and Q5_K's `dmin·m` the same way) go into four chains of their own by the same
//! rule. The chains add as `(c0 + c2) + (c1 + c3)` ([`add_chains`]), and the mins' total is
//! added to (Q4_1, Q5_1) or taken from (Q4_K, Q5_K) the blocks' total last. AVX2 (`vpmaddubsw` + `vpmaddwd`) and
//! AVX-512 VNNI (`vpdpbusd`) give the same exact integer sums, so the scalar reference
//! here, the AVX2 path and the VNNI path agree bit for bit, and a vector's result depends
//! on nothing but its own values: batch invariant. The blocks are those of the weight's
//! columns, so a tensor-parallel split at block boundaries quantizes each block the same:
//! tp invariant.

use rayon::prelude::*;

use super::Features;
mod reference;
use crate::{DType, KernelError};
pub use reference::{add_chains, chain, dot_reference, dot_reference_in};

/// Values per activation block.
pub const BLOCK: usize = 32;

/// 1.5·2^23: see [`quantize_blocks`].
const ROUNDER: f32 = 12_582_912.0;

/// An input of fewer values is quantized on the calling thread; a larger one (a prefill's)
/// across the pool.
const PARALLEL_VALUES: usize = 16 * 1024;

/// Values per task once an input is quantized across the pool: small tasks, so that the
/// pool's threads finish together.
const TASK_VALUES: usize = 4 * 1024;

/// One run of whole blocks as [`Q8Acts`] holds them: the values, and per block its scale,
/// `d·Σq` and the two halves' `Σq`.
struct Blocks<'a> {
    qs: &'a mut [i8],
    d: &'a mut [f32],
    dsum: &'a mut [f32],
    hsum: &'a mut [i32],
}

/// Quantizes the whole blocks of `xs` into `out`.
fn quantize_blocks(xs: &[f32], out: Blocks<'_>) {
    let Blocks { qs, d, dsum, hsum } = out;
    let blocks = xs.chunks_exact(BLOCK).zip(qs.chunks_exact_mut(BLOCK));
    let sums = d.iter_mut().zip(dsum).zip(hsum.chunks_exact_mut(2));
    for ((x, q), ((d, dsum), hsum)) in blocks.zip(sums) {
        let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        *d = amax / 127.0;
        let inverse = if *d > 0.0 { 1.0 / *d } else { 0.0 };
        for (q, x) in q.iter_mut().zip(x) {
            // To the nearest, ties to even (as llama.cpp's SIMD quantizers round): adding
            // and taking away 1.5·2^23 leaves the integer nearest a value below 2^22, in
            // plain float arithmetic that vectorizes (no `roundf` call).
            *q = ((x * inverse + ROUNDER) - ROUNDER) as i8;
        }
        for (h, q) in hsum.iter_mut().zip(q.chunks_exact(BLOCK / 2)) {
            *h = q.iter().map(|&q| i32::from(q)).sum();
        }
        *dsum = *d * (hsum[0] + hsum[1]) as f32;
    }
}

/// Values per octet: 8 activation blocks read together ([`Q8Row::octets`]).
pub const OCTET: usize = 8 * BLOCK;

/// One vector's whole octets of blocks (`qs`) interleaved into `octets`: in octet `o`, the
/// 32 bytes `s` hold the 4 values `4s..4s + 4` of each of blocks `8o..8o + 8` in turn. One
/// `vpdpbusd` of such 32 bytes with weights laid out alike adds to 8 blocks' sums at once.
fn interleave_octets(qs: &[i8], octets: &mut [i8]) {
    for (octet, qs) in octets.chunks_exact_mut(OCTET).zip(qs.chunks_exact(OCTET)) {
        for (s, quads) in octet.chunks_exact_mut(32).enumerate() {
            for (k, quad) in quads.chunks_exact_mut(4).enumerate() {
                quad.copy_from_slice(&qs[k * BLOCK + 4 * s..][..4]);
            }
        }
    }
}

/// The float type a row's block products are summed in ([`Q8Acts::dot_rows`]): `f32` for
/// a matmul whose output is final; `f64` ("wide") for the partial sums of a row-parallel
/// projection, which are added across the ranks before they are rounded to f32, so that the
/// total does not depend on how the columns were split. Both run the module's arithmetic;
/// in f64 a block's factor `scale·d_x` is exact (24 bits times 24).
pub trait Sum:
    Copy
    + Default
    + Send
    + Sync
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
{
    const WIDE: bool;
    /// `a·b + c`, rounded once.
    fn mul_add(a: Self, b: Self, c: Self) -> Self;
    fn from_f32(v: f32) -> Self;
    /// A kernel's result (an f32 widened, for `f32`).
    fn from_f64(v: f64) -> Self;
    /// This value as a kernel returns it (exact).
    fn to_f64(self) -> f64;
}

impl Sum for f32 {
    const WIDE: bool = false;
    fn mul_add(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
    fn from_f32(v: f32) -> f32 {
        v
    }
    fn from_f64(v: f64) -> f32 {
        v as f32
    }
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
}

impl Sum for f64 {
    const WIDE: bool = true;
    fn mul_add(a: f64, b: f64, c: f64) -> f64 {
        a.mul_add(b, c)
    }
    fn from_f32(v: f32) -> f64 {
        f64::from(v)
    }
    fn from_f64(v: f64) -> f64 {
        v
    }
    fn to_f64(self) -> f64 {
        self
    }
}

/// Whether `fast` has an integer kernel for weights of `dtype`.
pub fn supports(dtype: DType) -> bool {
    matches!(
        dtype,
        DType::Q8_0
            | DType::Q4_0
            | DType::Q4_1
            | DType::Q5_0
            | DType::Q5_1
            | DType::Q2K
            | DType::Q3K
            | DType::Q4K
            | DType::Q5K
            | DType::Q6K
            | DType::IQ4NL
            | DType::IQ4XS
    )
}

/// `n` activation vectors of `cols` values, each 32-value block as 32 × i8 with an f32
/// scale: `x ≈ d·q`, `d = max|x| / 127`, `q = round(x / d)` (to the nearest, ties to even).
#[derive(Clone, Debug, Default)]
pub struct Q8Acts {
    cols: usize,
    qs: Vec<i8>,
    /// Each vector's whole octets of blocks, interleaved ([`Q8Row::octets`]).
    octets: Vec<i8>,
    /// Per block: `d`.
    d: Vec<f32>,
    /// Per block: `d·Σq` (the Q4_1 min terms' factor).
    dsum: Vec<f32>,
    /// Per 16 values: `Σq` (Q2_K's min terms, per half block).
    hsum: Vec<i32>,
}

/// One quantized vector, as the kernels read it.
#[derive(Clone, Copy, Debug)]
pub struct Q8Row<'a> {
    pub qs: &'a [i8],
    /// The vector's whole octets (blocks `8o..8o + 8`), 256 bytes each: bytes
    /// `32s..32s + 32` of octet `o` hold values `4s..4s + 4` of each of its 8 blocks in turn.
    pub octets: &'a [i8],
    pub d: &'a [f32],
    pub dsum: &'a [f32],
    /// Per 16 values (two a block): `Σq`.
    pub hsum: &'a [i32],
}

impl Q8Acts {
    /// Quantizes the `xs.len() / cols` vectors of `xs`; `cols` must be a multiple of 32.
    pub fn quantize(xs: &[f32], cols: usize) -> Result<Q8Acts, KernelError> {
        let mut acts = Q8Acts::default();
        acts.requantize(xs, cols)?;
        Ok(acts)
    }

    /// [`Q8Acts::quantize`] into this one's buffers (no allocation once they are large
    /// enough).
    pub fn requantize(&mut self, xs: &[f32], cols: usize) -> Result<(), KernelError> {
        self.resize(xs.len(), cols)?;
        // Each block on its own: the same bits however the blocks are split.
        if xs.len() < PARALLEL_VALUES {
            let out = Blocks {
                qs: &mut self.qs,
                d: &mut self.d,
                dsum: &mut self.dsum,
                hsum: &mut self.hsum,
            };
            quantize_blocks(xs, out);
        } else {
            let blocks = TASK_VALUES / BLOCK;
            (xs.par_chunks(TASK_VALUES))
                .zip(self.qs.par_chunks_mut(TASK_VALUES))
                .zip(self.d.par_chunks_mut(blocks))
                .zip(self.dsum.par_chunks_mut(blocks))
                .zip(self.hsum.par_chunks_mut(2 * blocks))
                .for_each(|((((xs, qs), d), dsum), hsum)| {
                    quantize_blocks(xs, Blocks { qs, d, dsum, hsum })
                });
        }
        self.interleave();
        Ok(())
    }

    /// Makes the `xs.len() / cols` vectors of `xs`, each with `row(t, x)` (`x`: vector `t`
    /// of `xs`, to write), and quantizes each one as soon as it is made, while its values
    /// are in cache: the norm or gated activation that makes a matmul's input, fused with
    /// its quantization. The same bits as making every vector, then [`Q8Acts::requantize`].
    /// Vectors are made across the pool when the input is long (a prefill's).
    pub fn make(
        &mut self,
        xs: &mut [f32],
        cols: usize,
        row: impl Fn(usize, &mut [f32]) + Sync,
    ) -> Result<(), KernelError> {
        self.resize(xs.len(), cols)?;
        let blocks = cols / BLOCK;
        type Vector<'v> = (
            (
                ((&'v mut [f32], &'v mut [i8]), &'v mut [f32]),
                &'v mut [f32],
            ),
            &'v mut [i32],
        );
        let make = |(t, ((((x, qs), d), dsum), hsum)): (usize, Vector<'_>)| {
            row(t, x);
            quantize_blocks(x, Blocks { qs, d, dsum, hsum });
        };
        if xs.len() < PARALLEL_VALUES {
            (xs.chunks_mut(cols))
                .zip(self.qs.chunks_mut(cols))
                .zip(self.d.chunks_mut(blocks))
                .zip(self.dsum.chunks_mut(blocks))
                .zip(self.hsum.chunks_mut(2 * blocks))
                .enumerate()
                .for_each(make);
        } else {
            (xs.par_chunks_mut(cols))
                .zip(self.qs.par_chunks_mut(cols))
                .zip(self.d.par_chunks_mut(blocks))
                .zip(self.dsum.par_chunks_mut(blocks))
                .zip(self.hsum.par_chunks_mut(2 * blocks))
                .enumerate()
                .with_min_len((TASK_VALUES / cols).max(1))
                .for_each(make);
        }
        self.interleave();
        Ok(())
    }

    /// The buffers sized for `len` values of whole vectors of `cols`.
    fn resize(&mut self, len: usize, cols: usize) -> Result<(), KernelError> {
        if cols == 0 || !cols.is_multiple_of(BLOCK) || !len.is_multiple_of(cols) {
            return Err(KernelError::Length {
                what: "activations to quantize (whole 32-value blocks of whole vectors)",
                expected: cols,
                actual: len,
            });
        }
        self.cols = cols;
        self.qs.resize(len, 0);
        self.d.resize(len / BLOCK, 0.0);
        self.dsum.resize(len / BLOCK, 0.0);
        self.hsum.resize(len / (BLOCK / 2), 0);
        self.octets.resize(len / cols * (cols / OCTET * OCTET), 0);
        Ok(())
    }

    /// Each vector's whole octets from its blocks ([`Q8Row::octets`]).
    fn interleave(&mut self) {
        let per_vector = self.cols / OCTET * OCTET;
        if per_vector == 0 {
            return;
        }
        let vectors = self
            .octets
            .chunks_mut(per_vector)
            .zip(self.qs.chunks(self.cols));
        if self.qs.len() < PARALLEL_VALUES {
            vectors.for_each(|(octets, qs)| interleave_octets(qs, octets));
        } else {
            (self.octets.par_chunks_mut(per_vector))
                .zip(self.qs.par_chunks(self.cols))
                .for_each(|(octets, qs)| interleave_octets(qs, octets));
        }
    }

    /// The number of vectors.
    pub fn len(&self) -> usize {
        self.qs.len() / self.cols.max(1)
    }

    pub fn is_empty(&self) -> bool {
        self.qs.is_empty()
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Vector `t`.
    pub fn row(&self, t: usize) -> Q8Row<'_> {
        let blocks = self.cols / BLOCK;
        let octets = self.cols / OCTET * OCTET;
        Q8Row {
            qs: &self.qs[t * self.cols..][..self.cols],
            octets: &self.octets[t * octets..][..octets],
            d: &self.d[t * blocks..][..blocks],
            dsum: &self.dsum[t * blocks..][..blocks],
            hsum: &self.hsum[t * 2 * blocks..][..2 * blocks],
        }
    }
}

impl Q8Acts {
    /// How many vectors one kernel call takes (they share each unpacked weight block).
    pub const GROUP: usize = 8;

    /// Dots each of the whole rows in `rows` (of `dtype`, `cols` values each) with vectors
    /// `first..first + count`: `out[i·n + j] = row_i · x_j` for those `j`, where `n` is
    /// [`Q8Acts::len`]; the other values of `out` stay untouched. Summed in `S` ([`Sum`]).
    pub fn dot_rows<S: Sum>(
        &self,
        dtype: DType,
        rows: &[u8],
        first: usize,
        count: usize,
        out: &mut [S],
    ) -> Result<(), KernelError> {
        let row_bytes = dtype.row_bytes(self.cols)?;
        let n = self.len();
        if !supports(dtype) || row_bytes == 0 || !rows.len().is_multiple_of(row_bytes) {
            return Err(KernelError::ByteLength {
                what: "8-bit-activation weight rows (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, \
                       Q4_K, Q5_K, Q6_K, IQ4_NL or IQ4_XS; whole rows)",
                expected: row_bytes,
                actual: rows.len(),
            });
        }
        if out.len() != rows.len() / row_bytes * n || first + count > n {
            return Err(KernelError::Length {
                what: "row dot outputs (rows × vectors) for vectors first..first + count",
                expected: rows.len() / row_bytes * n,
                actual: out.len(),
            });
        }
        let kernels = Kernels::for_type(dtype, Features::get(), S::WIDE);
        /// Rows per kernel call (their results go through a buffer on the stack).
        const CHUNK: usize = 32;
        // Vectors `g..g + T` with every row, `CHUNK` rows per kernel call.
        macro_rules! run {
            ($g:expr, $t:expr, $kernel:expr) => {{
                let g = $g;
                let xs: [Q8Row<'_>; $t] = std::array::from_fn(|j| self.row(g + j));
                let mut buf = [[0.0f64; $t]; CHUNK];
                let chunks = rows
                    .chunks(CHUNK * row_bytes)
                    .zip(out.chunks_mut(CHUNK * n));
                for (rows, out) in chunks {
                    let buf = &mut buf[..rows.len() / row_bytes];
                    run_rows::<S, $t>($kernel, dtype, rows, row_bytes, xs, buf);
                    for (ys, out) in buf.iter().zip(out.chunks_exact_mut(n)) {
                        for (o, y) in out[g..g + $t].iter_mut().zip(ys) {
                            *o = S::from_f64(*y);
                        }
                    }
                }
            }};
        }
        const GROUP: usize = Q8Acts::GROUP;
        let groups_end = first + count / GROUP * GROUP;
        for g in (first..groups_end).step_by(GROUP) {
            run!(g, GROUP, kernels.simd.map(|(group, _)| group));
        }
        for t in groups_end..first + count {
            run!(t, 1, kernels.simd.map(|(_, one)| one));
        }
        Ok(())
    }
}

/// A SIMD kernel: whole rows of the given length, each with `T` vectors, into one result
/// per row (an f32 sum comes widened).
type Kernel<const T: usize> = unsafe fn(&[u8], usize, [Q8Row<'_>; T], &mut [[f64; T]]);

/// The kernels of one weight type on this CPU, for a group of vectors and for one; none
/// (the scalar reference) where the CPU has neither AVX2 nor VNNI.
#[derive(Clone, Copy)]
struct Kernels {
    simd: Option<(Kernel<{ Q8Acts::GROUP }>, Kernel<1>)>,
}

impl Kernels {
    /// The kernels summing in f64 when `wide`, else in f32.
    fn for_type(dtype: DType, features: Features, wide: bool) -> Kernels {
        #[cfg(target_arch = "x86_64")]
        {
            use super::avx2::int8 as k;
            const G: usize = Q8Acts::GROUP;
            macro_rules! pick {
                ($kernel:ident) => {
                    Some(if wide {
                        (
                            k::$kernel::<G, true> as Kernel<G>,
                            k::$kernel::<1, true> as Kernel<1>,
                        )
                    } else {
                        (
                            k::$kernel::<G, false> as Kernel<G>,
                            k::$kernel::<1, false> as Kernel<1>,
                        )
                    })
                };
            }
            let simd = match (dtype, features.vnni, features.avx2) {
                (DType::Q8_0, true, _) => pick!(dot_q8_0_vnni),
                (DType::Q4_0, true, _) => pick!(dot_q4_0_vnni),
                (DType::Q4_1, true, _) => pick!(dot_q4_1_vnni),
                (DType::Q5_0, true, _) => pick!(dot_q5_0_vnni),
                (DType::Q5_1, true, _) => pick!(dot_q5_1_vnni),
                (DType::Q2K, true, _) => pick!(dot_q2_k_vnni),
                (DType::Q3K, true, _) => pick!(dot_q3_k_vnni),
                (DType::Q4K, true, _) => pick!(dot_q4_k_vnni),
                (DType::Q5K, true, _) => pick!(dot_q5_k_vnni),
                (DType::Q6K, true, _) => pick!(dot_q6_k_vnni),
                (DType::IQ4NL, true, _) => pick!(dot_iq4_nl_vnni),
                (DType::IQ4XS, true, _) => pick!(dot_iq4_xs_vnni),
                (DType::Q8_0, _, true) => pick!(dot_q8_0),
                (DType::Q4_0, _, true) => pick!(dot_q4_0),
                (DType::Q4_1, _, true) => pick!(dot_q4_1),
                (DType::Q5_0, _, true) => pick!(dot_q5_0),
                (DType::Q5_1, _, true) => pick!(dot_q5_1),
                (DType::Q2K, _, true) => pick!(dot_q2_k),
                (DType::Q3K, _, true) => pick!(dot_q3_k),
                (DType::Q4K, _, true) => pick!(dot_q4_k),
                (DType::Q5K, _, true) => pick!(dot_q5_k),
                (DType::Q6K, _, true) => pick!(dot_q6_k),
                (DType::IQ4NL, _, true) => pick!(dot_iq4_nl),
                (DType::IQ4XS, _, true) => pick!(dot_iq4_xs),
                _ => None,
            };
            Kernels { simd }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (dtype, features, wide);
            Kernels { simd: None }
        }
    }
}

/// The rows of `rows` (`row_bytes` each) dotted with each of `xs`, one result per row,
/// through `kernel` (one of [`Kernels::for_type`]'s), or the scalar reference without one.
/// Lengths checked by the caller: whole blocks of a supported type, one per 32 values of
/// every vector.
fn run_rows<S: Sum, const T: usize>(
    kernel: Option<Kernel<T>>,
    dtype: DType,
    rows: &[u8],
    row_bytes: usize,
    xs: [Q8Row<'_>; T],
    out: &mut [[f64; T]],
) {
    if let Some(kernel) = kernel {
        // SAFETY: `for_type` picked the kernel for this CPU's features; the caller checked
        // the lengths.
        return unsafe { kernel(rows, row_bytes, xs, out) };
    }
    reference_rows::<S, T>(dtype, rows, row_bytes, xs, out);
}

/// [`run_rows`] by the scalar reference.
fn reference_rows<S: Sum, const T: usize>(
    dtype: DType,
    rows: &[u8],
    row_bytes: usize,
    xs: [Q8Row<'_>; T],
    out: &mut [[f64; T]],
) {
    for (row, out) in rows.chunks_exact(row_bytes).zip(out) {
        *out = xs.map(|x| dot_reference_in::<S>(dtype, row, x).map_or(f64::NAN, S::to_f64));
    }
}

#[cfg(test)]
mod tests;
