//! Golden tests against HuggingFace transformers.
//!
//! `fixtures/models/<model>/expected.json` (written by `scripts/fixtures/make_model_fixtures.py`)
//! holds, for every stored variant of a tiny random-weight model (f32 / bf16 / sharded
//! safetensors, GGUF in each type), transformers' float32 logits at the last prompt position
//! and 24 greedy tokens, computed on exactly the weights that variant stores. Tessera must
//! produce the same greedy tokens and logits within [`tolerance`].

use tessera_kernels::sampling::SamplingParams;
use tessera_model::generate::{GenerationRequest, generate};
use tessera_model::loader::load_weights;

mod common;
use common::{Expected, fixtures};

/// Largest allowed |logit − transformers| per variant. Every reference is float32 math on
/// the variant's own weights, so only summation order differs. These fixtures' logits reach
/// |74| (scaled up for wide top-2 margins), where one float32 step is 7.6e-6; after two
/// layers of reductions the observed gap for f32 weights is 5.6e-5..1.02e-4, so 1.5e-4 (≈ 2e-6
/// of the largest logit). 16-bit and quantized weights are scaled once per block
/// (`d · Σ q·x` rather than `Σ (d·q)·x`), which moves the rounding further: observed ≤ 3e-4.
fn tolerance(variant: &str) -> f32 {
    if variant == "f32" || variant == "f32-sharded" || variant == "gguf-F32" {
        1.5e-4
    } else {
        5e-4
    }
}

#[test]
fn every_variant_matches_transformers() {
    let mut failures = Vec::new();
    let mut checked = 0;
    let mut models: Vec<_> = std::fs::read_dir(fixtures())
        .expect("fixtures/models exists")
        .map(|e| e.expect("readable fixtures dir").path())
        .collect();
    models.sort();
    for model_dir in models {
        let model = model_dir.file_name().unwrap().to_string_lossy().to_string();
        let text = std::fs::read_to_string(model_dir.join("expected.json")).unwrap();
        let expected: Expected = serde_json::from_str(&text).unwrap();
        for (name, variant) in &expected.variants {
            let Some(file) = &variant.file else { continue };
            let llama = load_weights(&model_dir.join(file))
                .unwrap_or_else(|e| panic!("{model}/{name}: {e}"));
            let mut worst = 0.0f32;
            for (prompt, want) in expected.prompts.iter().zip(&variant.results) {
                let request = GenerationRequest {
                    prompt: prompt.clone(),
                    max_tokens: want.greedy.len(),
                    sampling: SamplingParams::default(),
                    stop_tokens: Vec::new(),
                };
                let got = generate(&llama, &request, 0, |_| {}).unwrap();
                for (a, b) in got.prompt_logits.iter().zip(&want.last_logits) {
                    worst = worst.max((a - b).abs());
                }
                if got.tokens != want.greedy {
                    failures.push(format!(
                        "{model}/{name}: prompt of {} tokens: greedy {:?}, transformers {:?} (min margin {})",
                        prompt.len(),
                        got.tokens,
                        want.greedy,
                        want.min_top2_margin
                    ));
                }
                checked += 1;
            }
            eprintln!("{model:16} {name:12} max |Δlogit| = {worst:.2e}");
            if worst > tolerance(name) {
                failures.push(format!(
                    "{model}/{name}: logits differ by {worst:.2e} > {:.0e}",
                    tolerance(name)
                ));
            }
        }
    }
    assert!(
        checked >= 100,
        "only {checked} prompt runs found: fixtures missing?"
    );
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// The preset files (`llama-presets`, written as llama-quantize assigns types) hold K-quant
/// blocks in the 256-long ffn_down rows and the legacy fallbacks in the 288-long rows, so the
/// golden run above covers both paths in one file.
#[test]
fn preset_files_mix_k_and_legacy_types() {
    use tessera_kernels::DType;
    use tessera_model::gguf::GgufFile;
    let dir = fixtures().join("llama-presets");
    for (file, want) in [
        (
            "model.Q4_K_M.gguf",
            &[DType::Q5_0, DType::Q4K, DType::Q8_0, DType::Q6K][..],
        ),
        (
            "model.Q5_K_M.gguf",
            &[DType::Q5_1, DType::Q5K, DType::Q8_0, DType::Q6K],
        ),
        ("model.Q6_K.gguf", &[DType::Q8_0, DType::Q6K]),
    ] {
        let gguf = GgufFile::open(&dir.join(file)).unwrap();
        let mut types = Vec::new();
        for t in gguf.tensors().iter().filter(|t| t.dims.len() == 2) {
            let block_256 = matches!(t.dtype, DType::Q4K | DType::Q5K | DType::Q6K);
            assert_eq!(
                block_256,
                t.cols() % 256 == 0,
                "{file}: {} {}",
                t.name,
                t.dtype
            );
            if !types.contains(&t.dtype) {
                types.push(t.dtype);
            }
        }
        let mut want = want.to_vec();
        let key = |d: &DType| d.to_string();
        types.sort_by_key(key);
        want.sort_by_key(key);
        assert_eq!(types, want, "{file}");
    }
}

/// Phi-3's LongRoPE picks its factors per forward call, by the sequence's length at its end,
/// as transformers does: a 20-token prompt decoded through a KV cache (one call for the
/// prompt, one per token) rotates with the short factors until the sequence passes the
/// original context of 32, then the new positions with the long ones while cached keys keep
/// theirs. `cached_crossing` is transformers' run with a `DynamicCache`, whose tokens part
/// from full recompute's at the crossing.
#[test]
fn phi3_past_the_original_context_mid_generation_matches_transformers_with_a_cache() {
    use tessera_comm::Solo;
    use tessera_model::kv_cache::{DEFAULT_BLOCK_SIZE, KvCache, SeqCache};

    let dir = fixtures().join("phi3");
    let text = std::fs::read_to_string(dir.join("expected.json")).unwrap();
    let expected: serde_json::Value = serde_json::from_str(&text).unwrap();
    let crossing = &expected["cached_crossing"];
    let ids = |key: &str| -> Vec<u32> {
        serde_json::from_value(crossing[key].clone()).unwrap_or_else(|e| panic!("{key}: {e}"))
    };
    let (prompt, want) = (ids("prompt"), ids("greedy"));
    assert_ne!(
        want,
        ids("full_recompute_greedy"),
        "the fixture must tell them apart"
    );
    let want_logits: Vec<f32> =
        serde_json::from_value(crossing["last_step_logits"].clone()).unwrap();
    let llama = load_weights(&dir.join("f32")).unwrap();
    let layers = llama.config().num_hidden_layers;
    let mut cache = KvCache::new(llama.kv_layout(DEFAULT_BLOCK_SIZE), layers, 4);
    let mut seq = SeqCache::default();
    let mut comm = Solo::default();
    let mut logits = llama
        .forward(&prompt, &mut seq, &mut cache, &mut comm)
        .unwrap();
    let mut tokens = Vec::new();
    while tokens.len() < want.len() {
        if !tokens.is_empty() {
            let last = [*tokens.last().unwrap()];
            logits = llama
                .forward(&last, &mut seq, &mut cache, &mut comm)
                .unwrap();
        }
        // Greedy: the highest logit, the lowest id on ties.
        let best = (0..logits.len()).fold(0, |b, i| if logits[i] > logits[b] { i } else { b });
        tokens.push(best as u32);
    }
    assert_eq!(tokens, want, "greedy tokens through the cache");
    let worst = logits
        .iter()
        .zip(&want_logits)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    eprintln!("phi3 cached crossing: last step max |Δlogit| = {worst:.2e}");
    assert!(
        worst <= tolerance("f32"),
        "last step logits differ by {worst:e}"
    );
}
