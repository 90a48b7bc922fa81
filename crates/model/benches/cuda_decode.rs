//! Decode throughput on a CUDA device (`scripts/gpu-check.sh` runs this): tokens per
//! second at batch 1, 8 and 64, and the fraction of the card's memory bandwidth each
//! reaches, counting the bytes a step must read: every weight once, plus each sequence's
//! KV cache. Models: a Llama-3.2-1B-shaped model with random bf16 weights (the shape is
//! what matters for speed), and SmolLM2 when `models/` holds it.
//!
//! Without a CUDA driver it says so and exits. Usage:
//! `cargo bench -p tessera-model --bench cuda_decode` (`TESSERA_BENCH_STEPS`, default 64;
//! `TESSERA_PEAK_BANDWIDTH_GBS` overrides the card's peak; `TESSERA_ATTENTION` picks the
//! attention kernel, named in the report).

#![allow(clippy::print_stdout)] // a report for people: stdout is its output

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use tessera_comm::Solo;
use tessera_kernels::DType;
use tessera_kernels::cuda::device::driver_present;
use tessera_kernels::cuda::{AttentionKernel, CudaDevice, PtxCache};
use tessera_model::ModelConfig;
use tessera_model::cuda::{CudaLlama, DEVICE_KV_VALUE_BYTES};
use tessera_model::error::ModelError;
use tessera_model::kv_cache::SeqChunk;
use tessera_model::llama::Llama;
use tessera_model::loader;
use tessera_model::slice::SliceComm;
use tessera_model::weights::{Storage, TensorId, TensorSource, Weight};

/// Context each sequence holds before the timed steps.
const CONTEXT: usize = 256;
const BATCHES: [usize; 3] = [1, 8, 64];

/// Llama-3.2-1B's shape (tied embeddings, GQA 32/8).
const SYNTHETIC_CONFIG: &str = r#"{
  "architectures": ["LlamaForCausalLM"], "model_type": "llama",
  "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
  "vocab_size": 128256, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
  "rope_theta": 500000.0, "tie_word_embeddings": true, "attention_bias": false,
  "bos_token_id": 1, "eos_token_id": 2
}"#;

/// Random bf16 tensors of the shapes a config implies.
struct Synthetic {
    path: PathBuf,
    config: ModelConfig,
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
            TensorId::QBias(_) | TensorId::KBias(_) | TensorId::VBias(_) => return Ok(None),
            TensorId::FinalNorm | TensorId::AttnNorm(_) | TensorId::FfnNorm(_) => (1, hidden, 0.0),
            TensorId::Q(_) => (q, hidden, 0.02),
            TensorId::K(_) | TensorId::V(_) => (kv, hidden, 0.02),
            TensorId::O(_) => (hidden, q, 0.02),
            TensorId::Gate(_) | TensorId::Up(_) => (c.intermediate_size, hidden, 0.02),
            TensorId::Down(_) => (hidden, c.intermediate_size, 0.02),
        };
        let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ (rows * 31 + cols) as u64;
        let mut bytes = Vec::with_capacity(rows * cols * 2);
        for _ in 0..rows * cols {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let unit = (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            let value = if scale == 0.0 { 1.0 } else { unit * scale };
            bytes.extend_from_slice(&half::bf16::from_f32(value).to_le_bytes());
        }
        let name = id.hf_name();
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

fn synthetic() -> Llama {
    let dir = std::env::temp_dir().join("tessera-bench-llama-1b-shape");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), SYNTHETIC_CONFIG).unwrap();
    let config = ModelConfig::from_hf_dir(&dir).unwrap();
    let source = Synthetic {
        path: dir,
        config: config.clone(),
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

fn run(name: &str, llama: &Llama, device: &Arc<CudaDevice>, steps: usize) {
    let (peak, source) = peak_bandwidth(device);
    let model = CudaLlama::upload(llama, Arc::clone(device)).unwrap();
    let c = model.config().clone();
    let layout = model.kv_layout();
    let per_position =
        c.num_hidden_layers * 2 * layout.kv_heads * layout.head_dim * DEVICE_KV_VALUE_BYTES;
    println!(
        "{name}: {:.1} MiB of weights read per step; peak bandwidth {:.0} GB/s ({source})",
        model.weight_bytes_per_step() as f64 / (1 << 20) as f64,
        peak / 1e9
    );
    let attention = model.attention();
    println!(
        "  attention kernel: {attention}{} (TESSERA_ATTENTION: legacy or grouped)",
        if attention == AttentionKernel::default() {
            ", the default"
        } else {
            ", not the default"
        }
    );
    println!("  batch  mode    ms/step  tokens/s  launches/step  GB/s  of peak");
    for (batch, graphs) in BATCHES.iter().flat_map(|&b| [(b, false), (b, true)]) {
        let per_seq = (CONTEXT + steps + 1).div_ceil(layout.block_size);
        let budget = batch * per_seq * layout.block_size * per_position;
        let mut kv = model.new_cache(budget).unwrap();
        kv.set_graphs(graphs);
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
        let tokens = vec![7u32; batch];
        let mut step = |pos: usize| {
            let chunks: Vec<SeqChunk<'_>> = tables
                .iter()
                .zip(&tokens)
                .map(|(table, t)| SeqChunk {
                    tokens: std::slice::from_ref(t),
                    start: pos,
                    block_table: table,
                    logits: true,
                })
                .collect();
            model
                .forward_batch(&chunks, &mut kv, &mut SliceComm::Host(&mut Solo::default()))
                .unwrap();
        };
        // Warm-up: cuBLAS picks its kernels, the scratch is allocated, the graph captured.
        step(CONTEXT);
        let started = Instant::now();
        for i in 1..=steps {
            step(CONTEXT + i);
        }
        let per_step = started.elapsed().as_secs_f64() / steps as f64;
        let kv_bytes = batch * (CONTEXT + steps / 2) * per_position;
        let bytes = (model.weight_bytes_per_step() + kv_bytes) as f64;
        let rate = bytes / per_step;
        let launches = match kv.last_graph_kernels() {
            0 => format!("{}", kv.last_launches()),
            kernels => format!("1 ({kernels} in graph)"),
        };
        println!(
            "  {batch:>5}  {:<6}  {:>7.3}  {:>8.0}  {launches:>13}  {:>4.0}  {:>6.1}%",
            if graphs { "graph" } else { "eager" },
            per_step * 1e3,
            batch as f64 / per_step,
            rate / 1e9,
            100.0 * rate / peak
        );
    }
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
    let cache = PtxCache::new(PtxCache::default_dir());
    let device = Arc::new(CudaDevice::open(0, &cache).unwrap_or_else(|e| panic!("{e}")));
    println!("{} (compute {:?})", device.name(), device.capability());
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
        );
    } else {
        println!("SmolLM2: {} not found, skipped", smollm2.display());
    }
    run(
        "Llama-3.2-1B shape, random bf16",
        &synthetic(),
        &device,
        steps,
    );
}
