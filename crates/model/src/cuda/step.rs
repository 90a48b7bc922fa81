//! The end of a pass on the device, and the buffers it keeps for it.
//!
//! Every row that wants logits comes back as its [`RowRequest`] asks. Where the device
//! samples (one rank, and some row asks to), `sample_rows` runs on the logits where they
//! are, and only the token ids cross to the host, with the logits of the rows that need
//! them (logprobs, or penalties that keep a sequence's sampling on the host). Otherwise
//! every row's logits cross, all-gathered over the group's vocabulary slices.
//!
//! The buffers ([`StepBuffers`]: the final-normed rows, their logits, the sampling
//! settings and tokens) are made with the KV cache for [`DEFAULT_STEP_ROWS`] rows and
//! reused by every step. A step with more rows grows them once, to the next power of two,
//! with a warning: the shard does not know the coordinator's step budget, and refusing
//! such a step would fail the group's epoch where a one-time allocation costs a
//! millisecond.

use std::time::{Duration, Instant};

use tessera_comm::Collective;
use tessera_kernels::cpu::RowDraw;
use tessera_kernels::cuda::{CudaSlice, Ops, SampleBuffers};
use tracing::warn;

use super::CudaLlama;
use crate::error::ModelError;
use crate::rows::{
    RowOutput, RowRequest, assemble, device_draws, rows_to_download, samples_on_device,
};

/// Rows that want logits in one step, that the buffers are first made for: the
/// coordinator's default `max_running` and `step_tokens` (256), which bound the
/// sequences a step samples.
pub const DEFAULT_STEP_ROWS: usize = 256;

/// Where the host's time went in the last pass.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PassTiming {
    /// From the call to its return.
    pub wall: Duration,
    /// Blocked until the device finished the pass (the wait before its results cross).
    pub device_wait: Duration,
}

impl PassTiming {
    /// The host's own part: everything but the wait for the device. A pass whose
    /// collectives stage through the host waits inside them too; that counts here.
    pub fn host(&self) -> Duration {
        self.wall.saturating_sub(self.device_wait)
    }
}

/// What finishing the rows of a step uses.
#[derive(Debug)]
pub(crate) struct FinishBuffers {
    sample: SampleBuffers,
    draws: Vec<RowDraw>,
    tokens: Vec<u32>,
}

/// The buffers of a step after the layers, for up to `rows` rows that want logits.
#[derive(Debug)]
pub(crate) struct StepBuffers {
    rows: usize,
    hidden: usize,
    vocab_rows: usize,
    /// The final-normed rows that want logits (an eager pass gathers them here), and
    /// their bf16 rounding.
    pub(crate) normed: CudaSlice<f32>,
    pub(crate) normed16: CudaSlice<u16>,
    /// Their logits over this rank's vocabulary rows (a graph has its own).
    pub(crate) logits: CudaSlice<f32>,
    pub(crate) finish: FinishBuffers,
}

impl StepBuffers {
    /// Buffers for `rows` rows of `hidden` values and `vocab_rows` logits.
    pub(crate) fn new(
        ops: &Ops<'_>,
        rows: usize,
        hidden: usize,
        vocab_rows: usize,
    ) -> Result<StepBuffers, ModelError> {
        Ok(StepBuffers {
            rows,
            hidden,
            vocab_rows,
            normed: ops.alloc(rows * hidden)?,
            normed16: ops.alloc(rows * hidden)?,
            logits: ops.alloc(rows * vocab_rows)?,
            finish: FinishBuffers {
                sample: ops.sample_buffers(rows)?,
                draws: Vec::with_capacity(rows),
                tokens: Vec::with_capacity(rows),
            },
        })
    }

    /// Rows the buffers hold.
    pub(crate) fn rows(&self) -> usize {
        self.rows
    }

    /// Device bytes the buffers take.
    pub(crate) fn device_bytes(&self) -> usize {
        self.rows * (self.hidden * (4 + 2) + self.vocab_rows * 4 + 6 * 4)
    }

    /// Makes room for a step of `rows` rows: nothing when they fit, else new buffers for
    /// [`grown_rows`], once, with a warning.
    pub(crate) fn fit(&mut self, ops: &Ops<'_>, rows: usize) -> Result<(), ModelError> {
        if rows <= self.rows {
            return Ok(());
        }
        let grown = grown_rows(rows);
        warn!(
            rows,
            capacity = self.rows,
            grown_to = grown,
            "a step has more rows that want logits than its buffers were made for: they grow"
        );
        *self = StepBuffers::new(ops, grown, self.hidden, self.vocab_rows)?;
        Ok(())
    }
}

/// The rows buffers grow to for a step of `rows` rows: the next power of two, so that a
/// workload that keeps growing allocates a few times, not at every step.
fn grown_rows(rows: usize) -> usize {
    rows.next_power_of_two()
}

impl CudaLlama {
    /// Brings each row of `logits` (this rank's vocabulary rows of every row that wants
    /// logits; the buffer may hold more rows) to the host as its request asks. Returns the
    /// rows' outputs and how long the host waited for the device.
    pub(super) fn finish(
        &self,
        ops: &Ops<'_>,
        logits: &CudaSlice<f32>,
        requests: &[RowRequest],
        buffers: &mut FinishBuffers,
        comm: &mut dyn Collective,
    ) -> Result<(Vec<RowOutput>, Duration), ModelError> {
        let n = requests.len();
        let width = self.head().rows;
        if comm.world_size() > 1 || !samples_on_device(requests) {
            let waited = wait(ops)?;
            let rows = ops.download_prefix(logits, n * width)?;
            let logits = self.sharding.gather_logits(&rows, n, comm)?;
            return Ok((logits.into_iter().map(RowOutput::Logits).collect(), waited));
        }
        device_draws(requests, &mut buffers.draws);
        ops.sample(&mut buffers.sample, logits, width, &buffers.draws)?;
        let waited = wait(ops)?;
        buffers.tokens.resize(n, 0);
        ops.sampled_tokens(&buffers.sample, &mut buffers.tokens)?;
        let downloaded = rows_to_download(requests)
            .map(|r| ops.download_range(logits, r * width..(r + 1) * width))
            .collect::<Result<Vec<_>, _>>()?;
        Ok((assemble(requests, &buffers.tokens, downloaded), waited))
    }
}

/// Waits for everything enqueued; how long that took.
fn wait(ops: &Ops<'_>) -> Result<Duration, ModelError> {
    let started = Instant::now();
    ops.synchronize()?;
    Ok(started.elapsed())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_grow_to_the_next_power_of_two() {
        assert_eq!(grown_rows(257), 512);
        assert_eq!(grown_rows(512), 512);
        assert_eq!(grown_rows(1000), 1024);
    }

    #[test]
    fn host_time_is_the_wall_time_less_the_wait_for_the_device() {
        let t = PassTiming {
            wall: Duration::from_micros(900),
            device_wait: Duration::from_micros(850),
        };
        assert_eq!(t.host(), Duration::from_micros(50));
        assert_eq!(PassTiming::default().host(), Duration::ZERO);
    }
}
