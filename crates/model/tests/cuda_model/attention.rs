//! The grouped paged-attention kernel against the legacy one, in the whole model; and the
//! helpers every in-model comparison of two kernels shares.

use super::*;

/// Logits of three sequences decoded together for `steps` steps of fixed tokens (so that
/// two models see the same inputs whatever they predict), graphs on or off.
pub(super) fn forced_decode(model: &CudaLlama, graphs: bool, steps: usize) -> Vec<Vec<f32>> {
    let mut kv = model.new_cache(16 << 20).unwrap();
    kv.set_graphs(graphs);
    let tables: Vec<Vec<u32>> = (0..3u32).map(|s| (s * 4..s * 4 + 4).collect()).collect();
    let mut comm = Solo::default();
    let mut all = Vec::new();
    let prompt_lens = [5usize, 3, 7];
    for (s, (table, &len)) in tables.iter().zip(&prompt_lens).enumerate() {
        let prompt: Vec<u32> = (0..len as u32)
            .map(|i| 1 + (i * 13 + s as u32 * 5) % 200)
            .collect();
        let chunk = SeqChunk {
            tokens: &prompt,
            start: 0,
            block_table: table,
            logits: true,
        };
        all.extend(
            model
                .forward_batch(&[chunk], &mut kv, &mut SliceComm::Host(&mut comm))
                .unwrap(),
        );
    }
    for step in 0..steps {
        let tokens: Vec<[u32; 1]> = (0..3)
            .map(|s| [1 + (step * 7 + s * 3) as u32 % 200])
            .collect();
        let chunks: Vec<SeqChunk<'_>> = tokens
            .iter()
            .zip(tables.iter().zip(&prompt_lens))
            .map(|(t, (table, &len))| SeqChunk {
                tokens: t,
                start: len + step,
                block_table: table,
                logits: true,
            })
            .collect();
        all.extend(
            model
                .forward_batch(&chunks, &mut kv, &mut SliceComm::Host(&mut comm))
                .unwrap(),
        );
    }
    all
}

/// The largest difference between two runs' logits, row by row, as a share of the row's
/// range (its largest magnitude, at least 1); each row must be within 1% (`what` names the
/// run in the failure).
pub(super) fn worst_within_a_percent(what: &str, want: &[Vec<f32>], got: &[Vec<f32>]) -> f32 {
    let mut worst = 0.0f32;
    for (row, (w, g)) in want.iter().zip(got).enumerate() {
        let range = w.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1.0);
        let diff = w
            .iter()
            .zip(g)
            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(diff <= 0.01 * range, "{what} row {row}: {diff} of {range}");
        worst = worst.max(diff / range);
    }
    worst
}

/// `body` on each fixture the in-model comparisons run on (f32 Llama with GQA, a Q4_K one
/// whose matvecs read f32 rows, llama3 RoPE, Mistral, Qwen2 with q/k/v biases and tied
/// embeddings, Qwen3 with per-head q/k norms), loaded; one missing from fixtures/models is skipped, with a line.
pub(super) fn for_each_fixture(mut body: impl FnMut(&str, &Llama)) {
    let fixtures = [
        "llama-gqa/model.F32.gguf",
        "llama-kquant/model.Q4_K.gguf",
        "llama3-rope/model.F32.gguf",
        "mistral/model.F32.gguf",
        "qwen2-bias-tied/model.F32.gguf",
        "qwen3/model.F32.gguf",
    ];
    for fixture in fixtures {
        let path = repo_root().join("fixtures/models").join(fixture);
        if !path.exists() {
            say(format!("{fixture}: not in fixtures/models, skipped"));
            continue;
        }
        body(fixture, &loader::load_weights(&path).unwrap());
    }
}

/// The kernels `model` launches for a prefill of `prompt` into a fresh cache and for one
/// decode step after it, eagerly.
pub(super) fn prefill_then_decode_launches(model: &CudaLlama, prompt: &[u32]) -> (u64, u64) {
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
    let prefill = step(prompt, 0);
    (prefill, step(&[prompt.len() as u32 + 1], prompt.len()))
}

/// `want` and `got` decode the same forced tokens (10 steps) within 1% of the logits'
/// range, eager and through graphs; `what` names the pair in the report and failures.
pub(super) fn decode_alike(what: &str, want: &CudaLlama, got: &CudaLlama) {
    for graphs in [false, true] {
        let (w, g) = (
            forced_decode(want, graphs, 10),
            forced_decode(got, graphs, 10),
        );
        let what = format!("{what}, graphs {graphs}");
        let worst = worst_within_a_percent(&what, &w, &g);
        say(format!(
            "{what}: within {worst:.1e} of the logits' range over {} rows",
            w.len()
        ));
    }
}

#[test]
fn the_grouped_and_flash_attention_kernels_match_the_legacy_one_in_the_model() {
    let Some(dev) = device() else { return };
    for_each_fixture(|fixture, llama| {
        let upload = |kernel| {
            CudaLlama::upload(llama, Arc::clone(&dev))
                .unwrap()
                .with_attention(kernel)
        };
        let legacy = upload(AttentionKernel::Legacy);
        for kernel in [AttentionKernel::Grouped, AttentionKernel::Flash] {
            let other = upload(kernel);
            assert_eq!(other.attention(), kernel, "{fixture}");
            // The kernels sum in other orders (and exp differs in its last bits), so the
            // attention output's bf16 rounding (o_proj's input) can land an ulp (2^-8)
            // apart here and there; the flash kernel (prefill here; decode runs grouped)
            // also rounds q and the softmax weights to bf16 for the tensor cores (2^-9
            // relative each). Logits move by well under 1% of their range, where a wrong
            // position, head or weight moves them by tens of percent.
            let what = format!("{fixture}: {kernel} attention against the legacy kernel");
            decode_alike(&what, &legacy, &other);
        }
    });
}
