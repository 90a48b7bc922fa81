//! The fused launch sequence (`TESSERA_FUSED=1`) against the legacy one, in the whole
//! model: every fixture (f32, a quantized one whose matvecs read the fused kernels' f32
//! outputs, Qwen2's q/k/v biases), each attention kernel (the grouped one with its KV
//! append at decode), eager and through graphs.

use tessera_model::launch_plan::KernelPath;

use super::attention::{forced_decode, worst_within_a_percent};
use super::*;

#[test]
fn the_fused_launches_match_the_legacy_ones_in_the_model() {
    let Some(dev) = device() else { return };
    let fixtures = [
        "llama-gqa/model.F32.gguf",
        "llama-kquant/model.Q4_K.gguf",
        "llama3-rope/model.F32.gguf",
        "mistral/model.F32.gguf",
        "qwen2-bias-tied/model.F32.gguf",
    ];
    for fixture in fixtures {
        let path = repo_root().join("fixtures/models").join(fixture);
        if !path.exists() {
            say(format!("{fixture}: not in fixtures/models, skipped"));
            continue;
        }
        let llama = loader::load_weights(&path).unwrap();
        for kernel in AttentionKernel::ALL {
            let upload = |path| {
                CudaLlama::upload_for(&llama, Arc::clone(&dev), path)
                    .unwrap()
                    .with_attention(kernel)
            };
            let (legacy, fused) = (upload(KernelPath::Legacy), upload(KernelPath::Fused));
            assert_eq!(fused.path(), KernelPath::Fused);
            for graphs in [false, true] {
                // Every pass checks each launch of its plan against the kernels it
                // launched (ModelError::LaunchCount), so these passes also prove the
                // plan's count on the device.
                let (want, got) = (
                    forced_decode(&legacy, graphs, 10),
                    forced_decode(&fused, graphs, 10),
                );
                // Both paths round the same values to bf16 before each GEMM and write the
                // same bf16 cache; the fused kernels sum in other orders (the norm's block
                // reduction, the rotation's sin/cos in registers), so a bf16 input can land
                // an ulp apart here and there: well under 1% of the logits' range, where a
                // wrong bias, head, slot or rotation moves them by tens of percent.
                let what = format!("{fixture} {kernel} graphs {graphs}");
                let worst = worst_within_a_percent(&what, &want, &got);
                say(format!(
                    "{fixture} ({kernel} attention, graphs {graphs}): fused launches within {worst:.1e} of the legacy ones' logits' range over {} rows",
                    want.len()
                ));
            }
        }
    }
}

#[test]
fn a_fused_decode_step_launches_what_its_plan_counts() {
    let Some(dev) = device() else { return };
    let path = repo_root().join("fixtures/models/llama-gqa/model.F32.gguf");
    let llama = loader::load_weights(&path).unwrap();
    let layers = llama.config().num_hidden_layers as u64;
    let mut launches = Vec::new();
    for path in KernelPath::ALL {
        let model = CudaLlama::upload_for(&llama, Arc::clone(&dev), path)
            .unwrap()
            .with_attention(AttentionKernel::Grouped);
        let mut kv = model.new_cache(16 << 20).unwrap();
        kv.set_graphs(false);
        let table: Vec<u32> = (0..4).collect();
        let mut comm = Solo::default();
        let mut step = |tokens: &[u32], start| {
            let chunk = SeqChunk {
                tokens,
                start,
                block_table: &table,
                logits: true,
            };
            model
                .forward_batch(&[chunk], &mut kv, &mut SliceComm::Host(&mut comm))
                .unwrap();
        };
        step(&[1, 2, 3, 4, 5], 0);
        step(&[6], 5);
        launches.push(kv.last_launches());
    }
    // The two paths differ only inside the layers.
    let saved = launches[0] - launches[1];
    say(format!(
        "one decode step of {layers} layers: {} launches legacy, {} fused ({} fewer a layer)",
        launches[0],
        launches[1],
        saved / layers
    ));
    assert_eq!(saved % layers, 0);
    assert!(saved / layers >= 8, "{launches:?}");
}
