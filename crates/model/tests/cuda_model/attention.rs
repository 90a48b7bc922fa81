//! The grouped paged-attention kernel against the legacy one, in the whole model.

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

#[test]
fn the_grouped_attention_kernel_matches_the_legacy_one_in_the_model() {
    let Some(dev) = device() else { return };
    let fixtures = [
        "llama-gqa/model.F32.gguf",
        "llama3-rope/model.F32.gguf",
        "mistral/model.F32.gguf",
        "qwen2-bias-tied/model.F32.gguf",
    ];
    for fixture in fixtures {
        let path = repo_root().join("fixtures/models").join(fixture);
        let llama = loader::load_weights(&path).unwrap();
        let upload = |kernel| {
            CudaLlama::upload(&llama, Arc::clone(&dev))
                .unwrap()
                .with_attention(kernel)
        };
        let (legacy, grouped) = (
            upload(AttentionKernel::Legacy),
            upload(AttentionKernel::Grouped),
        );
        assert_eq!(grouped.attention(), AttentionKernel::Grouped, "{fixture}");
        for graphs in [false, true] {
            let (want, got) = (
                forced_decode(&legacy, graphs, 10),
                forced_decode(&grouped, graphs, 10),
            );
            // The kernels sum in other orders (and exp differs in its last bits), so the
            // attention output's bf16 rounding (o_proj's input) can land an ulp (2^-8)
            // apart here and there: logits move by well under 1% of their range, where a
            // wrong position, head or weight moves them by tens of percent.
            let worst = worst_within_a_percent(&format!("{fixture} graphs {graphs}"), &want, &got);
            say(format!(
                "{fixture} (graphs {graphs}): grouped attention within {worst:.1e} of the legacy kernel's logits' range over {} rows",
                want.len()
            ));
        }
    }
}
