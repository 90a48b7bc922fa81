//! The bf16 GEMV of small batches (`TESSERA_GEMV=1`) against cuBLAS, in the whole model:
//! every fixture (a quantized one, whose Q4_K projections keep their matvec either way),
//! both launch sequences, eager and through graphs; and a decode step launches as many
//! kernels with the GEMV as without (one GEMV for one GEMM).

use tessera_model::launch_plan::{Gemm, KernelPath};

use super::attention::{forced_decode, worst_within_a_percent};
use super::*;

#[test]
fn the_gemv_matches_cublas_in_the_model() {
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
        for path in KernelPath::ALL {
            let upload = |gemm| {
                CudaLlama::upload_for(&llama, Arc::clone(&dev), path)
                    .unwrap()
                    .with_gemm(gemm)
            };
            let (cublas, gemv) = (upload(Gemm::Cublas), upload(Gemm::Gemv));
            assert_eq!(gemv.gemm(), Gemm::Gemv);
            for graphs in [false, true] {
                // Prompts of 3 to 7 tokens and decode steps of 3 (4 in a graph): every
                // pass is a batch the GEMV serves.
                let (want, got) = (
                    forced_decode(&cublas, graphs, 10),
                    forced_decode(&gemv, graphs, 10),
                );
                // The same bf16 inputs and f32 sums in another order: a GEMM output a few
                // f32 ulps apart, so a later bf16 rounding may land an ulp apart; far under
                // 1% of the logits' range, where a wrong row, token or column step moves
                // them by tens of percent.
                let what = format!("{fixture} {path} graphs {graphs}");
                let worst = worst_within_a_percent(&what, &want, &got);
                say(format!(
                    "{fixture} ({path} launches, graphs {graphs}): the GEMV within {worst:.1e} of cuBLAS's logits' range over {} rows",
                    want.len()
                ));
            }
        }
    }
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
            kv.last_launches()
        };
        // 11 prompt tokens: more than the GEMV serves, so cuBLAS runs them either way.
        let prompt: Vec<u32> = (1..12).collect();
        launches.push((step(&prompt, 0), step(&[12], 11)));
    }
    say(format!(
        "a prefill of 11 tokens and a decode step: {:?} launches with cuBLAS, {:?} with the GEMV",
        launches[0], launches[1]
    ));
    assert_eq!(launches[0], launches[1]);
}
