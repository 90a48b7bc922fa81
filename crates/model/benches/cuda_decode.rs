//! Decode throughput on a CUDA device (`scripts/gpu-check.sh` runs this): tokens per
//! second at batch 1, 8, 64 and 256, and the fraction of the card's memory bandwidth each
//! reaches, counting the bytes a step must read: every weight once, plus each sequence's
//! KV cache; that rate is also compared with a 1 GiB device-to-device copy measured in the
//! same process (`of_copy`). Then prefill tokens/s of a 1,024- and a 4,096-token prompt,
//! each in one pass. Models: a Llama-3.2-1B-shaped model with random bf16 weights (the shape is
//! what matters for speed), the same shape with FP8 projections (as a compressed-tensors
//! checkpoint holds them; they run through the FP8 matvec) when `TESSERA_BENCH_FP8=1`, and
//! SmolLM2 when `models/` holds it.
//!
//! Each batch runs eagerly and through a graph, each sampling on the host (every row's
//! logits downloaded and sampled as the step runner does, `TESSERA_DEVICE_SAMPLING=0`) and
//! on the device (only token ids cross). A step is the forward pass and the sampling; its
//! host time is its wall time less the time blocked waiting for the device
//! ([`PassTiming`]), and `allocs` the device buffers it allocated.
//!
//! Without a CUDA driver it says so and exits. Usage:
//! `cargo bench -p tessera-model --bench cuda_decode` (`TESSERA_BENCH_STEPS`, default 64;
//! `TESSERA_PEAK_BANDWIDTH_GBS` overrides the card's peak; `TESSERA_BENCH_TEMPERATURE`,
//! default 0 (greedy), samples at that temperature with top-p 0.95, seeded;
//! `TESSERA_ATTENTION` picks the attention kernel and `TESSERA_FUSED` the layers' launch
//! sequence, both named in the report). Batches of at most 8 run twice, their bf16
//! projections on cuBLAS and on the GEMV (`TESSERA_GEMV=0` and `1`, the `gemm` column),
//! so that every run of this bench compares the two.

#![allow(clippy::print_stdout)] // a report for people: stdout is its output

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_comm::Solo;
use tessera_kernels::DType;
use tessera_kernels::cuda::device::driver_present;
use tessera_kernels::cuda::{AttentionKernel, CudaDevice, Ops, PtxCache};
use tessera_kernels::quant::fp8;
use tessera_kernels::sampling::{Sampler, SamplingParams};
use tessera_model::ModelConfig;
use tessera_model::cuda::{CudaLlama, DeviceKv};
use tessera_model::error::ModelError;
use tessera_model::kv_cache::SeqChunk;
use tessera_model::launch_plan::{GEMV_MAX_TOKENS, Gemm, KernelPath};
use tessera_model::llama::Llama;
use tessera_model::loader;
use tessera_model::rows::{RowOutput, RowRequest};
use tessera_model::slice::SliceComm;
use tessera_model::weights::{Storage, TensorId, TensorSource, Weight};

/// Context each sequence holds before the timed steps.
const CONTEXT: usize = 256;
const BATCHES: [usize; 4] = [1, 8, 64, 256];
/// Prompt lengths of the prefill measurement: one sequence's prompt in one pass.
const PREFILLS: [usize; 2] = [1024, 4096];
/// The device-to-device copy whose GB/s every row is also compared with.
const COPY_BYTES: usize = 1 << 30;

/// Llama-3.2-1B's shape (tied embeddings, GQA 32/8).
const SYNTHETIC_CONFIG: &str = r#"{
  "architectures": ["LlamaForCausalLM"], "model_type": "llama",
  "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
  "vocab_size": 128256, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
  "rope_theta": 500000.0, "tie_word_embeddings": true, "attention_bias": false,
  "bos_token_id": 1, "eos_token_id": 2
}"#;

/// Random tensors of the shapes a config implies: bf16, or with the projections in FP8
/// blocks (`fp8`).
struct Synthetic {
    path: PathBuf,
    config: ModelConfig,
    fp8: bool,
}

/// A random e4m3fn code whose value lies in ±[2^-3, 2^5) (exponents 4 ..= 11, never NaN),
/// from the xorshift state's high bits.
fn fp8_code(bits: u64) -> u8 {
    let sign = ((bits >> 63) as u8) << 7;
    let exponent = 4 + ((bits >> 60) as u8 & 0x07);
    let mantissa = (bits >> 57) as u8 & 0x07;
    sign | exponent << 3 | mantissa
}

impl TensorSource for Synthetic {
    fn path(&self) -> &Path {
        &self.path
    }

    fn get(&self, id: TensorId) -> Result<Option<Weight>, ModelError> {
        let c = &self.config;
        let (hidden, q, kv) = (
            c.hidden_size,
            c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
        );
        let (rows, cols, scale) = match id {
            TensorId::Embed => (c.vocab_size, hidden, 0.02),
            TensorId::LmHead | TensorId::Rope => return Ok(None),
            TensorId::Qkv(_) | TensorId::GateUp(_) => return Ok(None),
            TensorId::QBias(_) | TensorId::KBias(_) | TensorId::VBias(_) => return Ok(None),
            TensorId::PreFfnNorm(_) | TensorId::PostAttnNorm(_) | TensorId::PostFfnNorm(_) => {
                return Ok(None);
            }
            TensorId::FinalNorm | TensorId::AttnNorm(_) | TensorId::FfnNorm(_) => (1, hidden, 0.0),
            TensorId::QNorm(_) | TensorId::KNorm(_) => (1, c.head_dim, 0.0),
            TensorId::Q(_) => (q, hidden, 0.02),
            TensorId::K(_) | TensorId::V(_) => (kv, hidden, 0.02),
            TensorId::O(_) => (hidden, q, 0.02),
            TensorId::Gate(_) | TensorId::Up(_) => (c.intermediate_size, hidden, 0.02),
            TensorId::Down(_) => (hidden, c.intermediate_size, 0.02),
        };
        let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ (rows * 31 + cols) as u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let name = id.hf_name();
        let projection = !matches!(id, TensorId::Embed) && rows > 1;
        if self.fp8 && projection {
            // Codes of magnitude up to 32, scaled so that weights stay within ±`scale`.
            let row_bytes = DType::F8E4M3.row_bytes(cols)?;
            let mut bytes = vec![0u8; rows * row_bytes];
            let mut codes = vec![0u8; cols];
            for row in bytes.chunks_exact_mut(row_bytes) {
                codes.iter_mut().for_each(|c| *c = fp8_code(next()));
                fp8::pack_row(&codes, scale / 32.0, row)?;
            }
            let storage = Storage::from_vec(bytes);
            return Weight::new(&self.path, &name, DType::F8E4M3, rows, cols, storage).map(Some);
        }
        let mut bytes = Vec::with_capacity(rows * cols * 2);
        for _ in 0..rows * cols {
            let unit = (next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            let value = if scale == 0.0 { 1.0 } else { unit * scale };
            bytes.extend_from_slice(&half::bf16::from_f32(value).to_le_bytes());
        }
        Weight::new(
            &self.path,
            &name,
            DType::BF16,
            rows,
            cols,
            Storage::from_vec(bytes),
        )
        .map(Some)
    }
}

fn synthetic(fp8: bool) -> Llama {
    let dir = std::env::temp_dir().join("tessera-bench-llama-1b-shape");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), SYNTHETIC_CONFIG).unwrap();
    let config = ModelConfig::from_hf_dir(&dir).unwrap();
    let source = Synthetic {
        path: dir,
        config: config.clone(),
        fp8,
    };
    Llama::load(&source, config).unwrap()
}

/// The card's peak memory bandwidth (bytes/s) and where the figure comes from.
fn peak_bandwidth(device: &CudaDevice) -> (f64, String) {
    if let Ok(gbs) = std::env::var("TESSERA_PEAK_BANDWIDTH_GBS") {
        let gbs: f64 = gbs.parse().expect("TESSERA_PEAK_BANDWIDTH_GBS is a number");
        return (gbs * 1e9, "TESSERA_PEAK_BANDWIDTH_GBS".into());
    }
    if let Some(peak) = device.peak_bandwidth() {
        return (peak, "memory clock × bus width from the driver".into());
    }
    // Datasheet figures, where the driver reports no memory clock (CUDA 13 drivers).
    let known = [
        ("H200", 4.8e12),
        ("H100", 3.35e12),
        ("A100", 2.0e12),
        ("L40S", 8.64e11),
    ];
    for (name, peak) in known {
        if device.name().contains(name) {
            return (peak, format!("{name} datasheet"));
        }
    }
    (f64::NAN, "unknown".into())
}

/// How a run samples.
#[derive(Clone, Copy)]
struct Mode {
    graphs: bool,
    device_sampling: bool,
}

/// What the timed steps of one run took, per step.
struct Timed {
    step: Duration,
    host: Duration,
}

/// A KV cache holding `batch` sequences of [`CONTEXT`] prompt tokens, and their tables.
fn prefilled(
    model: &CudaLlama,
    batch: usize,
    steps: usize,
    mode: Mode,
) -> (DeviceKv, Vec<Vec<u32>>) {
    let layout = model.kv_layout();
    let per_seq = (CONTEXT + steps + 1).div_ceil(layout.block_size);
    let budget = batch * per_seq * layout.block_size * per_position(model);
    let mut kv = model.new_cache(budget).unwrap();
    kv.set_graphs(mode.graphs);
    let tables: Vec<Vec<u32>> = (0..batch)
        .map(|s| ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect())
        .collect();
    let prompt: Vec<u32> = (0..CONTEXT as u32).map(|i| 1 + i % 1000).collect();
    for table in &tables {
        let chunk = SeqChunk {
            tokens: &prompt,
            start: 0,
            block_table: table,
            logits: false,
        };
        model
            .forward_batch(
                &[chunk],
                &mut kv,
                &mut SliceComm::Host(&mut Solo::default()),
            )
            .unwrap();
    }
    (kv, tables)
}

/// KV bytes per cached position.
fn per_position(model: &CudaLlama) -> usize {
    let layout = model.kv_layout();
    model.config().num_hidden_layers
        * 2
        * layout.kv_heads
        * layout.head_dim
        * model.dtype().kv_bytes()
}

/// `steps` decode steps after one of warm-up: the pass, then each row sampled on the
/// host from its logits or taken from the device.
fn decode(
    model: &CudaLlama,
    kv: &mut DeviceKv,
    tables: &[Vec<u32>],
    steps: usize,
    mode: Mode,
    params: &SamplingParams,
) -> Timed {
    let mut samplers: Vec<Sampler> = (0..tables.len())
        .map(|i| Sampler::new(params.clone(), i as u64))
        .collect();
    // The model has random weights: every step feeds token 7, not the sampled one, so
    // every run decodes the same positions the same way.
    let tokens = vec![7u32; tables.len()];
    let mut timed = Timed {
        step: Duration::ZERO,
        host: Duration::ZERO,
    };
    // Step 0 warms up: cuBLAS picks its kernels, the scratch is allocated, the graph captured.
    for i in 0..=steps {
        let started = Instant::now();
        let requests: Vec<RowRequest> = samplers
            .iter()
            .map(|s| {
                if mode.device_sampling {
                    RowRequest {
                        draw: Some(s.draw(i)),
                        logits: false,
                    }
                } else {
                    RowRequest::LOGITS
                }
            })
            .collect();
        let chunks: Vec<SeqChunk<'_>> = tables
            .iter()
            .zip(&tokens)
            .map(|(table, t)| SeqChunk {
                tokens: std::slice::from_ref(t),
                start: CONTEXT + i,
                block_table: table,
                logits: true,
            })
            .collect();
        let rows = model
            .forward_rows(
                &chunks,
                kv,
                &mut SliceComm::Host(&mut Solo::default()),
                &requests,
            )
            .unwrap();
        let generated = vec![0u32; i];
        let next: Vec<u32> = rows
            .into_iter()
            .zip(&mut samplers)
            .map(|(row, s)| match row {
                RowOutput::Token { token, .. } => token,
                RowOutput::Logits(mut logits) => s.sample(&mut logits, &[], &generated),
            })
            .collect();
        if i > 0 {
            let step = started.elapsed();
            timed.step += step;
            timed.host += step.saturating_sub(kv.last_timing().device_wait);
        }
        std::hint::black_box(next);
    }
    timed.step /= steps as u32;
    timed.host /= steps as u32;
    timed
}

/// The hardware bounds of a run: the card's peak bandwidth (and where that figure comes
/// from) and a device copy's GB/s, measured in this process.
struct Bounds {
    peak: f64,
    source: String,
    copy: f64,
}

/// Prefill tokens/s of one sequence's prompt of each length of [`PREFILLS`], in one pass
/// (the last position's logits come back, which waits for the device): the median of 3
/// passes after one of warm-up.
fn prefill(name: &str, model: &CudaLlama) {
    let layout = model.kv_layout();
    let max = model.config().max_position_embeddings;
    for len in PREFILLS.into_iter().filter(|&len| len <= max) {
        let blocks = len.div_ceil(layout.block_size);
        let budget = blocks * layout.block_size * per_position(model);
        let mut kv = model.new_cache(budget).unwrap();
        let table: Vec<u32> = (0..blocks as u32).collect();
        let prompt: Vec<u32> = (0..len as u32).map(|i| 1 + i % 1000).collect();
        let mut times: Vec<Duration> = (0..4)
            .map(|_| {
                let chunk = SeqChunk {
                    tokens: &prompt,
                    start: 0,
                    block_table: &table,
                    logits: true,
                };
                let started = Instant::now();
                let mut comm = Solo::default();
                let comm = &mut SliceComm::Host(&mut comm);
                model.forward_batch(&[chunk], &mut kv, comm).unwrap();
                started.elapsed()
            })
            .skip(1)
            .collect();
        times.sort();
        let seconds = times[1].as_secs_f64();
        println!(
            "  prefill of {len} tokens: {:.2} ms, {:.0} tokens/s",
            seconds * 1e3,
            len as f64 / seconds
        );
        let row = serde_json::json!({
            "kind": "prefill", "model": name, "attention": model.attention().to_string(),
            "launches_path": model.path().to_string(), "tokens": len, "ms": seconds * 1e3,
            "tok_s": len as f64 / seconds,
        });
        println!("RESULT {row}");
    }
}

fn run(
    name: &str,
    llama: &Llama,
    device: &Arc<CudaDevice>,
    steps: usize,
    params: &SamplingParams,
    bounds: &Bounds,
) {
    let Bounds { peak, source, copy } = bounds;
    let peak = *peak;
    let mut model = CudaLlama::upload(llama, Arc::clone(device)).unwrap();
    println!(
        "{name}: {:.1} MiB of weights read per step; peak bandwidth {:.0} GB/s ({source}); a \
         device copy {:.0} GB/s",
        model.weight_bytes_per_step() as f64 / (1 << 20) as f64,
        peak / 1e9,
        copy / 1e9
    );
    let attention = model.attention();
    println!(
        "  attention kernel: {attention}{} (TESSERA_ATTENTION: legacy, grouped or flash)",
        if attention == AttentionKernel::default() {
            ", the default"
        } else {
            ", not the default"
        }
    );
    let path = model.path();
    println!(
        "  layer launches: {path} (TESSERA_FUSED={}{})",
        path.env_value(),
        if path == KernelPath::default() {
            ", the default"
        } else {
            ", not the default"
        }
    );
    let gemm = model.gemm();
    println!(
        "  small batches' projections: {gemm} (TESSERA_GEMV={}{}); batches of at most {GEMV_MAX_TOKENS} run both",
        gemm.env_value(),
        if gemm == Gemm::default() {
            ", the default"
        } else {
            ", not the default"
        }
    );
    println!(
        "  batch  gemm    mode    sampling  ms/step  host µs/step  tokens/s  launches/step  allocs/step  GB/s  of peak  of copy"
    );
    let modes: Vec<Mode> = [false, true]
        .into_iter()
        .flat_map(|graphs| {
            [false, true].map(|device_sampling| Mode {
                graphs,
                device_sampling,
            })
        })
        .collect();
    let mut runs = Vec::new();
    for batch in BATCHES {
        // The GEMV serves only small batches: larger ones run on cuBLAS whatever it says.
        let gemms: &[Gemm] = if batch <= GEMV_MAX_TOKENS {
            &Gemm::ALL
        } else {
            &[Gemm::Cublas]
        };
        for &gemm in gemms {
            runs.extend(modes.iter().map(|&mode| (batch, gemm, mode)));
        }
    }
    for (batch, gemm, mode) in runs {
        // Before the cache: its graphs keep the kernels they were captured with.
        model = model.with_gemm(gemm);
        let (mut kv, tables) = prefilled(&model, batch, steps, mode);
        let timed = decode(&model, &mut kv, &tables, steps, mode, params);
        let per_step = timed.step.as_secs_f64();
        let kv_bytes = batch * (CONTEXT + steps / 2) * per_position(&model);
        let bytes = (model.weight_bytes_per_step() + kv_bytes) as f64;
        let rate = bytes / per_step;
        let launches = match kv.last_graph_kernels() {
            0 => format!("{}", kv.last_launches()),
            kernels => format!("{} ({kernels} in graph)", kv.last_launches()),
        };
        println!(
            "  {batch:>5}  {gemm:<6}  {:<6}  {:<8}  {:>7.3}  {:>12.1}  {:>8.0}  {launches:>13}  {:>11}  {:>4.0}  {:>6.1}%  {:>6.1}%",
            if mode.graphs { "graph" } else { "eager" },
            if mode.device_sampling {
                "device"
            } else {
                "host"
            },
            per_step * 1e3,
            timed.host.as_secs_f64() * 1e6,
            batch as f64 / per_step,
            kv.last_allocations(),
            rate / 1e9,
            100.0 * rate / peak,
            100.0 * rate / copy
        );
        // For scripts/gpu-report.py: the same row, as JSON (a NaN is written null).
        let row = serde_json::json!({
            "kind": "decode", "model": name, "attention": attention.to_string(),
            "launches_path": path.to_string(), "gemm": gemm.to_string(), "batch": batch,
            "mode": if mode.graphs { "graph" } else { "eager" },
            "sampling": if mode.device_sampling { "device" } else { "host" },
            "ms_step": per_step * 1e3, "host_us_step": timed.host.as_secs_f64() * 1e6,
            "tok_s": batch as f64 / per_step, "launches_step": kv.last_launches(),
            "allocs_step": kv.last_allocations(), "gb_s": rate / 1e9, "of_peak": rate / peak,
            "of_copy": rate / copy,
        });
        println!("RESULT {row}");
    }
    prefill(name, &model);
}

fn main() {
    if !driver_present() {
        println!("SKIPPED: no CUDA driver");
        return;
    }
    let steps: usize = std::env::var("TESSERA_BENCH_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(64);
    let temperature: f32 = std::env::var("TESSERA_BENCH_TEMPERATURE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0.0);
    let params = SamplingParams {
        temperature,
        top_p: if temperature > 0.0 { 0.95 } else { 1.0 },
        seed: Some(1),
        ..SamplingParams::default()
    };
    println!("sampling: {params:?}");
    let cache = PtxCache::new(PtxCache::default_dir());
    let device = Arc::new(CudaDevice::open(0, &cache).unwrap_or_else(|e| panic!("{e}")));
    println!("{} (compute {:?})", device.name(), device.capability());
    let (peak, source) = peak_bandwidth(&device);
    let ops = Ops::new(&device, device.context().default_stream());
    let copy = ops.copy_gbs(COPY_BYTES, 16).unwrap() * 1e9;
    println!(
        "RESULT {}",
        serde_json::json!({"kind": "copy", "gb_s": copy / 1e9})
    );
    let bounds = Bounds { peak, source, copy };
    // `TESSERA_REPO_ROOT` where the binary runs away from its build tree (gpu-check.sh).
    let root = std::env::var_os("TESSERA_REPO_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."));
    let smollm2 = root.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if smollm2.is_file() {
        let llama = loader::load_weights(&smollm2).unwrap();
        run(
            "SmolLM2-135M (Q4_1 → bf16 on the device)",
            &llama,
            &device,
            steps,
            &params,
            &bounds,
        );
    } else {
        println!("SmolLM2: {} not found, skipped", smollm2.display());
    }
    run(
        "Llama-3.2-1B shape, random bf16",
        &synthetic(false),
        &device,
        steps,
        &params,
        &bounds,
    );
    if std::env::var("TESSERA_BENCH_FP8").as_deref() == Ok("1") {
        run(
            "Llama-3.2-1B shape, random FP8 projections (matvec)",
            &synthetic(true),
            &device,
            steps,
            &params,
            &bounds,
        );
    }
}
