//! The bf16 GEMV of small batches (`TESSERA_GEMV=1`) against cuBLAS, in the whole model:
//! every fixture (a quantized one, whose Q4_K projections keep their matvec either way),
//! both launch sequences, eager and through graphs; and a decode step launches as many
//! kernels with the GEMV as without (one GEMV for one GEMM).

use tessera_model::launch_plan::{Gemm, KernelPath};

use super::attention::{decode_alike, for_each_fixture, prefill_then_decode_launches};
use super::*;

#[test]
fn the_gemv_matches_cublas_in_the_model() {
    let Some(dev) = device() else { return };
    for_each_fixture(|fixture, llama| {
        for path in KernelPath::ALL {
            let upload = |gemm| {
                CudaLlama::upload_for(llama, Arc::clone(&dev), path)
                    .unwrap()
                    .with_gemm(gemm)
            };
            let (cublas, gemv) = (upload(Gemm::Cublas), upload(Gemm::Gemv));
            assert_eq!(gemv.gemm(), Gemm::Gemv);
            // Prompts of 3 to 7 tokens and decode steps of 3 (4 in a graph): every pass is
            // a batch the GEMV serves. The same bf16 inputs and f32 sums in another order:
            // a projection's output a few f32 ulps apart, so a later bf16 rounding may land
            // an ulp apart; far under 1% of the logits' range, where a wrong row, token or
            // column step moves them by tens of percent.
            let what = format!("{fixture} ({path} launches): the GEMV against cuBLAS");
            decode_alike(&what, &cublas, &gemv);
        }
    });
}

#[test]
fn the_gemv_launches_what_cublas_launches() {
    let Some(dev) = device() else { return };
    let path = repo_root().join("fixtures/models/llama-gqa/model.F32.gguf");
    let llama = loader::load_weights(&path).unwrap();
    let mut launches = Vec::new();
    for gemm in Gemm::ALL {
        let model = CudaLlama::upload(&llama, Arc::clone(&dev))
            .unwrap()
            .with_gemm(gemm);
        // 11 prompt tokens: more than the GEMV serves, so cuBLAS runs them either way.
        let prompt: Vec<u32> = (1..12).collect();
        launches.push(prefill_then_decode_launches(&model, &prompt));
    }
    say(format!(
        "a prefill of 11 tokens and a decode step: {:?} launches with cuBLAS, {:?} with the GEMV",
        launches[0], launches[1]
    ));
    assert_eq!(launches[0], launches[1]);
}
