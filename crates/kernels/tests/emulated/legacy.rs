//! The legacy paged attention (`attention.cu`) under the CPU emulation, over a bf16 cache
//! and over the exact path's f32 cache, against the CPU's attention on the same values.
//! The f32 case is held to [`EXACT_TOLERANCE`], which the kernel would miss by two orders
//! of magnitude if it read the f32 cache through bf16.

use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};
use tessera_kernels::attention::{AttentionParams, KvLayout, paged_attention};

use super::{Batch, compiled, decode_and_a_chunk, drive, f32s, within};

/// How far (relative, at least 1 in the denominator) the kernel may be from the CPU's
/// attention on the same cache: the two differ only in the order of their sums and in
/// `__expf` (libm's `expf` here).
const EXACT_TOLERANCE: f32 = 1e-5;

/// GQA 1, 4 and 8; head_dim 64, 80 and 128; decode queries on both sides of the cache
/// blocks' and the 256-position partitions' edges and a 5-token chunk of a prompt; with
/// and without a sliding window. Each over a bf16 cache (the default entry) and over an
/// f32 cache of values that bf16 does not hold (the exact path's entry).
#[test]
fn the_legacy_kernel_emulated_is_the_cpu_attention_over_bf16_and_f32_caches() {
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = compiled("legacy_main.cpp", dir.path()) else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(47);
    let (lens, chunks) = decode_and_a_chunk(&[1, 17, 255, 256, 257, 600]);
    for (i, (kv_heads, q_heads, head_dim)) in [(2, 2, 64), (2, 8, 128), (1, 8, 80), (3, 12, 64)]
        .into_iter()
        .enumerate()
    {
        let layout = KvLayout {
            block_size: 16,
            kv_heads,
            head_dim,
        };
        let window = [None, Some(100)][i % 2];
        let mut case = Batch::new(&mut rng, (layout, q_heads), &lens, &chunks, window);
        let params = AttentionParams {
            window,
            ..AttentionParams::causal(head_dim)
        };
        for f32_cache in [false, true] {
            let mut extra = Vec::new();
            if f32_cache {
                // Values with bits below bf16's: the cache holds them as they are.
                let mut f32_values = |n: usize, scale: f32| -> Vec<f32> {
                    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
                };
                case.k = f32_values(case.k.len(), 2.0);
                case.v = f32_values(case.v.len(), 1.0);
                case.q = f32_values(case.q.len(), 1.0);
                for x in case.k.iter().chain(&case.v) {
                    extra.extend(x.to_le_bytes());
                }
            }
            let got = f32s(&drive(
                &exe,
                dir.path(),
                &case.input(usize::from(f32_cache), &extra),
            ));
            let (rows, visible) = case.rows();
            let mut want = vec![0.0f32; case.q.len()];
            let kv = case.kv();
            paged_attention(&case.q, &kv, &rows, &visible, q_heads, &params, &mut want);
            let cache = if f32_cache { "f32" } else { "bf16" };
            let what = format!(
                "legacy d{head_dim}, {q_heads}/{kv_heads} heads, window {window:?}, {cache} cache"
            );
            let worst = within(&what, &got, &want, EXACT_TOLERANCE);
            eprintln!("{what}: worst {worst:.2e} from the CPU's attention");
        }
    }
}
