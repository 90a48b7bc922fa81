//! The sampling kernel's launch (`sampling.cu`): one token per row of logits by the rule
//! of [`crate::cpu::sample_threshold`], its twin. A step's settings and draws cross to the
//! device in one copy and its tokens come back in one, through buffers made once
//! ([`SampleBuffers`]), so sampling a step allocates nothing.

use cudarc::driver::{CudaSlice, PushKernelArg};

use super::{Ops, SAMPLE_THREADS, rows, u32_of};
use crate::cpu::RowDraw;
use crate::cuda::CudaError;

/// Words of one row's settings (`PARAM_WORDS` in `sampling.cu`): temperature, top_k,
/// top_p, min_p and the uniform draw, f32 bits but top_k.
const PARAM_WORDS: usize = 5;

/// The device and host buffers of [`Ops::sample`] for up to `rows` rows.
#[derive(Debug)]
pub struct SampleBuffers {
    rows: usize,
    params: CudaSlice<u32>,
    tokens: CudaSlice<u32>,
    /// The host side of `params`, refilled each step.
    staged: Vec<u32>,
}

impl SampleBuffers {
    /// Rows the buffers hold.
    pub fn rows(&self) -> usize {
        self.rows
    }
}

/// Row `draw`'s settings as the kernel reads them.
fn words(draw: &RowDraw) -> [u32; PARAM_WORDS] {
    let p = &draw.params;
    [
        p.temperature.to_bits(),
        p.top_k,
        p.top_p.to_bits(),
        p.min_p.to_bits(),
        draw.uniform.to_bits(),
    ]
}

impl Ops<'_> {
    /// Buffers for sampling up to `rows` rows at once.
    pub fn sample_buffers(&self, rows: usize) -> Result<SampleBuffers, CudaError> {
        Ok(SampleBuffers {
            rows,
            params: self.alloc(rows.max(1) * PARAM_WORDS)?,
            tokens: self.alloc(rows.max(1))?,
            staged: Vec::with_capacity(rows * PARAM_WORDS),
        })
    }

    /// Samples row i of `logits` (rows of `vocab` values; the buffer may hold more rows
    /// than `draws`) with `draws[i]` into `buffers`; [`Ops::sampled_tokens`] reads them.
    pub fn sample(
        &self,
        buffers: &mut SampleBuffers,
        logits: &CudaSlice<f32>,
        vocab: usize,
        draws: &[RowDraw],
    ) -> Result<(), CudaError> {
        let n = draws.len();
        if n > buffers.rows {
            return Err(CudaError::Shape {
                what: "sampled rows (within the sampling buffers)",
                expected: buffers.rows,
                actual: n,
            });
        }
        if vocab == 0 || n * vocab > logits.len() {
            return Err(CudaError::Shape {
                what: "sampled logits (rows × vocab within the buffer)",
                expected: logits.len(),
                actual: n * vocab,
            });
        }
        if n == 0 {
            return Ok(());
        }
        buffers.staged.clear();
        buffers.staged.extend(draws.iter().flat_map(words));
        let mut params = buffers.params.slice_mut(..n * PARAM_WORDS);
        self.stream()
            .memcpy_htod(&buffers.staged, &mut params)
            .map_err(|e| self.device_error("copying sampling settings", e))?;
        let v = u32_of("vocab", vocab)?;
        let config = rows(n, SAMPLE_THREADS)?;
        let mut a = self.builder("sample_rows")?;
        a.arg(&mut buffers.tokens)
            .arg(logits)
            .arg(&v)
            .arg(&buffers.params);
        self.run("sample_rows", &mut a, config)
    }

    /// The tokens of the last [`Ops::sample`], one per row of `out` (waits for the stream).
    pub fn sampled_tokens(
        &self,
        buffers: &SampleBuffers,
        out: &mut [u32],
    ) -> Result<(), CudaError> {
        if out.len() > buffers.rows {
            return Err(CudaError::Shape {
                what: "sampled tokens (within the sampling buffers)",
                expected: buffers.rows,
                actual: out.len(),
            });
        }
        self.stream()
            .memcpy_dtoh(&buffers.tokens.slice(..out.len()), out)
            .map_err(|e| self.device_error("copying sampled tokens", e))
    }
}
