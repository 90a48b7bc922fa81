//! The prefill attention kernel (`attention_flash.cu`) against its CPU twin, which rounds
//! where it rounds (`attention::flash_reference`), and against the exact f32 attention.

use rand::SeedableRng as _;
use rand::rngs::StdRng;
use tessera_kernels::attention::{KvLayout, PagedKv, flash_reference, flash_tiles};
use tessera_kernels::cuda::{AttentionKernel, AttentionTarget};

use super::PagedCase;
use crate::{device, ops, random};

/// GQA 1, 4 and 8; head_dim 16, 64 and 128; a batch that mixes a 150-token chunk after 37
/// cached positions (its 64-query tiles cross the key tiles' and the cache blocks'
/// edges), a decode query, a 3-token prompt, and a 70-token chunk at position 4,000; with
/// and without a sliding window.
#[test]
fn the_flash_kernel_is_its_twin_up_to_summation_order() {
    let Some(dev) = device() else { return };
    let ops = ops(&dev);
    let mut rng = StdRng::seed_from_u64(29);
    for (kv_heads, q_heads, head_dim) in [(2, 2, 64), (2, 8, 128), (1, 8, 64), (2, 8, 16)] {
        let layout = KvLayout {
            block_size: 16,
            kv_heads,
            head_dim,
        };
        let mut query_seq = vec![0u32; 150];
        let mut contexts: Vec<u32> = (38..188).collect();
        query_seq.extend([1, 2, 2, 2]);
        contexts.extend([201, 1, 2, 3]);
        query_seq.extend(std::iter::repeat_n(3, 70));
        contexts.extend(4001..4071);
        let case = PagedCase::new(&mut rng, layout, &[187, 201, 3, 4070]);
        let q = random(&mut rng, query_seq.len() * q_heads * head_dim, 1.0);
        let rows: Vec<&[u32]> = query_seq
            .iter()
            .map(|&s| &case.tables[s as usize * case.max_blocks..][..case.max_blocks])
            .collect();
        let visible: Vec<usize> = contexts.iter().map(|&c| c as usize).collect();
        let kv = PagedKv {
            layout,
            k: &case.k,
            v: &case.v,
        };
        let tiles = flash_tiles(&query_seq);
        for window in [None, Some(50)] {
            let target = AttentionTarget {
                kernel: AttentionKernel::Flash,
                ..case.target(q_heads, None)
            };
            let mut index = case.index(&ops, &query_seq, &contexts, target);
            index.set_window(window).unwrap();
            let got = case.run(&ops, &q, &mut index);
            let twin = flash_reference(&q, &kv, (&rows, &visible), q_heads, window, &tiles);
            let what = format!("flash d{head_dim}, {q_heads}/{kv_heads} heads, {window:?}");
            let worst = twin
                .compare(&got, q_heads, head_dim)
                .unwrap_or_else(|e| panic!("{what}{e}"));
            // And the exact attention, up to the twin's bf16 roundings of q and the weights.
            let exact = case.attend_window(&q, &query_seq, &contexts, q_heads, window);
            let off = got
                .iter()
                .zip(&exact)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            assert!(off < 1e-2, "{what}: {off} from the exact attention");
            eprintln!("{what}: worst {worst:.2e} from the twin, {off:.2e} from exact f32");
        }
    }
}
