//! The cuda path's CPU twin ([`Llama::round_like_cuda`]) run the way the GPU model test
//! runs a fixture: the CPU's greedy continuation of a prompt, then the logits after the
//! prompt and after each token of it, fed in one at a time (`cuda_model.rs` runs the
//! device on the same tokens).

use std::path::Path;

use tessera_comm::Solo;
use tessera_model::ModelError;
use tessera_model::kv_cache::{KvCache, SeqCache};
use tessera_model::llama::{DeviceRounding, Llama};
use tessera_model::loader;

/// The GPU model test's prompt.
pub const PROMPT: [u32; 18] = [
    1, 15, 27, 99, 4, 8, 16, 23, 42, 7, 3, 11, 5, 19, 21, 30, 2, 9,
];

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// The logits after `prompt` and after each token of `follow`, or with `greedy` after
/// each token the model picks itself (`follow` then gives the count); and the tokens.
fn run(llama: &Llama, prompt: &[u32], follow: &[u32], greedy: bool) -> (Vec<Vec<f32>>, Vec<u32>) {
    let layout = llama.kv_layout(16);
    let mut cache = KvCache::new(layout, llama.config().num_hidden_layers, 64);
    let mut seq = SeqCache::default();
    let mut step = |tokens: &[u32]| {
        llama
            .forward(tokens, &mut seq, &mut cache, &mut Solo::default())
            .unwrap()
    };
    let mut logits = vec![step(prompt)];
    let mut tokens = Vec::new();
    for &given in follow {
        let t = if greedy {
            argmax(logits.last().unwrap())
        } else {
            given
        };
        tokens.push(t);
        logits.push(step(&[t]));
    }
    (logits, tokens)
}

/// The CPU's greedy continuation of `prompt`, `steps` tokens.
pub fn greedy(llama: &Llama, prompt: &[u32], steps: usize) -> Vec<u32> {
    run(llama, prompt, &vec![0; steps], true).1
}

/// The logits after `prompt` and after each of `follow`'s tokens.
pub fn forced(llama: &Llama, prompt: &[u32], follow: &[u32]) -> Vec<Vec<f32>> {
    run(llama, prompt, follow, false).0
}

/// The largest difference between `want` and `got` over the steps, relative to `want`'s
/// range at that step, and the step.
pub fn worst(want: &[Vec<f32>], got: &[Vec<f32>]) -> (f32, usize) {
    let mut worst = (0.0f32, 0);
    for (step, (w, g)) in want.iter().zip(got).enumerate() {
        let range = w.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-6);
        let diff = w
            .iter()
            .zip(g)
            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        if diff / range > worst.0 {
            worst = (diff / range, step);
        }
    }
    worst
}

/// The twin's logits for a fixture and the tolerance a device run gets against them.
pub struct Twin {
    /// The twin's logits on the tokens given ([`DeviceRounding::Bf16`]).
    pub logits: Vec<Vec<f32>>,
    /// The twin rounding toward zero ([`DeviceRounding::Bf16TowardZero`]) against it: what
    /// moving every rounding by up to one bf16 step does, relative to the range (the worst
    /// step). A device run, which rounds the same values but sums in another order (a
    /// rounding then lands a step away here and there), is held to this.
    pub tolerance: f32,
}

/// The twin of the model at `path` on `prompt` then `follow`; an error where the twin does
/// not cover the model (matrices the device keeps quantized).
pub fn twin(path: &Path, prompt: &[u32], follow: &[u32]) -> Result<Twin, ModelError> {
    let logits = |rounding| -> Result<Vec<Vec<f32>>, ModelError> {
        let mut llama = loader::load_weights(path)?;
        llama.round_like_cuda(rounding)?;
        Ok(forced(&llama, prompt, follow))
    };
    let near = logits(DeviceRounding::Bf16)?;
    let zero = logits(DeviceRounding::Bf16TowardZero)?;
    Ok(Twin {
        tolerance: worst(&near, &zero).0,
        logits: near,
    })
}
