//! The exact path on the device (`dtype = "f32"`: f32 weights, f32 GEMMs without TF32, an
//! f32 KV cache) against transformers' float32 outputs, held as the CPU's golden test
//! holds the CPU path (`golden_hf.rs`): on every fixture the device runs, from its f32
//! weights and from quantized files dequantized to f32 at load, the logits at the end of
//! each prompt within the CPU's tolerance and the greedy tokens equal.

use tessera_model::cuda::DeviceDtype;
use tessera_topology::ModelDtype;

use super::*;

/// The variants run, each with `golden_hf.rs`'s tolerance for it: f32 weights (only the
/// order of the sums differs from transformers), and quantized files, whose dequantized
/// values transformers ran on.
const VARIANTS: &[(&str, f32)] = &[("f32", 1.5e-4), ("gguf-Q8_0", 5e-4), ("gguf-Q4_K", 5e-4)];

#[test]
fn the_exact_path_matches_transformers_within_the_cpus_tolerance() {
    let Some(dev) = device() else { return };
    // The exact path runs the same kernels whatever the switches say (`DeviceDtype::fit`),
    // so gpu-check.sh's runs with other values would repeat this one: it runs once, with
    // every switch at its default.
    let switches = ["TESSERA_FUSED", "TESSERA_ATTENTION", "TESSERA_GEMV"];
    let default = |v: &str| matches!(v, "" | "0" | "legacy");
    if let Some(set) = switches
        .iter()
        .find(|s| std::env::var(s).is_ok_and(|v| !default(&v)))
    {
        say(format!(
            "the exact path runs once, with the switches at their defaults ({set} is set)"
        ));
        return;
    }
    let root = repo_root().join("fixtures/models");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|d| d.join("expected.json").is_file())
        .collect();
    dirs.sort();
    let mut checked = 0;
    for dir in dirs {
        let fixture = dir.file_name().unwrap().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(dir.join("expected.json")).unwrap();
        let expected: common::Expected = serde_json::from_str(&text).unwrap();
        for &(name, tolerance) in VARIANTS {
            let Some(file) = expected.variants.get(name).and_then(|v| v.file.as_ref()) else {
                continue;
            };
            let what = format!("{fixture}/{name} held in f32");
            let mut llama = loader::load_weights(&dir.join(file)).unwrap();
            llama.hold_as(ModelDtype::F32).unwrap();
            let model = match CudaLlama::upload(&llama, Arc::clone(&dev)) {
                Ok(model) => model,
                // Gemma 2's block and Phi-3's LongRoPE: refused on cuda shards by name.
                Err(e)
                    if e.to_string()
                        .contains("run this model's groups on cpu devices") =>
                {
                    say(format!("{what}: not run on cuda shards ({e})"));
                    continue;
                }
                Err(e) => panic!("{what}: {e}"),
            };
            assert_eq!(model.dtype(), DeviceDtype::F32, "{what}");
            let mut worst = 0.0f32;
            let results = &expected.variants[name].results;
            for (prompt, want) in expected.prompts.iter().zip(results) {
                let mut kv = model.new_cache(16 << 20).unwrap();
                assert_eq!(kv.dtype(), DeviceDtype::F32);
                // Forced along transformers' tokens: step i's argmax must be token i.
                let follow = &want.greedy[..want.greedy.len() - 1];
                let logits = cuda_logits(&model, &mut kv, prompt, follow, &mut Solo::default());
                let off = (logits[0].iter().zip(&want.last_logits))
                    .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
                worst = worst.max(off);
                let greedy: Vec<u32> = logits.iter().map(|l| argmax(l) as u32).collect();
                assert_eq!(
                    greedy,
                    want.greedy,
                    "{what}: a prompt of {} tokens (transformers' smallest top-2 margin {})",
                    prompt.len(),
                    want.min_top2_margin
                );
                checked += 1;
            }
            say(format!(
                "{what}: max |Δlogit| from transformers {worst:.2e}"
            ));
            assert!(worst <= tolerance, "{what}: {worst:.2e} > {tolerance:.0e}");
        }
    }
    assert!(
        checked >= 20,
        "only {checked} prompts ran: fixtures missing?"
    );
}
