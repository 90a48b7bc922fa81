//! A paged KV cache of random values for the attention kernels' GPU tests (`gpu.rs`): the
//! same bf16-rounded K/V on the device and in the CPU twin's f32 pools; the test of the
//! legacy and grouped kernels' sliding window, and (in `flash`) the prefill kernel's test,
//! part of the `gpu` test binary.

use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};
pub use tessera_kernels::attention::GROUPED_TOLERANCE;
use tessera_kernels::attention::{AttentionParams, KvLayout, PagedKv, paged_attention};
use tessera_kernels::cuda::ops::Ops;
use tessera_kernels::cuda::{AttentionIndex, AttentionKernel, AttentionTarget};

use super::{close, device, ops, random, rounded, to_bf16};

mod flash;

/// A paged cache of random K/V (bf16 on the device; the CPU twin's f32 pools hold the same
/// rounded values) with one sequence per length, its blocks shuffled over the pool.
pub struct PagedCase {
    pub layout: KvLayout,
    pub blocks: usize,
    pub max_blocks: usize,
    pub tables: Vec<u32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

impl PagedCase {
    pub fn new(rng: &mut StdRng, layout: KvLayout, lens: &[usize]) -> PagedCase {
        let per_seq: Vec<usize> = lens.iter().map(|l| l.div_ceil(layout.block_size)).collect();
        let max_blocks = per_seq.iter().copied().max().unwrap_or(1);
        let blocks = per_seq.iter().sum::<usize>() + 3;
        let mut ids: Vec<u32> = (0..blocks as u32).collect();
        for i in (1..ids.len()).rev() {
            ids.swap(i, rng.random_range(0..=i));
        }
        let mut tables = vec![0u32; lens.len() * max_blocks];
        let mut next = ids.into_iter();
        for (s, &n) in per_seq.iter().enumerate() {
            for b in 0..n {
                tables[s * max_blocks + b] = next.next().unwrap();
            }
        }
        let pool = blocks * layout.block_len();
        // Keys up to ±2 spread the logits (q up to ±1: up to ±2·√head_dim before scaling).
        let (k, v) = (random(rng, pool, 2.0), random(rng, pool, 1.0));
        PagedCase {
            layout,
            blocks,
            max_blocks,
            tables,
            k: rounded(&k),
            v: rounded(&v),
        }
    }

    /// The CPU twin's output for queries `query_seq` seeing `contexts` positions.
    pub fn attend(
        &self,
        q: &[f32],
        query_seq: &[u32],
        contexts: &[u32],
        q_heads: usize,
    ) -> Vec<f32> {
        self.attend_window(q, query_seq, contexts, q_heads, None)
    }

    /// [`PagedCase::attend`] under a sliding window of the last `window` positions.
    pub fn attend_window(
        &self,
        q: &[f32],
        query_seq: &[u32],
        contexts: &[u32],
        q_heads: usize,
        window: Option<usize>,
    ) -> Vec<f32> {
        let m = self.max_blocks;
        let rows: Vec<&[u32]> = query_seq
            .iter()
            .map(|&s| &self.tables[s as usize * m..(s as usize + 1) * m])
            .collect();
        let visible: Vec<usize> = contexts.iter().map(|&c| c as usize).collect();
        let kv = PagedKv {
            layout: self.layout,
            k: &self.k,
            v: &self.v,
        };
        let mut want = vec![0.0; q.len()];
        let params = AttentionParams {
            window,
            ..AttentionParams::causal(self.layout.head_dim)
        };
        paged_attention(q, &kv, &rows, &visible, q_heads, &params, &mut want);
        want
    }

    pub fn target(&self, q_heads: usize, partitions: Option<usize>) -> AttentionTarget {
        AttentionTarget {
            layout: self.layout,
            cache_blocks: self.blocks,
            q_heads,
            kernel: AttentionKernel::Grouped,
            partitions,
        }
    }

    /// The device index of queries `query_seq` seeing `contexts` positions of this cache.
    pub fn index(
        &self,
        ops: &Ops<'_>,
        query_seq: &[u32],
        contexts: &[u32],
        target: AttentionTarget,
    ) -> AttentionIndex {
        ops.attention_index(&self.tables, self.max_blocks, query_seq, contexts, target)
            .unwrap()
    }

    /// `q`'s attention on the device through `index`.
    pub fn run(&self, ops: &Ops<'_>, q: &[f32], index: &mut AttentionIndex) -> Vec<f32> {
        let (k_cache, v_cache) = (
            ops.upload(&to_bf16(&self.k)).unwrap(),
            ops.upload(&to_bf16(&self.v)).unwrap(),
        );
        let mut out = ops.alloc::<f32>(q.len()).unwrap();
        let q_dev = ops.upload(q).unwrap();
        ops.paged_attention(&mut out, &q_dev, (&k_cache, &v_cache), self.layout, index)
            .unwrap();
        ops.download(&out).unwrap()
    }
}

#[test]
fn both_attention_kernels_slide_a_window() {
    let Some(dev) = device() else { return };
    let ops = ops(&dev);
    let mut rng = StdRng::seed_from_u64(13);
    let layout = KvLayout {
        block_size: 16,
        kv_heads: 2,
        head_dim: 64,
    };
    let q_heads = 8;
    // Contexts on both sides of each window, of the blocks' edges and of the legacy
    // kernel's 256-position partitions.
    let contexts: Vec<u32> = vec![1, 15, 17, 100, 255, 257, 1000, 4097];
    let lens: Vec<usize> = contexts.iter().map(|&c| c as usize).collect();
    let query_seq: Vec<u32> = (0..contexts.len() as u32).collect();
    let case = PagedCase::new(&mut rng, layout, &lens);
    let q = random(&mut rng, contexts.len() * q_heads * layout.head_dim, 1.0);
    let whole = case.attend(&q, &query_seq, &contexts, q_heads);
    for window in [1, 16, 100, 257, 4096] {
        let want = case.attend_window(&q, &query_seq, &contexts, q_heads, Some(window));
        // Every window is shorter than the longest context, so it moves the twin's output.
        let moved = want
            .iter()
            .zip(&whole)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(
            moved > 1e-3,
            "a window of {window} moved the output by {moved}"
        );
        let runs = [
            (AttentionKernel::Legacy, None),
            (AttentionKernel::Grouped, Some(1)),
            (AttentionKernel::Grouped, None),
            (AttentionKernel::Grouped, Some(7)),
        ];
        for (kernel, partitions) in runs {
            let target = AttentionTarget {
                kernel,
                ..case.target(q_heads, partitions)
            };
            let mut index = case.index(&ops, &query_seq, &contexts, target);
            index.set_window(Some(window)).unwrap();
            let what = format!(
                "{kernel} attention, window {window}, {} partitions",
                index.partitions()
            );
            close(
                &what,
                &case.run(&ops, &q, &mut index),
                &want,
                GROUPED_TOLERANCE,
            );
            // And back to the whole context on the same index.
            index.set_window(None).unwrap();
            close(
                &what,
                &case.run(&ops, &q, &mut index),
                &whole,
                GROUPED_TOLERANCE,
            );
        }
    }
    let target = case.target(q_heads, None);
    let mut index = case.index(&ops, &query_seq, &contexts, target);
    assert!(
        index.set_window(Some(0)).is_err(),
        "a window of 0 positions"
    );
}
