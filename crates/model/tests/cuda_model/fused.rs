//! The fused launch sequence (`TESSERA_FUSED=1`) against the legacy one, in the whole
//! model: every fixture (f32, a quantized one whose matvecs read the fused kernels' f32
//! outputs, Qwen2's q/k/v biases), each attention kernel (the grouped one with its KV
//! append at decode), eager and through graphs.

use tessera_model::launch_plan::KernelPath;

use super::attention::{decode_alike, for_each_fixture, prefill_then_decode_launches};
use super::*;

#[test]
fn the_fused_launches_match_the_legacy_ones_in_the_model() {
    let Some(dev) = device() else { return };
    for_each_fixture(|fixture, llama| {
        for kernel in AttentionKernel::ALL {
            let upload = |path| {
                CudaLlama::upload_for(llama, Arc::clone(&dev), path)
                    .unwrap()
                    .with_attention(kernel)
            };
            let (legacy, fused) = (upload(KernelPath::Legacy), upload(KernelPath::Fused));
            assert_eq!(fused.path(), KernelPath::Fused);
            // Every pass checks each launch of its plan against the kernels it launched
            // (ModelError::LaunchCount), so these passes also prove the plan's count on
            // the device. Both paths round the same values to bf16 before each GEMM and
            // write the same bf16 cache; the fused kernels sum in other orders (the norm's
            // block reduction, the rotation's sin/cos in registers), so a bf16 input can
            // land an ulp apart here and there: well under 1% of the logits' range, where a
            // wrong bias, head, slot or rotation moves them by tens of percent.
            let what =
                format!("{fixture} ({kernel} attention): fused launches against the legacy ones");
            decode_alike(&what, &legacy, &fused);
        }
    });
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
        launches.push(prefill_then_decode_launches(&model, &[1, 2, 3, 4, 5]).1);
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
