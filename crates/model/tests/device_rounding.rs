//! The cuda path's CPU twin (`Llama::round_like_cuda`) on the fixtures the GPU model test
//! runs, against the f32 CPU path: what the device's bf16 roundings alone do to the
//! logits, and the tolerance a device run gets against the twin (`cuda_model.rs`).
//!
//! The H200 run of 2026-12-04 (`../shared/gpu-runs/2026-12-04/model.log`) found the device
//! 2.37%, 1.40% and 2.37% of the logits' range from the f32 CPU path on llama-gqa's F32,
//! BF16 and f32 files, and 3.26% at step 16 on llama3-rope's F32 file, over a 3% limit.
//! The twin, on the CPU, is as far from f32 on each (2.37%, 1.40%, 2.37%; 3.27% at step
//! 16): the excess is the device's bf16 roundings, not a bug.

mod common;

use common::twin::{PROMPT, forced, greedy, twin, worst};
use tessera_model::loader;

/// The f32 and bf16 fixtures of `cuda_model.rs` (its quantized ones keep Q8_0 or Q4_K on
/// the device, which the twin does not cover).
const FIXTURES: &[&str] = &[
    "llama-gqa/model.F32.gguf",
    "llama-gqa/model.BF16.gguf",
    "llama-gqa/f32",
    "llama3-rope/model.F32.gguf",
    "mistral/model.F32.gguf",
    "qwen2-bias-tied/model.F32.gguf",
    "qwen3/bf16",
];

#[test]
fn the_twin_shows_what_the_devices_roundings_do() {
    for fixture in FIXTURES {
        let path = common::fixtures().join(fixture);
        let llama = loader::load_weights(&path).unwrap();
        let follow = greedy(&llama, &PROMPT, 20);
        let f32_logits = forced(&llama, &PROMPT, &follow);
        let twin = twin(&path, &PROMPT, &follow).unwrap();
        let (off, step) = worst(&f32_logits, &twin.logits);
        eprintln!(
            "{fixture}: the twin is {:.2}% of the range from f32 (step {step}); a device run \
             is held to {:.2}% of it",
            100.0 * off,
            100.0 * twin.tolerance
        );
        // The roundings move the logits by a percent or more of their range; a bug moves
        // them by tens of percent.
        assert!((0.005..0.06).contains(&off), "{fixture}: {off}");
        assert!(
            (0.005..0.1).contains(&twin.tolerance),
            "{fixture}: {}",
            twin.tolerance
        );
        if *fixture == "llama3-rope/model.F32.gguf" {
            // What the H200 measured (3.26% at step 16), within the last bits that the
            // CPU's own code paths (AVX2, AVX-512, scalar) can move a rounding by.
            assert_eq!(step, 16, "{fixture}");
            assert!((0.031..0.035).contains(&off), "{fixture}: {off}");
        }
    }
}

/// A model whose matrices a cuda shard keeps quantized (its matvecs read f32 rows) is
/// refused by the twin, by name.
#[test]
fn the_twin_refuses_matrices_the_device_keeps_quantized() {
    let path = common::fixtures().join("llama-gqa/model.Q8_0.gguf");
    let Err(error) = twin(&path, &PROMPT, &[]) else {
        panic!("the twin took a Q8_0 model");
    };
    let message = error.to_string();
    assert!(
        message.contains("Q8_0") && message.contains("bf16"),
        "{message}"
    );
}
