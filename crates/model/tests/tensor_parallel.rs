//! Tensor parallelism in one process: every rank of a group on its own thread with its own
//! slice of the weights ([`loader::load_rank`]), joined by a [`LocalGroup`] collective.
//!
//! The results must not depend on tp beyond floating-point reassociation: for each fixture
//! model (f32 weights) and each tp that `plan_group` allows among 1, 2 and 4, the greedy
//! tokens equal tp = 1's and transformers' (`expected.json`), and the logits at the last
//! prompt position are within [`LOGIT_TOLERANCE`] of tp = 1's. Quantized GGUF fixtures at
//! tp = 2 slice on block boundaries and keep their types; at tp = 4 their row-parallel
//! slices fall inside blocks and are dequantized; so does a Q5_0/Q5_1 copy of llama-gqa
//! (`fixtures/quant/llama-gqa.Q5_0-Q5_1.gguf`), checked against its own tp = 1 run, and a
//! copy of llama-kquant in Q5_K, Q3_K, Q2_K and IQ4_XS splits inside its 256-value blocks.
//! The SmolLM2 demo model runs at tp = 3.
//!
//! The SmolLM2 case needs `models/SmolLM2-135M-Instruct.Q4_1.gguf` (placed by
//! `scripts/get-demo-model.sh`); without it the test says so and passes, unless
//! `TESSERA_REQUIRE_DEMO_MODEL=1` (set by `scripts/test.sh` and CI), in which case it fails.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use tessera_comm::collective::CollectiveConfig;
use tessera_comm::collective::local::LocalGroup;
use tessera_comm::{Collective, Solo};
use tessera_kernels::sampling::SamplingParams;
use tessera_model::generate::{GenerationRequest, generate_in_group};
use tessera_model::kv_cache::{DEFAULT_BLOCK_SIZE, KvCache, SeqCache};
use tessera_model::{ModelConfig, ModelError, loader};
use tessera_topology::{Precision, plan_group};

mod common;
use common::{expected, fixtures};

/// Largest allowed |logit(tp) − logit(tp = 1)|. Only the order of the sums differs: the
/// row-parallel projections add tp partial sums instead of one. The fixtures' logits reach
/// |74|, where one f32 step is 7.6e-6; two layers of reassociation stay well under 1e-4.
const LOGIT_TOLERANCE: f32 = 1e-4;

/// [`LOGIT_TOLERANCE`] for SmolLM2: 30 layers instead of 2 (observed at tp = 3: 3.2e-5).
const SMOLLM2_LOGIT_TOLERANCE: f32 = 5e-4;

/// Generous: a rank that is still loading while the others wait must not time out on a
/// busy CI machine; a real hang still fails the test.
const TEST_DEADLINE: Duration = Duration::from_secs(60);

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// What one rank saw for one prompt.
#[derive(Clone, Debug, PartialEq)]
struct Run {
    tokens: Vec<u32>,
    prompt_logits: Vec<f32>,
}

/// What one rank of a group loaded and generated.
struct RankOutcome {
    runs: Vec<Run>,
    weight_bytes: usize,
    dequantized: usize,
    decode_time: Duration,
}

/// Loads `path` on `tp` ranks (threads) and greedy-generates `max_tokens` for each prompt on
/// every rank; checks that all ranks agree bit for bit and returns each rank's outcome.
fn run_group(path: &Path, tp: usize, prompts: &[Vec<u32>], max_tokens: usize) -> Vec<RankOutcome> {
    run_group_in(path, tp, prompts, max_tokens, Precision::Exact)
}

/// [`run_group`] in `precision`.
fn run_group_in(
    path: &Path,
    tp: usize,
    prompts: &[Vec<u32>],
    max_tokens: usize,
    precision: Precision,
) -> Vec<RankOutcome> {
    let config = ModelConfig::from_path(path).unwrap();
    let plans = plan_group(tp, &config.shape()).unwrap();
    let collective = CollectiveConfig {
        deadline: TEST_DEADLINE,
        ..CollectiveConfig::default()
    };
    let prompts = Arc::new(prompts.to_vec());
    let ranks: Vec<_> = LocalGroup::new(tp, collective)
        .into_iter()
        .zip(plans)
        .map(|(mut comm, plan)| {
            let (path, prompts) = (path.to_path_buf(), Arc::clone(&prompts));
            thread::spawn(move || {
                let mut llama = loader::load_rank(&path, &plan, tp).unwrap();
                llama.set_precision(precision);
                let mut decode_time = Duration::ZERO;
                let runs = prompts
                    .iter()
                    .map(|prompt| {
                        let request = GenerationRequest {
                            prompt: prompt.clone(),
                            max_tokens,
                            sampling: SamplingParams::default(),
                            stop_tokens: Vec::new(),
                        };
                        let g = generate_in_group(&llama, &request, 0, &mut comm, |_| {}).unwrap();
                        decode_time += g.decode_time;
                        Run {
                            tokens: g.tokens,
                            prompt_logits: g.prompt_logits,
                        }
                    })
                    .collect();
                RankOutcome {
                    runs,
                    weight_bytes: llama.weight_bytes(),
                    dequantized: llama.dequantized_tensors().len(),
                    decode_time,
                }
            })
        })
        .collect();
    let outcomes: Vec<RankOutcome> = ranks.into_iter().map(|h| h.join().unwrap()).collect();
    for (r, o) in outcomes.iter().enumerate() {
        assert!(
            o.runs == outcomes[0].runs,
            "{}: rank {r} of {tp} disagrees with rank 0",
            path.display()
        );
    }
    outcomes
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Runs `model`'s variant `variant` at each tp in `tps` that splits it; checks tokens
/// against tp = 1 and transformers, logits against tp = 1. Returns the tps that ran (> 1).
fn check_variant(model: &str, variant: &str, tps: &[usize], failures: &mut Vec<String>) -> usize {
    let expected = expected(model);
    let v = &expected.variants[variant];
    let path = fixtures().join(model).join(v.file.as_ref().unwrap());
    let shape = ModelConfig::from_path(&path).unwrap().shape();
    let max_tokens = v.results[0].greedy.len();
    let base = run_group(&path, 1, &expected.prompts, max_tokens);
    let mut ran = 0;
    for &tp in tps {
        if plan_group(tp, &shape).is_err() {
            continue;
        }
        ran += 1;
        let got = run_group(&path, tp, &expected.prompts, max_tokens);
        let mut worst = 0.0f32;
        for ((run, one), want) in got[0].runs.iter().zip(&base[0].runs).zip(&v.results) {
            worst = worst.max(max_diff(&run.prompt_logits, &one.prompt_logits));
            if run.tokens != one.tokens || run.tokens != want.greedy {
                failures.push(format!(
                    "{model}/{variant} tp = {tp}: greedy {:?}, tp = 1 {:?}, transformers {:?}",
                    run.tokens, one.tokens, want.greedy
                ));
            }
        }
        eprintln!("{model:16} {variant:12} tp = {tp}: max |Δlogit| vs tp = 1 = {worst:.2e}");
        if worst > LOGIT_TOLERANCE {
            failures.push(format!(
                "{model}/{variant} tp = {tp}: logits differ from tp = 1 by {worst:.2e}"
            ));
        }
    }
    ran
}

#[test]
fn f32_fixtures_match_tp1_and_transformers_at_tp_2_and_4() {
    let mut failures = Vec::new();
    let mut runs = 0;
    for model in [
        "llama-gqa",
        "llama3-rope",
        "mistral",
        "qwen2-bias-tied",
        "qwen3",
        "gemma2",
        "phi3",
    ] {
        for variant in ["f32", "f32-sharded"] {
            if expected(model).variants.contains_key(variant) {
                runs += check_variant(model, variant, &[2, 4], &mut failures);
            }
        }
    }
    // 8 variants × {2, 4}: every fixture splits both ways (4 heads; KV heads 1, 2 or 4).
    assert_eq!(
        runs, 16,
        "fixtures missing or no longer split at tp 2 and 4?"
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Qwen3's q/k norm weights (`head_dim` each) and Gemma 2's post-norms are whole on every
/// rank, read from GGUF too; Phi-3's fused `attn_qkv` and gate|up `ffn_up` are cut into
/// each rank's rows of every part, quantized rows included.
#[test]
fn qwen3_gemma2_and_phi3_gguf_match_tp1_and_transformers_at_tp_2_and_4() {
    let mut failures = Vec::new();
    let mut runs = 0;
    for model in ["qwen3", "gemma2", "phi3"] {
        for variant in ["gguf-F32", "gguf-BF16", "gguf-Q8_0"] {
            runs += check_variant(model, variant, &[2, 4], &mut failures);
        }
    }
    assert_eq!(
        runs, 18,
        "qwen3, gemma2 or phi3 no longer splits at tp 2 and 4?"
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn quantized_gguf_at_tp2_keeps_block_aligned_slices() {
    let mut failures = Vec::new();
    for variant in ["gguf-Q8_0", "gguf-Q4_0", "gguf-Q4_1"] {
        check_variant("llama-gqa", variant, &[2], &mut failures);
        let file = format!("model.{}.gguf", &variant[5..]);
        let path = fixtures().join("llama-gqa").join(file);
        // o_proj: 64 columns / 2 = 32, down_proj: 128 / 2 = 64: whole 32-value blocks.
        let outcomes = run_group(&path, 2, &[vec![1, 2, 3]], 1);
        assert!(outcomes.iter().all(|o| o.dequantized == 0), "{variant}");
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The `fast` precision (8-bit activations per 32-value block) on Q8_0, Q4_0 and Q4_1 at
/// tp = 2, whose column slices are whole blocks (and on Q4_K at tp = 1): every rank agrees (checked by
/// `run_group`), the tokens and logits equal tp = 1's in `fast` to the bit (the row-parallel
/// sums are added in f64 and rounded once); `fast` does change the logits, by at most 5% of their
/// largest magnitude (about what Q8_0 weights change in `exact`).
#[test]
fn fast_precision_is_tp_invariant_on_block_aligned_splits() {
    // llama-kquant's 256-value blocks do not split at tp 2, nor do llama-presets' hidden
    // 288 (o's columns) at tp 2 or its intermediate 256 (down's) at tp 3: their fast runs
    // are checked at tp 1 only (against themselves there: a split would compare the f32
    // fallback's sums). The presets' Q5_0 and Q5_1 fallbacks run `fast`'s Q5 kernels.
    let cases = [
        ("llama-gqa", "Q8_0", 2),
        ("llama-gqa", "Q4_0", 2),
        ("llama-gqa", "Q4_1", 2),
        ("llama-kquant", "Q4_K", 1),
        ("llama-presets", "Q4_K_M", 1),
        ("llama-presets", "Q5_K_M", 1),
    ];
    for (model, variant, tp) in cases {
        let prompts = expected(model).prompts;
        let path = fixtures().join(model).join(format!("model.{variant}.gguf"));
        let fast = |tp| run_group_in(&path, tp, &prompts, 8, Precision::Fast).remove(0);
        let (one, two) = (fast(1), fast(tp));
        let exact = run_group(&path, 1, &prompts, 8).remove(0);
        for ((a, b), e) in one.runs.iter().zip(&two.runs).zip(&exact.runs) {
            assert_eq!(a.tokens, b.tokens, "{variant}: fast tp {tp} vs tp 1");
            // The row-parallel sums are added in f64 and rounded once: the same bits.
            let worst = max_diff(&a.prompt_logits, &b.prompt_logits);
            assert_eq!(worst, 0.0, "{variant}: fast tp {tp} vs tp 1");
            let moved = max_diff(&a.prompt_logits, &e.prompt_logits);
            let range = e.prompt_logits.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            eprintln!(
                "{variant}: fast vs exact {moved:.2e}, max |logit| {range:.2e}, \
                 tp {tp} vs 1 {worst:.2e}"
            );
            // Seen on llama-gqa: 1.0 to 2.2 with logits up to 85 (the Q8_0 weights' own
            // error against the f32 model: 0.9 to 2.4).
            assert!(
                moved > 0.0 && moved <= 0.05 * range,
                "{variant}: fast moved the logits by {moved:e} (max |logit| {range:e})"
            );
        }
    }
}

/// FP8 blocks carry their row's scale: rows split as they are, and columns at tp 2 (o_proj
/// 32, down_proj 64 per rank) on whole 32-value blocks; at tp 4 each rank's o_proj (16
/// columns) falls back to f32.
#[test]
fn fp8_checkpoints_match_tp1_and_transformers_at_tp_2_and_4() {
    let mut failures = Vec::new();
    let mut runs = 0;
    for variant in ["fp8-channel", "fp8-tensor"] {
        runs += check_variant("llama-fp8", variant, &[2, 4], &mut failures);
    }
    assert_eq!(runs, 4, "llama-fp8 no longer splits at tp 2 and 4?");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    let path = fixtures().join("llama-fp8/fp8-channel");
    for (tp, dequantized) in [(2, 0), (4, 2)] {
        let outcomes = run_group(&path, tp, &[vec![1, 2, 3]], 1);
        assert!(
            outcomes.iter().all(|o| o.dequantized == dequantized),
            "tp {tp}"
        );
    }
}

#[test]
fn quantized_gguf_at_tp4_dequantizes_unaligned_column_slices() {
    // o_proj: 64 columns / 4 = 16 per rank, half a block: each rank's o_proj (2 layers) is
    // dequantized to f32; down_proj (128 / 4 = 32) stays quantized.
    let mut failures = Vec::new();
    check_variant("llama-gqa", "gguf-Q4_1", &[4], &mut failures);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    let path = fixtures().join("llama-gqa/model.Q4_1.gguf");
    let outcomes = run_group(&path, 4, &[vec![1, 2, 3]], 1);
    assert!(outcomes.iter().all(|o| o.dequantized == 2));
}

/// Runs `path` at each `(tp, dequantized)` of `splits`: every rank dequantized that many
/// tensors at load, and each prompt's tokens equal those of `base` (its tp = 1 run) and its
/// logits are within [`LOGIT_TOLERANCE`] of them.
fn check_splits(path: &Path, prompts: &[Vec<u32>], base: &RankOutcome, splits: &[(usize, usize)]) {
    let name = path.file_name().unwrap().to_string_lossy();
    for &(tp, dequantized) in splits {
        let got = run_group(path, tp, prompts, 8);
        let counts: Vec<usize> = got.iter().map(|o| o.dequantized).collect();
        assert!(
            counts.iter().all(|&n| n == dequantized),
            "{name} tp = {tp}: {counts:?}"
        );
        for (run, one) in got[0].runs.iter().zip(&base.runs) {
            assert_eq!(run.tokens, one.tokens, "{name} tp = {tp}");
            let worst = max_diff(&run.prompt_logits, &one.prompt_logits);
            eprintln!("{name} tp = {tp}: max |Δlogit| vs tp = 1 = {worst:.2e}");
            assert!(worst <= LOGIT_TOLERANCE, "{name} tp = {tp}: {worst:e}");
        }
    }
}

#[test]
fn q5_gguf_splits_on_its_32_value_blocks() {
    // llama-gqa with Q5_0 attention and embedding, Q5_1 MLP and LM head (written by
    // make_quant_fixtures.py from model.F32.gguf; no transformers outputs: tp = 1 is the
    // reference). At tp = 2 every column slice is whole 32-value blocks; at tp = 4 o_proj's 16
    // columns per rank fall inside blocks and are dequantized (2 layers), down_proj's 32 not.
    let path = repo_root().join("fixtures/quant/llama-gqa.Q5_0-Q5_1.gguf");
    let prompts = expected("llama-gqa").prompts;
    let base = run_group(&path, 1, &prompts, 8);
    // Against the f32 model it was made from, its logits lie between the Q8_0 and Q4_0
    // fixtures' (the worst |Δlogit| over the prompts): more bits, smaller error.
    let fixture = |name: &str| run_group(&fixtures().join("llama-gqa").join(name), 1, &prompts, 8);
    let f32_runs = fixture("model.F32.gguf").remove(0).runs;
    let worst_vs_f32 = |runs: &[Run]| {
        let pairs = runs.iter().zip(&f32_runs);
        pairs.fold(0.0f32, |m, (a, b)| {
            m.max(max_diff(&a.prompt_logits, &b.prompt_logits))
        })
    };
    let q5 = worst_vs_f32(&base[0].runs);
    let q8 = worst_vs_f32(&fixture("model.Q8_0.gguf")[0].runs);
    let q4 = worst_vs_f32(&fixture("model.Q4_0.gguf")[0].runs);
    eprintln!("max |Δlogit| vs F32: Q8_0 {q8:.2}, Q5_0/Q5_1 {q5:.2}, Q4_0 {q4:.2}");
    assert!(q8 < q5 && q5 < q4, "Q8_0 {q8}, Q5 {q5}, Q4_0 {q4}");
    check_splits(&path, &prompts, &base[0], &[(2, 0), (4, 2)]);
}

#[test]
fn new_k_types_fall_back_to_f32_inside_their_256_value_blocks() {
    // llama-kquant (every row 256 values: one block) with o_proj in Q5_K, gate in Q3_K, up in
    // IQ4_XS and the rest in Q2_K (written by make_quant_fixtures.py). Splitting o_proj's or
    // down_proj's columns cuts their single block: both are dequantized on every rank;
    // the column-parallel projections keep their types. At tp = 1 those two run through the
    // AVX2 Q5_K and Q2_K kernels, split they are dequantized: the runs agree only if both do.
    let path = repo_root().join("fixtures/quant/llama-kquant.new-k-types.gguf");
    let prompts = expected("llama-kquant").prompts;
    let base = run_group(&path, 1, &prompts, 8);
    assert_eq!(base[0].dequantized, 0);
    check_splits(&path, &prompts, &base[0], &[(2, 2), (4, 2)]);
}

#[test]
fn each_rank_holds_about_one_tp_th_of_the_weights() {
    check_rank_bytes("llama-gqa/f32", (128, 256));
    // Phi-3's fused q|k|v and gate|up: each rank keeps its rows of every part, no more.
    check_rank_bytes("phi3/f32", (32, 128));
}

/// The f32 checkpoint `dir` (hidden 64, 2 layers, 4 heads and 2 KV heads of 16, untied,
/// `inter` wide MLP, `vocab` tokens) split at tp 2 and 4: every value is held once, but
/// norms everywhere and, at tp 4, each KV head by two ranks.
fn check_rank_bytes(dir: &str, (i, v): (usize, usize)) {
    let path = fixtures().join(dir);
    let config = ModelConfig::from_path(&path).unwrap();
    let whole = loader::load_weights(&path).unwrap().weight_bytes();
    // Every f32 value of the checkpoint, counted once.
    let (h, l) = (64, 2);
    let (q, kv) = (4 * 16, 2 * 16);
    let layer = 2 * h + q * h + 2 * kv * h + h * q + 3 * i * h;
    assert_eq!(whole, (v * h * 2 + h + l * layer) * 4);
    let norms = (2 * l + 1) * h * 4;
    for tp in [2, 4] {
        let plans = plan_group(tp, &config.shape()).unwrap();
        let bytes: Vec<usize> = plans
            .iter()
            .map(|p| loader::load_rank(&path, p, tp).unwrap().weight_bytes())
            .collect();
        for b in &bytes {
            assert!(
                (*b as f64) < whole as f64 * (1.0 / tp as f64 + 0.1),
                "{dir}: {bytes:?} of {whole}"
            );
        }
        // Norms are replicated; at tp = 4 > 2 KV heads, each KV head is held twice.
        let replicated_kv = if tp > 2 {
            (tp - 2) * l * 2 * 16 * h * 4
        } else {
            0
        };
        let sum: usize = bytes.iter().sum();
        assert_eq!(
            sum,
            whole + (tp - 1) * norms + replicated_kv,
            "{dir} tp = {tp}"
        );
    }
}

#[test]
fn metadata_is_read_without_weights() {
    let path = fixtures().join("llama-gqa/f32");
    let meta = loader::load_metadata(&path).unwrap();
    assert_eq!(meta.config, ModelConfig::from_path(&path).unwrap());
    assert!(meta.tokenizer.is_none());
    let gguf = fixtures().join("llama-gqa/model.Q8_0.gguf");
    let meta = loader::load_metadata(&gguf).unwrap();
    assert_eq!(meta.config.num_key_value_heads, 2);
}

#[test]
fn a_rank_refuses_a_collective_or_cache_of_another_shape() {
    let path = fixtures().join("llama-gqa/f32");
    let config = ModelConfig::from_path(&path).unwrap();
    let plans = plan_group(2, &config.shape()).unwrap();
    let llama = loader::load_rank(&path, &plans[1], 2).unwrap();
    assert_eq!(llama.kv_layout(16).kv_heads, 1);
    let mut cache = KvCache::new(llama.kv_layout(DEFAULT_BLOCK_SIZE), 2, 4);
    let mut seq = SeqCache::default();
    let err = llama
        .forward(&[1], &mut seq, &mut cache, &mut Solo::default())
        .unwrap_err();
    assert!(matches!(err, ModelError::Plan { .. }), "{err}");
    // The whole model's cache layout (2 KV heads) does not fit rank 1's slice.
    let whole = loader::load_weights(&path).unwrap();
    let mut cache = KvCache::new(whole.kv_layout(DEFAULT_BLOCK_SIZE), 2, 4);
    let mut comms = LocalGroup::new(2, CollectiveConfig::default());
    let err = llama
        .forward(&[1], &mut seq, &mut cache, &mut comms[1])
        .unwrap_err();
    assert!(matches!(err, ModelError::Plan { .. }), "{err}");
    // A plan that is not the model's split is refused at load.
    let mut wrong = plans[1].clone();
    wrong.mlp_rows = 0..64;
    assert!(matches!(
        loader::load_rank(&path, &wrong, 2),
        Err(ModelError::Plan { .. })
    ));
    assert_eq!(comms[0].world_size(), 2);
}

/// The demo model, or `None` (after saying so) when it is absent and not required.
fn smollm2() -> Option<PathBuf> {
    let path = repo_root().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if path.is_file() {
        return Some(path);
    }
    let required = std::env::var("TESSERA_REQUIRE_DEMO_MODEL").is_ok_and(|v| v == "1");
    assert!(
        !required,
        "{} is missing and TESSERA_REQUIRE_DEMO_MODEL=1: run scripts/get-demo-model.sh",
        path.display()
    );
    let _ = writeln!(
        std::io::stderr(),
        "SKIPPED: SmolLM2 tensor-parallel test: {} not found (run scripts/get-demo-model.sh)",
        path.display()
    );
    None
}

#[test]
fn smollm2_at_tp3_generates_what_tp1_does() {
    let Some(path) = smollm2() else { return };
    let meta = loader::load_metadata(&path).unwrap();
    let tokenizer = meta.tokenizer.expect("the GGUF has a tokenizer");
    assert!(meta.chat_template.is_some());
    let prompt = tokenizer
        .encode("The three primary colors are", true)
        .unwrap();
    let prompts = [prompt];
    let started = Instant::now();
    let one = run_group(&path, 1, &prompts, 16);
    let one_time = started.elapsed();
    let started = Instant::now();
    let three = run_group(&path, 3, &prompts, 16);
    let three_time = started.elapsed();
    let bytes: Vec<usize> = three.iter().map(|o| o.weight_bytes).collect();
    let diff = max_diff(
        &three[0].runs[0].prompt_logits,
        &one[0].runs[0].prompt_logits,
    );
    let _ = writeln!(
        std::io::stderr(),
        "SmolLM2 tp = 3: max |Δlogit| vs tp = 1 = {diff:.2e}; weight bytes: tp = 1 {}, \
         tp = 3 per rank {bytes:?}; load + generate {:?} vs {:?}; decode of 15 tokens {:?} \
         (tp = 1) vs {:?} (tp = 3, rank 0)",
        one[0].weight_bytes,
        one_time,
        three_time,
        one[0].decode_time,
        three[0].decode_time
    );
    assert_eq!(three[0].runs[0].tokens, one[0].runs[0].tokens);
    assert!(diff < SMOLLM2_LOGIT_TOLERANCE, "max |Δlogit| = {diff}");
    // In `fast` too, where the row-parallel sums are added in f64 and rounded once: the
    // logits are the same bits, so a last-bit difference cannot grow through the 30
    // layers' rounding to 8 bits (it did: 0.6 apart, the tokens parting at the 12th).
    let fast = |tp| run_group_in(&path, tp, &prompts, 16, Precision::Fast).remove(0);
    let (one_fast, three_fast) = (fast(1), fast(3));
    assert_eq!(three_fast.runs[0].tokens, one_fast.runs[0].tokens, "fast");
    let diff = max_diff(
        &three_fast.runs[0].prompt_logits,
        &one_fast.runs[0].prompt_logits,
    );
    assert_eq!(diff, 0.0, "fast: max |Δlogit| tp 3 vs 1");
    // 576 / 3 = 192 and 1536 / 3 = 512 columns: whole Q4_1 blocks, nothing dequantized.
    assert!(three.iter().all(|o| o.dequantized == 0));
    for b in &bytes {
        assert!((*b as f64) < one[0].weight_bytes as f64 * 0.4, "{bytes:?}");
    }
}
