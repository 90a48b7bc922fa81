//! The bf16 GEMV of decode batches (`gemv.cu`, `Ops::gemv_bf16`) against cuBLAS
//! (`Blas::gemm_bf16`) on Llama-3.2-1B's projections at tp = 1, for 1, 2, 4 and 8 tokens
//! (`scripts/gpu-check.sh` runs this): each one's time per launch and GB/s, counting the
//! weight bytes (what a small batch must read; its activations are a few KiB), next to a
//! 1 GiB device-to-device copy's GB/s (bytes read and written) measured in the same
//! process. Issue 16's target: the GEMV at 80% of the copy's GB/s or more on every shape.
//!
//! A shape whose weights fit in L2 would be timed from L2 if one matrix were read again
//! and again, so each shape has enough copies to make [`ROTATED_BYTES`] and the launches
//! go round them. Times come from CUDA events around [`LAUNCHES`] launches in a row.
//!
//! Without a CUDA driver it says so and exits. Usage:
//! `cargo bench -p tessera-kernels --features cuda --bench cuda_gemv`.

#![allow(clippy::print_stdout)] // a report for people: stdout is its output

use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use tessera_kernels::cuda::device::driver_present;
use tessera_kernels::cuda::ops::Ops;
use tessera_kernels::cuda::{Blas, CudaDevice, CudaSlice, CudaStream, PtxCache};

/// Llama-3.2-1B's projections (hidden 2,048, 32 query and 8 KV heads of 64, inter 8,192,
/// vocabulary 128,256), rows × cols.
const SHAPES: [(&str, usize, usize); 6] = [
    ("q|k|v", 3072, 2048),
    ("k or v", 512, 2048),
    ("o", 2048, 2048),
    ("gate|up", 16384, 2048),
    ("down", 2048, 8192),
    ("lm-head", 128_256, 2048),
];
const TOKENS: [usize; 4] = [1, 2, 4, 8];
/// Bytes of weight copies each shape's launches go round: several times an H100's or
/// H200's 50 MiB L2, so that every launch reads device memory.
const ROTATED_BYTES: usize = 256 << 20;
/// Timed launches per measurement (after as many to warm up).
const LAUNCHES: usize = 64;
/// The copy's bytes.
const COPY_BYTES: usize = 1 << 30;
/// The target: the GEMV's GB/s as a share of the copy's.
const TARGET: f64 = 0.8;

/// Seconds per call of `launch` over `LAUNCHES` calls in a row (`launch(i)` for i in
/// 0..LAUNCHES), after as many to warm up, by CUDA events on `stream`.
fn time(stream: &Arc<CudaStream>, mut launch: impl FnMut(usize)) -> f64 {
    for i in 0..LAUNCHES {
        launch(i);
    }
    let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let start = stream.record_event(timing).unwrap();
    for i in 0..LAUNCHES {
        launch(i);
    }
    let end = stream.record_event(timing).unwrap();
    f64::from(start.elapsed_ms(&end).unwrap()) / 1e3 / LAUNCHES as f64
}

/// `n` random bf16 values of ±`scale` (xorshift: fast enough for the LM head).
fn random_bf16(n: usize, seed: u64, scale: f32) -> Vec<u16> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ seed;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let unit = (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            half::bf16::from_f32(unit * scale).to_bits()
        })
        .collect()
}

fn main() {
    if !driver_present() {
        println!("SKIPPED: no CUDA driver");
        return;
    }
    let cache = PtxCache::new(PtxCache::default_dir());
    let device = CudaDevice::open(0, &cache).unwrap_or_else(|e| panic!("{e}"));
    let ops = Ops::new(&device, device.context().default_stream());
    let blas = Blas::new(0, Arc::clone(ops.stream())).unwrap();
    println!("{} (compute {:?})", device.name(), device.capability());
    let copy = ops.copy_gbs(COPY_BYTES, LAUNCHES).unwrap();
    println!(
        "device-to-device copy of 1 GiB: {copy:.0} GB/s (read + written); target for the GEMV: {:.0} GB/s ({:.0}%)",
        TARGET * copy,
        TARGET * 100.0
    );
    println!(
        "RESULT {}",
        serde_json::json!({"kind": "copy", "gb_s": copy})
    );
    println!(
        "  projection        rows × cols  tokens  GEMV µs  GEMV GB/s  of copy  cuBLAS µs  cuBLAS GB/s  of copy  GEMV ≥ {:.0}%",
        TARGET * 100.0
    );
    let mut worst = f64::INFINITY;
    for (s, (name, rows, cols)) in SHAPES.into_iter().enumerate() {
        let bytes = rows * cols * 2;
        let host = random_bf16(rows * cols, s as u64, 0.02);
        let copies: Vec<CudaSlice<u16>> = (0..ROTATED_BYTES.div_ceil(bytes).max(1))
            .map(|_| ops.upload(&host).unwrap())
            .collect();
        drop(host);
        let xs = ops
            .upload(&random_bf16(8 * cols, 100 + s as u64, 1.0))
            .unwrap();
        let mut ys = ops.alloc::<f32>(8 * rows).unwrap();
        for tokens in TOKENS {
            let x = xs.slice(..tokens * cols);
            let mut y = ys.slice_mut(..tokens * rows);
            let w = |i: usize| &copies[i % copies.len()];
            let gemv = time(ops.stream(), |i| {
                ops.gemv_bf16(&mut y, w(i), &x, (rows, cols)).unwrap()
            });
            let cublas = time(ops.stream(), |i| {
                blas.gemm_bf16(&ops, &mut y, w(i), &x, (rows, cols))
                    .unwrap()
            });
            let (gemv_gbs, cublas_gbs) = (bytes as f64 / gemv / 1e9, bytes as f64 / cublas / 1e9);
            worst = worst.min(gemv_gbs / copy);
            println!(
                "  {name:<16}  {:>11}  {tokens:>6}  {:>7.1}  {gemv_gbs:>9.0}  {:>6.1}%  {:>9.1}  {cublas_gbs:>11.0}  {:>6.1}%  {}",
                format!("{rows}×{cols}"),
                gemv * 1e6,
                100.0 * gemv_gbs / copy,
                cublas * 1e6,
                100.0 * cublas_gbs / copy,
                if gemv_gbs >= TARGET * copy {
                    "yes"
                } else {
                    "NO"
                }
            );
            // For scripts/gpu-report.py: the same row, as JSON.
            let row = serde_json::json!({
                "kind": "gemv", "projection": name, "shape": format!("{rows}x{cols}"),
                "tokens": tokens, "gemv_us": gemv * 1e6, "gemv_gb_s": gemv_gbs,
                "gemv_of_copy": gemv_gbs / copy, "cublas_us": cublas * 1e6,
                "cublas_gb_s": cublas_gbs, "cublas_of_copy": cublas_gbs / copy,
            });
            println!("RESULT {row}");
        }
    }
    println!(
        "the GEMV's lowest share of the copy's GB/s: {:.1}% (target {:.0}%)",
        100.0 * worst,
        TARGET * 100.0
    );
}
