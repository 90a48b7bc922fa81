//! Typed launches of the kernels on one stream. Each checks its buffers' lengths against
//! the shape it is given, so a wrong size is an error here, never an access out of bounds
//! on the device. bf16 buffers are `u16` (the bits of a bf16). The projections' launches
//! (`round_bf16`, `add_bias`, `matvec_quantized`, `gemv_bf16`, with `Blas::gemm_bf16`) take views as
//! well as whole buffers, so that a step can run on the first rows of buffers sized for
//! the largest step.

use std::sync::Arc;

use cudarc::driver::{
    CudaSlice, CudaStream, CudaView, DevicePtr, DevicePtrMut, LaunchArgs, LaunchConfig,
    PushKernelArg, SyncOnDrop,
};

use super::device::CudaDevice;
use super::{CudaError, Held};

pub mod attention;
pub mod flash;
mod fused;
pub mod gemv;
mod paged;
mod sampling;

pub use attention::{Append, AttentionKernel};
use fused::NormOut;
pub use fused::RopeKv;
pub use paged::{AttentionIndex, AttentionTarget, Slots};
pub use sampling::SampleBuffers;

/// Threads per block of the row kernels (a multiple of 32).
const ROW_THREADS: u32 = 256;
/// Warps per block of the matvec kernels.
const MATVEC_WARPS: u32 = 4;
/// Threads per block of the attention kernels.
const ATTENTION_THREADS: u32 = 128;
/// Threads per block of the sampling kernel (`__launch_bounds__` in `sampling.cu`).
const SAMPLE_THREADS: u32 = 1024;

/// The threads per block each kernel is launched with (what its registers must fit:
/// `crates/kernels/tests/nvrtc.rs` checks with ptxas), `None` for an unknown entry.
pub fn block_threads(entry: &str) -> Option<u32> {
    match entry {
        _ if entry.starts_with("matvec_") => Some(32 * MATVEC_WARPS),
        "paged_attention_partition"
        | "paged_attention_partition_f32"
        | "paged_attention_reduce" => Some(ATTENTION_THREADS),
        "sample_rows" => Some(SAMPLE_THREADS),
        _ if entry.starts_with("gemv_bf16_") => Some(gemv::GEMV_THREADS),
        _ if entry.starts_with("attention_grouped_") => Some(attention::GROUPED_THREADS),
        _ if entry.starts_with("attention_flash_") => Some(flash::FLASH_THREADS),
        _ => super::source::family_of(entry).map(|_| ROW_THREADS),
    }
}
/// Positions per attention partition (`PART` in `attention.cu`).
pub const ATTENTION_PART: usize = 256;
/// The largest head the attention kernel holds in shared memory.
pub const MAX_HEAD_DIM: usize = 256;

/// The kernels of one device, launched on one stream.
#[derive(Debug)]
pub struct Ops<'a> {
    device: &'a CudaDevice,
    stream: Arc<CudaStream>,
    /// Kernels launched through this value (cuBLAS calls count one each).
    launches: std::cell::Cell<u64>,
    /// Device buffers allocated through this value.
    allocations: std::cell::Cell<u64>,
}

/// `actual` must be `expected`: a [`CudaError::Shape`] naming `what` otherwise.
pub(crate) fn check(what: &'static str, expected: usize, actual: usize) -> Result<(), CudaError> {
    if expected == actual {
        Ok(())
    } else {
        Err(CudaError::Shape {
            what,
            expected,
            actual,
        })
    }
}

fn u32_of(what: &'static str, n: usize) -> Result<u32, CudaError> {
    u32::try_from(n).map_err(|_| CudaError::Shape {
        what,
        expected: u32::MAX as usize,
        actual: n,
    })
}

/// `len / width`: `len` must be whole rows of a nonzero `width`, a [`CudaError::Shape`]
/// naming `what` otherwise.
fn whole_rows(what: &'static str, len: usize, width: usize) -> Result<usize, CudaError> {
    if width == 0 || !len.is_multiple_of(width) {
        return Err(CudaError::Shape {
            what,
            expected: width,
            actual: len,
        });
    }
    Ok(len / width)
}

/// Tokens of a projection `ys[t, r] = Σ_c W[r, c] · xs[t, c]` of `rows × cols`, whose
/// weights, inputs and outputs hold `w`, `xs` and `ys` values: `W` must be `rows × cols`,
/// `xs` whole rows of `cols`, `ys` `tokens × rows` (`Blas::gemm_bf16` and
/// [`Ops::gemv_bf16`] alike).
pub(crate) fn projection_tokens(
    (w, xs, ys): (usize, usize, usize),
    (rows, cols): (usize, usize),
) -> Result<usize, CudaError> {
    check("projection weight (rows × cols)", rows * cols, w)?;
    let tokens = whole_rows("projection input (whole rows of cols)", xs, cols)?;
    check("projection output (tokens × rows)", tokens * rows, ys)?;
    Ok(tokens)
}

/// Tokens of a `gate_up` of `len` values: rows of a gate and an up projection of `inter`
/// values each.
fn gate_up_tokens(len: usize, inter: usize) -> Result<usize, CudaError> {
    whole_rows("gate_up (a multiple of 2 × inter)", len, 2 * inter)
}

/// A grid's y or z extent: at most 65,535 blocks.
fn grid_yz(what: &'static str, n: usize) -> Result<u32, CudaError> {
    if n > 65_535 {
        return Err(CudaError::Shape {
            what,
            expected: 65_535,
            actual: n,
        });
    }
    u32_of(what, n)
}

fn rows(n: usize, threads: u32) -> Result<LaunchConfig, CudaError> {
    Ok(LaunchConfig {
        grid_dim: (u32_of("rows", n)?, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// A grid-stride launch over `n` values.
fn spread(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(ROW_THREADS as usize).clamp(1, 65_535);
    LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (ROW_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl<'a> Ops<'a> {
    pub fn new(device: &'a CudaDevice, stream: Arc<CudaStream>) -> Ops<'a> {
        Ops {
            device,
            stream,
            launches: std::cell::Cell::new(0),
            allocations: std::cell::Cell::new(0),
        }
    }

    /// Kernels launched so far through this value.
    pub fn launches(&self) -> u64 {
        self.launches.get()
    }

    /// Device buffers allocated so far through this value ([`Ops::alloc`], [`Ops::upload`]
    /// and what is built from them): a step that reuses its buffers allocates none.
    pub fn allocations(&self) -> u64 {
        self.allocations.get()
    }

    /// Counts a launch made outside [`Ops`]'s kernels (a cuBLAS call).
    pub fn count_launch(&self) {
        self.launches.set(self.launches.get() + 1);
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The device address of an optional output, 0 (a null pointer, which the kernel
    /// checks) when absent, with the guard that orders the buffer on this stream: keep it
    /// until the launch is enqueued.
    fn optional_out<'b, T>(
        &'b self,
        buf: Option<&'b mut CudaSlice<T>>,
    ) -> (u64, Option<SyncOnDrop<'b>>) {
        match buf {
            Some(b) => {
                let (ptr, guard) = b.device_ptr_mut(&self.stream);
                (ptr, Some(guard))
            }
            None => (0, None),
        }
    }

    /// A launch of kernel `entry` on this stream; push its arguments, then [`Ops::run`].
    fn builder(&self, entry: &'static str) -> Result<LaunchArgs<'_>, CudaError> {
        let function = self.device.function(entry).ok_or(CudaError::Device {
            ordinal: self.device.ordinal(),
            message: format!("kernel {entry} is not loaded"),
        })?;
        Ok(self.stream.launch_builder(function))
    }

    fn run(
        &self,
        entry: &'static str,
        args: &mut LaunchArgs<'_>,
        config: LaunchConfig,
    ) -> Result<(), CudaError> {
        self.count_launch();
        // SAFETY: every caller pushes the arguments of `entry` in order and type (see its
        // `.cu` file) and has checked each buffer's length against the shape the kernel
        // indexes with.
        unsafe { args.launch(config) }.map_err(|e| CudaError::Device {
            ordinal: self.device.ordinal(),
            message: format!("launching {entry}: {e}"),
        })?;
        Ok(())
    }

    /// `out[t] = table[ids[t] − vocab_start]` (bf16 or f32 → f32), zero for ids outside the
    /// table's `rows` rows.
    pub fn embedding<T: Held>(
        &self,
        out: &mut CudaSlice<f32>,
        table: &CudaSlice<T>,
        ids: &CudaSlice<u32>,
        hidden: usize,
        vocab_start: u32,
    ) -> Result<(), CudaError> {
        let tokens = ids.len();
        check("embedding out", tokens * hidden, out.len())?;
        let table_rows = whole_rows(
            "embedding table (a multiple of hidden)",
            table.len(),
            hidden,
        )?;
        let (h, rows_n) = (u32_of("hidden", hidden)?, u32_of("rows", table_rows)?);
        let config = rows(tokens, ROW_THREADS)?;
        let entry = T::entry("embedding_gather_bf16", "embedding_gather_f32");
        let mut a = self.builder(entry)?;
        a.arg(out)
            .arg(table)
            .arg(ids)
            .arg(&h)
            .arg(&vocab_start)
            .arg(&rows_n);
        self.run(entry, &mut a, config)
    }

    /// Per token: `residual += x` (if given), `out = rmsnorm(residual) · weight`.
    pub fn rmsnorm_residual(
        &self,
        out: &mut CudaSlice<f32>,
        residual: &mut CudaSlice<f32>,
        x: Option<&CudaSlice<f32>>,
        weight: &CudaSlice<f32>,
        eps: f32,
    ) -> Result<(), CudaError> {
        self.rmsnorm(NormOut::F32(out), residual, x, weight, eps)
    }

    /// Rotates q (`tokens × q_heads × head_dim`) and k (`tokens × k_heads × head_dim`) in
    /// place; `pairing` 0: halves (HuggingFace), 1: adjacent (GGUF).
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        q: &mut CudaSlice<f32>,
        k: &mut CudaSlice<f32>,
        positions: &CudaSlice<u32>,
        inv_freq: &CudaSlice<f32>,
        q_heads: usize,
        k_heads: usize,
        pairing: u32,
    ) -> Result<(), CudaError> {
        let head_dim = inv_freq.len() * 2;
        let tokens = positions.len();
        check("rope q", tokens * q_heads * head_dim, q.len())?;
        check("rope k", tokens * k_heads * head_dim, k.len())?;
        let (qh, kh, hd) = (
            u32_of("q_heads", q_heads)?,
            u32_of("k_heads", k_heads)?,
            u32_of("head_dim", head_dim)?,
        );
        let config = rows(tokens, ROW_THREADS)?;
        let mut a = self.builder("rope_f32")?;
        a.arg(q)
            .arg(k)
            .arg(positions)
            .arg(inv_freq)
            .arg(&qh)
            .arg(&kh)
            .arg(&hd)
            .arg(&pairing);
        self.run("rope_f32", &mut a, config)
    }

    /// `out[t, i] = silu(gate_up[t, i]) · gate_up[t, inter + i]` (one fused projection per
    /// token: gate, then up).
    pub fn silu_mul(
        &self,
        out: &mut CudaSlice<f32>,
        gate_up: &CudaSlice<f32>,
        inter: usize,
    ) -> Result<(), CudaError> {
        let tokens = gate_up_tokens(gate_up.len(), inter)?;
        check("silu_mul out", tokens * inter, out.len())?;
        let gate: CudaView<'_, f32> = gate_up.slice(..);
        let up: CudaView<'_, f32> = gate_up.slice(inter..);
        let (i, stride, t) = (
            u32_of("inter", inter)?,
            u32_of("stride", 2 * inter)?,
            u32_of("tokens", tokens)?,
        );
        let config = spread(tokens * inter);
        let mut a = self.builder("silu_mul_f32")?;
        a.arg(out).arg(&gate).arg(&up).arg(&i).arg(&stride).arg(&t);
        self.run("silu_mul_f32", &mut a, config)
    }

    /// `out[i] = bf16(x[i])` (round to nearest even): a GEMM's input.
    pub fn round_bf16(
        &self,
        out: &mut impl DevicePtrMut<u16>,
        x: &impl DevicePtr<f32>,
    ) -> Result<(), CudaError> {
        check("round_bf16 out", x.len(), out.len())?;
        let n = u32_of("round_bf16 values", x.len())?;
        let config = spread(x.len());
        let (out, _out) = out.device_ptr_mut(&self.stream);
        let (x, _x) = x.device_ptr(&self.stream);
        let mut a = self.builder("round_bf16")?;
        a.arg(&out).arg(&x).arg(&n);
        self.run("round_bf16", &mut a, config)
    }

    /// `y[t] += bias` for every row of `bias.len()` values.
    pub fn add_bias(
        &self,
        y: &mut impl DevicePtrMut<f32>,
        bias: &CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        if bias.is_empty() || !y.len().is_multiple_of(bias.len()) {
            return Err(CudaError::Shape {
                what: "add_bias y (a multiple of the bias)",
                expected: bias.len(),
                actual: y.len(),
            });
        }
        let (cols, n) = (
            u32_of("bias", bias.len())?,
            u32_of("add_bias values", y.len())?,
        );
        let config = spread(y.len());
        let (y, _y) = y.device_ptr_mut(&self.stream);
        let mut a = self.builder("add_bias_f32")?;
        a.arg(&y).arg(bias).arg(&cols).arg(&n);
        self.run("add_bias_f32", &mut a, config)
    }

    /// `out[t, r] = Σ_c W[r, c] · x[t, c]` for block-quantized `w` (`rows` rows of `cols`)
    /// of a type with a kernel (`DType::cuda_matvec`).
    pub fn matvec_quantized(
        &self,
        out: &mut impl DevicePtrMut<f32>,
        w: &CudaSlice<u8>,
        dtype: crate::DType,
        x: &impl DevicePtr<f32>,
        rows_n: usize,
        cols: usize,
    ) -> Result<(), CudaError> {
        let Some(entry) = dtype.cuda_matvec() else {
            return Err(CudaError::Unsupported {
                what: format!("a dequantizing matvec for {dtype}"),
            });
        };
        let (block_elems, block_bytes) = (dtype.block_elems(), dtype.block_bytes());
        if cols == 0 || !cols.is_multiple_of(block_elems) || !x.len().is_multiple_of(cols) {
            return Err(CudaError::Shape {
                what: "matvec cols (whole blocks) and x (whole rows)",
                expected: block_elems,
                actual: cols,
            });
        }
        check(
            "matvec weight bytes",
            rows_n * cols / block_elems * block_bytes,
            w.len(),
        )?;
        let tokens = x.len() / cols;
        check("matvec out", tokens * rows_n, out.len())?;
        let (r, c) = (u32_of("rows", rows_n)?, u32_of("cols", cols)?);
        let config = LaunchConfig {
            grid_dim: (
                r.div_ceil(MATVEC_WARPS),
                grid_yz("matvec tokens (grid y)", tokens)?,
                1,
            ),
            block_dim: (32 * MATVEC_WARPS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (out, _out) = out.device_ptr_mut(&self.stream);
        let (x, _x) = x.device_ptr(&self.stream);
        let mut a = self.builder(entry)?;
        a.arg(&out).arg(w).arg(&x).arg(&r).arg(&c);
        self.run(entry, &mut a, config)
    }

    /// A copy of `host` on the device.
    pub fn upload<T: cudarc::driver::DeviceRepr>(
        &self,
        host: &[T],
    ) -> Result<CudaSlice<T>, CudaError> {
        self.allocations.set(self.allocations.get() + 1);
        self.stream
            .clone_htod(host)
            .map_err(|e| self.driver_error("copying to the device", e))
    }

    /// `n` zeros on the device.
    pub fn alloc<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> Result<CudaSlice<T>, CudaError> {
        self.allocations.set(self.allocations.get() + 1);
        self.stream
            .alloc_zeros(n)
            .map_err(|e| self.driver_error("allocating", e))
    }

    /// The first `n` values of `dev` on the host (waits for the stream).
    pub fn download_prefix<T: cudarc::driver::DeviceRepr + Default + Clone>(
        &self,
        dev: &CudaSlice<T>,
        n: usize,
    ) -> Result<Vec<T>, CudaError> {
        self.download_range(dev, 0..n)
    }

    /// Values `range` of `dev` on the host (waits for the stream).
    pub fn download_range<T: cudarc::driver::DeviceRepr + Default + Clone>(
        &self,
        dev: &CudaSlice<T>,
        range: std::ops::Range<usize>,
    ) -> Result<Vec<T>, CudaError> {
        if range.start > range.end || range.end > dev.len() {
            return Err(CudaError::Shape {
                what: "downloaded range (within the buffer)",
                expected: dev.len(),
                actual: range.end,
            });
        }
        let mut host = vec![T::default(); range.len()];
        self.stream
            .memcpy_dtoh(&dev.slice(range), &mut host)
            .map_err(|e| self.driver_error("copying to the host", e))?;
        Ok(host)
    }

    /// Copies `host` into `dev` (the same length).
    pub fn copy_to_device<T: cudarc::driver::DeviceRepr>(
        &self,
        host: &[T],
        dev: &mut CudaSlice<T>,
    ) -> Result<(), CudaError> {
        check("host to device copy", dev.len(), host.len())?;
        self.stream
            .memcpy_htod(host, dev)
            .map_err(|e| self.driver_error("copying to the device", e))
    }

    /// `out[i] = src[rows[i]]` for rows of `width` values, device to device, into the first
    /// rows of `out`.
    pub fn gather_rows(
        &self,
        out: &mut CudaSlice<f32>,
        src: &CudaSlice<f32>,
        rows: &[usize],
        width: usize,
    ) -> Result<(), CudaError> {
        if rows.len() * width > out.len() {
            return Err(CudaError::Shape {
                what: "gathered rows (within the output)",
                expected: out.len(),
                actual: rows.len() * width,
            });
        }
        for (i, &r) in rows.iter().enumerate() {
            if (r + 1) * width > src.len() {
                return Err(CudaError::Shape {
                    what: "gathered row (inside the source)",
                    expected: src.len() / width.max(1),
                    actual: r,
                });
            }
            let from = src.slice(r * width..(r + 1) * width);
            let mut to = out.slice_mut(i * width..(i + 1) * width);
            self.stream
                .memcpy_dtod(&from, &mut to)
                .map_err(|e| self.driver_error("copying rows", e))?;
        }
        Ok(())
    }

    /// A copy of `dev` on the host (waits for the stream).
    pub fn download<T: cudarc::driver::DeviceRepr>(
        &self,
        dev: &CudaSlice<T>,
    ) -> Result<Vec<T>, CudaError> {
        self.stream
            .clone_dtoh(dev)
            .map_err(|e| self.driver_error("copying to the host", e))
    }

    pub(crate) fn device_error(&self, what: &str, e: cudarc::driver::DriverError) -> CudaError {
        self.driver_error(what, e)
    }

    /// A device-to-device copy's bandwidth in GB/s of bytes read and written: `bytes`
    /// copied `reps` times after one copy of warm-up, timed by CUDA events. The hardware
    /// bound the benchmarks report their GB/s against, measured in the same process.
    pub fn copy_gbs(&self, bytes: usize, reps: usize) -> Result<f64, CudaError> {
        let src = self.alloc::<u8>(bytes)?;
        let mut dst = self.alloc::<u8>(bytes)?;
        let copying = |e| self.driver_error("copying on the device", e);
        self.stream.memcpy_dtod(&src, &mut dst).map_err(copying)?;
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.stream.record_event(timing).map_err(copying)?;
        for _ in 0..reps {
            self.stream.memcpy_dtod(&src, &mut dst).map_err(copying)?;
        }
        let end = self.stream.record_event(timing).map_err(copying)?;
        let seconds = f64::from(start.elapsed_ms(&end).map_err(copying)?) / 1e3;
        Ok(2.0 * (bytes * reps) as f64 / seconds / 1e9)
    }

    fn driver_error(&self, what: &str, e: cudarc::driver::DriverError) -> CudaError {
        CudaError::Device {
            ordinal: self.device.ordinal(),
            message: format!("{what}: {e}"),
        }
    }
}
