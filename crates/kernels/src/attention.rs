//! Scaled dot-product attention over a paged KV cache (the block layout of vLLM's
//! PagedAttention, Kwon et al. 2023, <https://arxiv.org/abs/2309.06180>).
//!
//! One layer's cache is a pool of blocks; a block holds `block_size` positions, each with
//! `kv_heads × head_dim` values, for K and V separately. A sequence's block table lists its
//! blocks in position order. Query heads share KV heads in groups (GQA).

use rayon::prelude::*;

use crate::cpu::dot_f32;

/// The shape of one layer's paged K or V pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    pub block_size: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl KvLayout {
    /// Values per block.
    pub fn block_len(&self) -> usize {
        self.block_size * self.kv_heads * self.head_dim
    }

    /// Offset of (position, kv head) in a pool, through the block table.
    pub fn offset(&self, block_table: &[u32], pos: usize, kv_head: usize) -> usize {
        let block = block_table[pos / self.block_size] as usize;
        ((block * self.block_size + pos % self.block_size) * self.kv_heads + kv_head)
            * self.head_dim
    }
}

/// One layer's K and V pools, read-only during attention.
#[derive(Clone, Copy, Debug)]
pub struct PagedKv<'a> {
    pub layout: KvLayout,
    pub k: &'a [f32],
    pub v: &'a [f32],
}

/// Attention for `n` query tokens, of one or many sequences.
///
/// `q` holds `n × heads × head_dim` values; token `t` attends to positions
/// `0..visible[t]` of the sequence whose block table is `tables[t]` (causal prefill:
/// `visible[t] = pos_t + 1`). `out` has q's shape. Every (token, head) is computed on its
/// own, in the same order whatever else is in the batch: results are batch invariant.
pub fn paged_attention(
    q: &[f32],
    kv: &PagedKv<'_>,
    tables: &[&[u32]],
    visible: &[usize],
    heads: usize,
    out: &mut [f32],
) {
    let hd = kv.layout.head_dim;
    let group = heads / kv.layout.kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    out.par_chunks_mut(hd)
        .zip(q.par_chunks(hd))
        .enumerate()
        .for_each_init(Vec::new, |scores, (i, (o, qh))| {
            let (t, h) = (i / heads, i % heads);
            attend_head(qh, kv, tables[t], visible[t], h / group, scale, scores, o);
        });
}

/// One query head against positions `0..len` of one KV head.
#[allow(clippy::too_many_arguments)] // the hot inner call: a struct would be rebuilt per head
fn attend_head(
    q: &[f32],
    kv: &PagedKv<'_>,
    block_table: &[u32],
    len: usize,
    kv_head: usize,
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    let hd = kv.layout.head_dim;
    scores.clear();
    let mut max = f32::NEG_INFINITY;
    for pos in 0..len {
        let at = kv.layout.offset(block_table, pos, kv_head);
        let s = dot_f32(q, &kv.k[at..at + hd]) * scale;
        max = max.max(s);
        scores.push(s);
    }
    let mut sum = 0.0;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    out.fill(0.0);
    for (pos, s) in scores.iter().enumerate() {
        let at = kv.layout.offset(block_table, pos, kv_head);
        let p = s / sum;
        for (o, v) in out.iter_mut().zip(&kv.v[at..at + hd]) {
            *o += p * v;
        }
    }
}

/// The plain reference: contiguous K/V (`len × kv_heads × head_dim`), one query head at a
/// time, f64 softmax.
#[allow(clippy::too_many_arguments)] // mirrors paged_attention plus the contiguous K/V
pub fn attention_reference(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    kv_heads: usize,
    head_dim: usize,
    heads: usize,
    visible: &[usize],
    out: &mut [f32],
) {
    let group = heads / kv_heads;
    for (t, &len) in visible.iter().enumerate() {
        for h in 0..heads {
            let qh = &q[(t * heads + h) * head_dim..][..head_dim];
            let g = h / group;
            let row = |pos: usize| (pos * kv_heads + g) * head_dim;
            let scores: Vec<f64> = (0..len)
                .map(|p| {
                    let kr = &k[row(p)..row(p) + head_dim];
                    qh.iter()
                        .zip(kr)
                        .map(|(a, b)| f64::from(*a) * f64::from(*b))
                        .sum::<f64>()
                        / (head_dim as f64).sqrt()
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum: f64 = exps.iter().sum();
            let o = &mut out[(t * heads + h) * head_dim..][..head_dim];
            for (d, od) in o.iter_mut().enumerate() {
                *od = (0..len)
                    .map(|p| exps[p] / sum * f64::from(v[row(p) + d]))
                    .sum::<f64>() as f32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 2000) as f32 / 1000.0 - 1.0)
            .collect()
    }

    #[test]
    fn paged_matches_contiguous_reference_across_blocks() {
        let layout = KvLayout {
            block_size: 4,
            kv_heads: 2,
            head_dim: 8,
        };
        let (heads, len) = (4, 11);
        let k = values(len * 2 * 8, 1);
        let v = values(len * 2 * 8, 2);
        // Scatter the contiguous K/V into a pool through a shuffled block table.
        let table = [5u32, 0, 3];
        let mut kp = vec![f32::NAN; 6 * layout.block_len()];
        let mut vp = kp.clone();
        for pos in 0..len {
            for g in 0..2 {
                let at = layout.offset(&table, pos, g);
                let src = (pos * 2 + g) * 8;
                kp[at..at + 8].copy_from_slice(&k[src..src + 8]);
                vp[at..at + 8].copy_from_slice(&v[src..src + 8]);
            }
        }
        // Causal prefill of the last 3 positions.
        let visible = [9, 10, 11];
        let q = values(3 * heads * 8, 3);
        let mut got = vec![0.0; q.len()];
        let kv = PagedKv {
            layout,
            k: &kp,
            v: &vp,
        };
        paged_attention(&q, &kv, &[&table[..]; 3], &visible, heads, &mut got);
        let mut want = vec![0.0; q.len()];
        attention_reference(&q, &k, &v, 2, 8, heads, &visible, &mut want);
        for (a, b) in got.iter().zip(&want) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
    }
}
