//! The model on a CUDA device against the CPU path (`scripts/gpu-check.sh` runs this).
//! Without a CUDA driver every test says so and passes, unless `TESSERA_REQUIRE_GPU=1`.
//!
//! Tolerances: the device runs projections as bf16 GEMMs (bf16 weights and activations,
//! f32 sums) and keeps the KV cache in bf16, where the CPU path is f32 throughout, so
//! logits agree to a few percent of their range (3% written here), and the greedy token
//! agrees wherever the CPU's top two logits are further apart than that. The exact path
//! (`dtype = "f32"`, `cuda_model/exact.rs`) is held to the CPU's own tolerance against
//! transformers.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use tessera_comm::collective::CollectiveConfig;
use tessera_comm::collective::local::LocalGroup;
use tessera_comm::{Collective, Solo};
use tessera_kernels::cuda::device::driver_present;
use tessera_kernels::cuda::{AttentionKernel, CudaDevice, PtxCache};
use tessera_kernels::sampling::{Sampler, SamplingParams};
use tessera_model::cuda::{CudaLlama, DeviceKv};
use tessera_model::kv_cache::SeqChunk;
use tessera_model::llama::Llama;
use tessera_model::loader;
use tessera_model::rows::{RowOutput, RowRequest};
use tessera_model::slice::SliceComm;
use tessera_topology::plan_group;

mod common;
use common::twin::{self, PROMPT, forced as cpu_logits, greedy as greedy_cpu};

/// Largest difference allowed between device and CPU logits, relative to the CPU's range.
const LOGIT_TOLERANCE: f32 = 0.03;

fn say(line: String) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

fn device() -> Option<Arc<CudaDevice>> {
    if !driver_present() {
        assert!(
            std::env::var("TESSERA_REQUIRE_GPU").as_deref() != Ok("1"),
            "TESSERA_REQUIRE_GPU=1 but there is no CUDA driver"
        );
        say("SKIPPED: no CUDA driver".into());
        return None;
    }
    let dir = std::env::temp_dir().join("tessera-gpu-test-ptx");
    Some(Arc::new(
        CudaDevice::open(0, &PtxCache::new(dir)).unwrap_or_else(|e| panic!("{e}")),
    ))
}

/// The repository: `TESSERA_REPO_ROOT` where the binary runs away from its build tree
/// (`scripts/gpu-check.sh` on a GPU machine), else where it was built.
fn repo_root() -> PathBuf {
    std::env::var_os("TESSERA_REPO_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."))
}

fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

/// [`cpu_logits`] on the device, through `comm` (a rank of a group).
fn cuda_logits(
    model: &CudaLlama,
    kv: &mut DeviceKv,
    prompt: &[u32],
    follow: &[u32],
    comm: &mut dyn Collective,
) -> Vec<Vec<f32>> {
    let block_size = kv.layout().block_size;
    let len = prompt.len() + follow.len();
    let table: Vec<u32> = (0..len.div_ceil(block_size) as u32).collect();
    let mut out = Vec::new();
    let mut start = 0;
    for tokens in std::iter::once(prompt).chain(follow.chunks(1)) {
        let chunk = SeqChunk {
            tokens,
            start,
            block_table: &table,
            logits: true,
        };
        out.extend(
            model
                .forward_batch(&[chunk], kv, &mut SliceComm::Host(&mut *comm))
                .unwrap(),
        );
        start += tokens.len();
    }
    out
}

/// Checks device logits against the CPU's; returns how many steps chose the same token.
#[track_caller]
fn compare(what: &str, cpu: &[Vec<f32>], gpu: &[Vec<f32>]) -> usize {
    compare_within(what, cpu, gpu, LOGIT_TOLERANCE)
}

/// [`compare`] within `tolerance` of the CPU's range.
#[track_caller]
fn compare_within(what: &str, cpu: &[Vec<f32>], gpu: &[Vec<f32>], tolerance: f32) -> usize {
    assert_eq!(cpu.len(), gpu.len(), "{what}: steps");
    let mut same = 0;
    let mut worst = 0.0f32;
    for (step, (c, g)) in cpu.iter().zip(gpu).enumerate() {
        assert_eq!(c.len(), g.len(), "{what}: vocabulary");
        let range = c.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-6);
        let diff = c
            .iter()
            .zip(g)
            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        worst = worst.max(diff / range);
        assert!(
            diff <= tolerance * range,
            "{what} step {step}: logits differ by {diff} of a range of {range}"
        );
        let (tc, tg) = (argmax(c), argmax(g));
        if tc == tg {
            same += 1;
        } else {
            let margin = c[tc] - c[tg];
            assert!(
                margin <= tolerance * range,
                "{what} step {step}: CPU picks {tc}, device {tg}, CPU margin {margin}"
            );
        }
    }
    say(format!(
        "{what}: {} steps, worst logit difference {:.2}% of the range (allowed {:.2}%), same \
         greedy token in {same}",
        cpu.len(),
        100.0 * worst,
        100.0 * tolerance
    ));
    same
}

const FIXTURES: &[&str] = &[
    "llama-gqa/model.F32.gguf",
    "llama-gqa/model.BF16.gguf",
    "llama-gqa/model.Q8_0.gguf",
    "llama-gqa/model.Q4_1.gguf",
    "llama-gqa/f32",
    "llama-kquant/model.Q4_K.gguf",
    "llama-kquant/model.Q6_K.gguf",
    "llama3-rope/model.F32.gguf",
    "mistral/model.F32.gguf",
    "qwen2-bias-tied/model.F32.gguf",
    "qwen3/model.F32.gguf",
    "qwen3/bf16",
    "llama-fp8/fp8-channel",
];

/// Where the CPU twin of the device's roundings covers a fixture (`common::twin`: every
/// matrix held in bf16 on the device), the device is compared with the twin, within the
/// tolerance the twin derives (what moving each rounding by up to one bf16 step does);
/// elsewhere with the f32 CPU path, within [`LOGIT_TOLERANCE`].
#[test]
fn every_fixture_on_the_device_matches_the_cpu() {
    let Some(dev) = device() else { return };
    for fixture in FIXTURES {
        let path = repo_root().join("fixtures/models").join(fixture);
        let llama = loader::load_weights(&path).unwrap_or_else(|e| panic!("{fixture}: {e}"));
        let follow = greedy_cpu(&llama, &PROMPT, 20);
        let model = CudaLlama::upload(&llama, Arc::clone(&dev)).unwrap();
        let mut kv = model.new_cache(16 << 20).unwrap();
        let gpu = cuda_logits(&model, &mut kv, &PROMPT, &follow, &mut Solo::default());
        let cpu = cpu_logits(&llama, &PROMPT, &follow);
        if let Ok(twin) = twin::twin(&path, &PROMPT, &follow) {
            // Reported, as the H200 run's figures were: the device against the f32 path.
            let (off, step) = twin::worst(&cpu, &gpu);
            say(format!(
                "{fixture}: {:.2}% of the range from the f32 CPU path (step {step})",
                100.0 * off
            ));
            let what = format!("{fixture} against the CPU twin of its roundings");
            compare_within(&what, &twin.logits, &gpu, twin.tolerance);
        } else {
            compare(fixture, &cpu, &gpu);
        }
    }
}

/// Mistral's HF fixture with a 6-position sliding window: every layer's attention on the
/// device slides it as the CPU's does (the 18-token prompt and 20 steps pass it).
#[test]
fn a_sliding_window_on_the_device_matches_the_cpu() {
    let Some(dev) = device() else { return };
    let dir = tempfile::tempdir().unwrap();
    let from = repo_root().join("fixtures/models/mistral/f32");
    for entry in std::fs::read_dir(&from).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.path().join(path.file_name().unwrap())).unwrap();
    }
    let config = dir.path().join("config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    let windowed = text.replace("\"sliding_window\": null", "\"sliding_window\": 6");
    assert_ne!(text, windowed, "the fixture's config names sliding_window");
    std::fs::write(&config, windowed).unwrap();
    let prompt = [
        1u32, 15, 27, 99, 4, 8, 16, 23, 42, 7, 3, 11, 5, 19, 21, 30, 2, 9,
    ];
    let llama = loader::load_weights(dir.path()).unwrap();
    let follow = greedy_cpu(&llama, &prompt, 20);
    let cpu = cpu_logits(&llama, &prompt, &follow);
    let model = CudaLlama::upload(&llama, Arc::clone(&dev)).unwrap();
    let mut kv = model.new_cache(16 << 20).unwrap();
    let gpu = cuda_logits(&model, &mut kv, &prompt, &follow, &mut Solo::default());
    compare("mistral with a 6-position window", &cpu, &gpu);
}

#[test]
fn a_batch_of_sequences_gives_each_its_own_logits() {
    let Some(dev) = device() else { return };
    let path = repo_root().join("fixtures/models/llama-gqa/model.F32.gguf");
    let llama = loader::load_weights(&path).unwrap();
    let model = CudaLlama::upload(&llama, Arc::clone(&dev)).unwrap();
    let mut kv = model.new_cache(16 << 20).unwrap();
    let (a, b) = ([1u32, 5, 9, 13, 17, 21, 25, 29, 33, 37], [2u32, 4, 6, 8]);
    // Alone, each from its own blocks...
    let alone_a = cuda_logits(&model, &mut kv, &a, &[], &mut Solo::default());
    let alone_b = cuda_logits(&model, &mut kv, &b, &[], &mut Solo::default());
    // ...and together in one batch, in other blocks.
    let batch = [
        SeqChunk {
            tokens: &a,
            start: 0,
            block_table: &[5],
            logits: true,
        },
        SeqChunk {
            tokens: &b,
            start: 0,
            block_table: &[7],
            logits: true,
        },
    ];
    let together = model
        .forward_batch(&batch, &mut kv, &mut SliceComm::Host(&mut Solo::default()))
        .unwrap();
    compare("batch row 0", &alone_a, &together[..1]);
    compare("batch row 1", &alone_b, &together[1..]);
}

#[test]
fn tp2_on_one_gpu_through_the_cpu_collective_matches_tp1() {
    let Some(dev) = device() else { return };
    let path = repo_root().join("fixtures/models/llama-gqa/model.F32.gguf");
    let whole = loader::load_weights(&path).unwrap();
    let prompt = [1u32, 15, 27, 99, 4, 8, 16, 23];
    let follow = greedy_cpu(&whole, &prompt, 12);
    let cpu = cpu_logits(&whole, &prompt, &follow);
    let plans = plan_group(2, &whole.config().shape()).unwrap();
    let comms = LocalGroup::new(2, CollectiveConfig::default());
    let runs: Vec<Vec<Vec<f32>>> = thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .zip(&plans)
            .map(|(mut comm, plan)| {
                let (dev, path, follow) = (Arc::clone(&dev), path.clone(), follow.clone());
                s.spawn(move || {
                    let llama = loader::load_rank(&path, plan, 2).unwrap();
                    let model = CudaLlama::upload(&llama, dev).unwrap();
                    let mut kv = model.new_cache(8 << 20).unwrap();
                    cuda_logits(&model, &mut kv, &prompt, &follow, &mut comm)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(runs[0], runs[1], "both ranks return the same logits");
    compare("tp = 2 on one GPU", &cpu, &runs[0]);
}

#[test]
fn smollm2_greedy_on_the_device_follows_the_cpu() {
    let Some(dev) = device() else { return };
    let path = repo_root().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !path.is_file() {
        say(format!(
            "SKIPPED: {} not found (scripts/get-demo-model.sh)",
            path.display()
        ));
        return;
    }
    let loaded = loader::load(&path).unwrap();
    let tokenizer = loaded.tokenizer.expect("the GGUF holds its tokenizer");
    let prompt = tokenizer
        .encode(
            "The capital of France is Paris. The capital of Italy is",
            true,
        )
        .unwrap();
    let steps = 32;
    let cpu_tokens = greedy_cpu(&loaded.llama, &prompt, steps);
    let cpu = cpu_logits(&loaded.llama, &prompt, &cpu_tokens);
    let model = CudaLlama::upload(&loaded.llama, dev).unwrap();
    let mut kv = model.new_cache(64 << 20).unwrap();
    // Teacher-forced on the CPU's tokens: the logits of every step compared.
    let gpu = cuda_logits(&model, &mut kv, &prompt, &cpu_tokens, &mut Solo::default());
    let same = compare("SmolLM2 (teacher-forced)", &cpu, &gpu);
    // Free-running greedy on the device.
    let mut gpu_tokens = Vec::new();
    let table: Vec<u32> = (0..(prompt.len() + steps).div_ceil(16) as u32).collect();
    let mut logits = gpu[0].clone();
    for i in 0..steps {
        let t = argmax(&logits) as u32;
        gpu_tokens.push(t);
        let chunk = SeqChunk {
            tokens: &[t],
            start: prompt.len() + i,
            block_table: &table,
            logits: true,
        };
        logits = model
            .forward_batch(
                &[chunk],
                &mut kv,
                &mut SliceComm::Host(&mut Solo::default()),
            )
            .unwrap()
            .remove(0);
    }
    let common = cpu_tokens
        .iter()
        .zip(&gpu_tokens)
        .take_while(|(a, b)| a == b)
        .count();
    say(format!(
        "SmolLM2 greedy, {steps} tokens: CPU {:?}\n  device {:?}\n  the same for the first {common}",
        tokenizer.decode(&cpu_tokens, false).unwrap(),
        tokenizer.decode(&gpu_tokens, false).unwrap(),
    ));
    assert!(
        same + 1 >= cpu.len() * 9 / 10,
        "{same} of {} steps agree",
        cpu.len()
    );
    assert!(
        common >= 8,
        "the device's greedy text leaves the CPU's after {common} tokens"
    );
}

#[test]
fn a_kv_budget_beyond_the_device_memory_is_refused() {
    let Some(dev) = device() else { return };
    let path = repo_root().join("fixtures/models/llama-gqa/model.F32.gguf");
    let llama = loader::load_weights(&path).unwrap();
    let model = CudaLlama::upload(&llama, Arc::clone(&dev)).unwrap();
    let too_much = dev.total_memory() * 2;
    let err = model.new_cache(too_much).unwrap_err().to_string();
    assert!(err.contains("free"), "{err}");
    let err = model.new_cache(10).unwrap_err().to_string();
    assert!(err.contains("holds no block"), "{err}");
}

/// Greedy decode of three sequences together, `steps` steps, graphs on or off; the
/// logits of every step and the kernels the last step ran as one graph (0: eagerly).
fn batched_decode(model: &CudaLlama, graphs: bool, steps: usize) -> (Vec<Vec<f32>>, u64) {
    let mut kv = model.new_cache(16 << 20).unwrap();
    kv.set_graphs(graphs);
    let prompts: [&[u32]; 3] = [&[1, 5, 9, 13, 17], &[2, 4, 6], &[3, 30, 33, 36, 39, 42, 45]];
    let tables: Vec<Vec<u32>> = (0..3u32).map(|s| (s * 4..s * 4 + 4).collect()).collect();
    let mut next = Vec::new();
    for (prompt, table) in prompts.iter().zip(&tables) {
        let chunk = SeqChunk {
            tokens: prompt,
            start: 0,
            block_table: table,
            logits: true,
        };
        let logits = model
            .forward_batch(
                &[chunk],
                &mut kv,
                &mut SliceComm::Host(&mut Solo::default()),
            )
            .unwrap();
        next.push(argmax(&logits[0]) as u32);
    }
    let mut all = Vec::new();
    for step in 0..steps {
        let tokens: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
        let chunks: Vec<SeqChunk<'_>> = tokens
            .iter()
            .zip(prompts.iter().zip(&tables))
            .map(|(t, (p, table))| SeqChunk {
                tokens: t,
                start: p.len() + step,
                block_table: table,
                logits: true,
            })
            .collect();
        let logits = model
            .forward_batch(&chunks, &mut kv, &mut SliceComm::Host(&mut Solo::default()))
            .unwrap();
        next = logits.iter().map(|l| argmax(l) as u32).collect();
        all.extend(logits);
    }
    (all, kv.last_graph_kernels())
}

#[test]
fn decode_through_a_cuda_graph_matches_eager_launches() {
    let Some(dev) = device() else { return };
    for fixture in ["llama-gqa/model.F32.gguf", "llama-kquant/model.Q4_K.gguf"] {
        let path = repo_root().join("fixtures/models").join(fixture);
        let llama = loader::load_weights(&path).unwrap();
        let model = CudaLlama::upload(&llama, Arc::clone(&dev)).unwrap();
        let (eager, none) = batched_decode(&model, false, 10);
        let (graphed, kernels) = batched_decode(&model, true, 10);
        assert_eq!(none, 0, "graphs off: every step eager");
        assert!(kernels > 0, "graphs on: the decode steps replayed a graph");
        // The graph splits attention over the longest context's partitions, the eager
        // pass over the batch's: the same sums in another order.
        for (step, (e, g)) in eager.iter().zip(&graphed).enumerate() {
            let range = e.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            let diff = e
                .iter()
                .zip(g)
                .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(
                diff <= 1e-4 * range.max(1.0),
                "{fixture} row {step}: {diff}"
            );
            assert_eq!(argmax(e), argmax(g), "{fixture} row {step}");
        }
        say(format!(
            "{fixture}: 10 decode steps of 3 sequences through a graph of {kernels} kernels match the eager launches"
        ));
    }
}

/// The sampler of row `i` of a batch: greedy, seeded sampling with each limit, or a
/// penalty (which keeps the row on the host).
fn row_sampler(i: usize) -> Sampler {
    let seeded = SamplingParams {
        temperature: [0.7, 1.0, 1.3][i % 3],
        top_k: [0, 1, 20, 0][i % 4],
        top_p: [1.0, 0.9, 0.6][i % 3],
        min_p: [0.0, 0.05][i % 2],
        seed: Some(100 + i as u64),
        ..SamplingParams::default()
    };
    let params = match i % 5 {
        0 => SamplingParams::default(),
        4 => SamplingParams {
            presence_penalty: 0.5,
            ..seeded
        },
        _ => seeded,
    };
    Sampler::new(params, 0)
}

#[test]
fn device_sampling_picks_the_host_samplers_tokens() {
    let Some(dev) = device() else { return };
    let path = repo_root().join("fixtures/models/llama-gqa/model.F32.gguf");
    let model = CudaLlama::upload(&loader::load_weights(&path).unwrap(), dev).unwrap();
    const PROMPT: [u32; 4] = [1, 5, 9, 13];
    let mut solo = Solo::default();
    for (batch, graphs) in [1, 8, 64].into_iter().flat_map(|b| [(b, true), (b, false)]) {
        let mut kv = model.new_cache(64 << 20).unwrap();
        kv.set_graphs(graphs);
        let tables: Vec<Vec<u32>> = (0..batch as u32).map(|s| vec![2 * s, 2 * s + 1]).collect();
        let mut samplers: Vec<Sampler> = (0..batch).map(row_sampler).collect();
        let mut generated: Vec<Vec<u32>> = vec![Vec::new(); batch];
        let mut next: Vec<u32> = (0..batch as u32).map(|s| 3 + s % 50).collect();
        for table in &tables {
            let chunk = SeqChunk {
                tokens: &PROMPT,
                start: 0,
                block_table: table,
                logits: false,
            };
            let mut comm = SliceComm::Host(&mut solo);
            model.forward_batch(&[chunk], &mut kv, &mut comm).unwrap();
        }
        let (mut sampled_rows, mut host_rows) = (0, 0);
        for step in 0..6 {
            let tokens: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
            let chunks: Vec<SeqChunk<'_>> = tokens
                .iter()
                .zip(&tables)
                .map(|(t, table)| SeqChunk {
                    tokens: t,
                    start: PROMPT.len() + step,
                    block_table: table,
                    logits: true,
                })
                .collect();
            // Pass A brings every row's logits along; pass B, the same step again (the
            // same K/V rewritten), only the tokens of the rows the device samples.
            let request = |s: &Sampler, g: &[u32], logits: bool| RowRequest {
                draw: s.device_draw(g.len()),
                logits: logits || s.has_penalties(),
            };
            let with_logits: Vec<RowRequest> = (0..batch)
                .map(|i| request(&samplers[i], &generated[i], true))
                .collect();
            let tokens_only: Vec<RowRequest> = (0..batch)
                .map(|i| request(&samplers[i], &generated[i], false))
                .collect();
            let mut comm = SliceComm::Host(&mut solo);
            let a = model
                .forward_rows(&chunks, &mut kv, &mut comm, &with_logits)
                .unwrap();
            let b = model
                .forward_rows(&chunks, &mut kv, &mut comm, &tokens_only)
                .unwrap();
            if graphs && step > 0 {
                assert_eq!(
                    kv.last_allocations(),
                    0,
                    "batch {batch}: a replayed step allocates"
                );
            }
            let timing = kv.last_timing();
            assert!(timing.device_wait <= timing.wall && timing.wall > Duration::ZERO);
            for (i, (a, b)) in a.into_iter().zip(b).enumerate() {
                let s = &mut samplers[i];
                let (device, mut logits) = match a {
                    RowOutput::Token { token, logits } => (Some(token), logits.unwrap()),
                    RowOutput::Logits(logits) => (None, logits),
                };
                let host = s.sample(&mut logits, &PROMPT, &generated[i]);
                let what = format!("batch {batch} graphs {graphs} step {step} row {i}");
                match (device, b) {
                    (
                        Some(token),
                        RowOutput::Token {
                            token: again,
                            logits: None,
                        },
                    ) => {
                        assert_eq!(token, host, "{what}: the device's token");
                        assert_eq!(again, host, "{what}: the device's token without logits");
                        sampled_rows += 1;
                    }
                    (None, RowOutput::Logits(_)) => host_rows += 1,
                    (device, b) => panic!("{what}: {device:?} then {b:?}"),
                }
                generated[i].push(host);
                next[i] = host;
            }
        }
        say(format!(
            "batch {batch}, graphs {graphs}: {sampled_rows} rows sampled on the device as on \
             the host, {host_rows} with penalties on the host; last step {:?} host of {:?}",
            kv.last_timing().host(),
            kv.last_timing().wall
        ));
        assert!(sampled_rows > 0);
    }
}

// The grouped attention kernel against the legacy one.
#[path = "cuda_model/attention.rs"]
mod attention;
// The exact path (`dtype = "f32"`) against transformers.
#[path = "cuda_model/exact.rs"]
mod exact;
// The fused launch sequence against the legacy one.
#[path = "cuda_model/fused.rs"]
mod fused;
// The bf16 GEMV of small batches against cuBLAS.
#[path = "cuda_model/gemv.rs"]
mod gemv;
