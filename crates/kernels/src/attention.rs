//! Scaled dot-product attention over a paged KV cache (the block layout of vLLM's
//! PagedAttention, Kwon et al. 2023, <https://arxiv.org/abs/2309.06180>).
//!
//! One layer's cache is a pool of blocks; a block holds `block_size` positions, each with
//! `kv_heads × head_dim` values, for K and V separately. A sequence's block table lists its
//! blocks in position order. Query heads share KV heads in groups (GQA).
//!
//! [`AttentionParams`] carries what differs between architectures: the logit scale, Gemma 2's
//! soft cap on the logits, and a sliding window (Mistral, Gemma 2's alternate layers) that
//! limits each token to the last `window` positions, itself included — transformers'
//! `kv_idx > q_idx - sliding_window`.

use rayon::prelude::*;

mod flash;
pub use flash::{
    FLASH_KEYS, FLASH_ORDER_TOLERANCE, FLASH_ROWS, FlashTwin, flash_reference, flash_tiles,
};

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

/// How one layer's attention turns q·k into weights.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionParams {
    /// Multiplies q·k: `1/√head_dim`, or Gemma 2's `query_pre_attn_scalar^-½`.
    pub scale: f32,
    /// Gemma 2's soft cap: a scaled logit `s` becomes `cap · tanh(s / cap)`.
    pub softcap: Option<f32>,
    /// A token sees only the last `window` positions, its own included.
    pub window: Option<usize>,
}

impl AttentionParams {
    /// Plain causal attention over heads of `head_dim` values.
    pub fn causal(head_dim: usize) -> AttentionParams {
        AttentionParams {
            scale: 1.0 / (head_dim as f32).sqrt(),
            softcap: None,
            window: None,
        }
    }

    /// The positions a token that sees `0..visible` attends to under the window.
    pub fn span(&self, visible: usize) -> std::ops::Range<usize> {
        let first = self.window.map_or(0, |w| visible.saturating_sub(w));
        first..visible
    }

    /// The logit of a raw q·k.
    #[inline]
    fn logit(&self, dot: f32) -> f32 {
        let s = dot * self.scale;
        match self.softcap {
            Some(cap) => (s / cap).tanh() * cap,
            None => s,
        }
    }
}

/// Attention for `n` query tokens, of one or many sequences.
///
/// `q` holds `n × heads × head_dim` values; token `t` attends to positions
/// `params.span(visible[t])` of the sequence whose block table is `tables[t]` (causal
/// prefill: `visible[t] = pos_t + 1`). `out` has q's shape. Every (token, head) is computed
/// on its own, in the same order whatever else is in the batch: results are batch invariant.
pub fn paged_attention(
    q: &[f32],
    kv: &PagedKv<'_>,
    tables: &[&[u32]],
    visible: &[usize],
    heads: usize,
    params: &AttentionParams,
    out: &mut [f32],
) {
    let hd = kv.layout.head_dim;
    let group = heads / kv.layout.kv_heads;
    out.par_chunks_mut(hd)
        .zip(q.par_chunks(hd))
        .enumerate()
        .for_each(|(i, (o, qh))| {
            let (t, h) = (i / heads, i % heads);
            let head = Head {
                q: qh,
                kv,
                block_table: tables[t],
                span: params.span(visible[t]),
                kv_head: h / group,
                params,
            };
            SCORES.with_borrow_mut(|scores| attend_head(&head, scores, o));
        });
}

thread_local! {
    /// Each pool thread's scratch for one head's positions and scores, kept from step to
    /// step (a decode step runs every head of every layer): as long as the longest context
    /// this thread has attended over.
    static SCORES: std::cell::RefCell<Vec<(usize, f32)>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// One query head's attention: the query, the pools, the sequence's block table, the
/// positions it sees and the KV head it reads.
struct Head<'a> {
    q: &'a [f32],
    kv: &'a PagedKv<'a>,
    block_table: &'a [u32],
    span: std::ops::Range<usize>,
    kv_head: usize,
    params: &'a AttentionParams,
}

/// [`Head`] into `out`: with AVX2 where the CPU has it (the same bits as without: the same
/// dot kernel, the same float steps).
fn attend_head(head: &Head<'_>, scores: &mut Vec<(usize, f32)>, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::Features::get().avx2 {
        // SAFETY: AVX2 and FMA are present.
        return unsafe { attend_head_avx2(head, scores, out) };
    }
    attend_head_with::<0>(head, scores, out, dot_f32);
}

/// [`attend_head`] compiled for AVX2, its loops and dot products inlined.
///
/// # Safety
/// Needs AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_head_avx2(head: &Head<'_>, scores: &mut Vec<(usize, f32)>, out: &mut [f32]) {
    // SAFETY: this function's features are the kernel's.
    let dot = |a: &[f32], b: &[f32]| unsafe { crate::cpu::dot_f32_avx2(a, [b])[0] };
    match head.kv.layout.head_dim {
        64 => attend_head_with::<64>(head, scores, out, dot),
        128 => attend_head_with::<128>(head, scores, out, dot),
        _ => attend_head_with::<0>(head, scores, out, dot),
    }
}

/// [`attend_head`]'s steps, with `dot` for the scores (`scores`: scratch for each position's
/// K/V offset and score). `HD`: the head dimension when it is known at compile time (the
/// weighted sum of V then stays in registers), or 0.
#[inline(always)]
fn attend_head_with<const HD: usize>(
    head: &Head<'_>,
    scores: &mut Vec<(usize, f32)>,
    out: &mut [f32],
    dot: impl Fn(&[f32], &[f32]) -> f32,
) {
    let Head {
        q,
        kv,
        block_table,
        ref span,
        kv_head,
        params,
    } = *head;
    let layout = kv.layout;
    let (hd, bs) = (layout.head_dim, layout.block_size);
    let stride = layout.kv_heads * hd;
    // Each position's K/V offset with its score: block by block (one table lookup per
    // block, then a fixed stride).
    scores.clear();
    let mut max = f32::NEG_INFINITY;
    let blocks = span.start / bs..span.end.div_ceil(bs);
    for (bi, &block) in blocks.clone().zip(&block_table[blocks]) {
        let (first, end) = ((bi * bs).max(span.start), ((bi + 1) * bs).min(span.end));
        let base = ((block as usize * bs + first % bs) * layout.kv_heads + kv_head) * hd;
        for at in (base..).step_by(stride).take(end - first) {
            let s = params.logit(dot(q, &kv.k[at..at + hd]));
            max = max.max(s);
            scores.push((at, s));
        }
    }
    let mut sum = 0.0;
    for (_, s) in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    // Σ p·v in position order, each value as `o += p·v`: into a local array when the head
    // dimension is known at compile time (it then stays in registers), else into `out`.
    let weigh = |acc: &mut [f32]| {
        let len = acc.len();
        for &(at, s) in scores.iter() {
            let p = s / sum;
            for (o, v) in acc.iter_mut().zip(&kv.v[at..at + len]) {
                *o += p * v;
            }
        }
    };
    if HD > 0 && hd == HD {
        let mut acc = [0.0f32; HD];
        weigh(&mut acc);
        out.copy_from_slice(&acc);
    } else {
        out.fill(0.0);
        weigh(out);
    }
}

/// Tolerance of the grouped CUDA kernel (`attention_grouped.cu`) against
/// [`paged_attention`], relative to max(|value|, 1), on the GPU and under the CPU emulation
/// (`tests/emulated.rs`): both read the same bf16-rounded K/V and f32 q, so what differs
/// is f32 summation order (dots of ≤ 128 products; sums over ≤ 4,097 positions, split or
/// not) and `ex2.approx` (2 ulp) against the twin's `exp`. Each output is a convex
/// combination of |v| ≤ 1, so these stay near 1e-6 (the emulated kernel is within 3e-7 of
/// an f64 reference); 1e-4 leaves room for the device's rounding while a wrong position,
/// head or partition weight is off by far more.
pub const GROUPED_TOLERANCE: f32 = 1e-4;

/// The plain reference: contiguous K/V (`len × kv_heads × head_dim`), one query head at a
/// time, every position masked explicitly (no span arithmetic), f64 softmax.
#[allow(clippy::too_many_arguments)] // mirrors paged_attention plus the contiguous K/V
pub fn attention_reference(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    kv_heads: usize,
    head_dim: usize,
    heads: usize,
    visible: &[usize],
    params: &AttentionParams,
    out: &mut [f32],
) {
    let group = heads / kv_heads;
    for (t, &len) in visible.iter().enumerate() {
        let query_pos = len - 1;
        let seen = |p: usize| params.window.is_none_or(|w| p + w > query_pos);
        for h in 0..heads {
            let qh = &q[(t * heads + h) * head_dim..][..head_dim];
            let g = h / group;
            let row = |pos: usize| (pos * kv_heads + g) * head_dim;
            let scores: Vec<f64> = (0..len)
                .map(|p| {
                    if !seen(p) {
                        return f64::NEG_INFINITY;
                    }
                    let kr = &k[row(p)..row(p) + head_dim];
                    let dot: f64 = qh
                        .iter()
                        .zip(kr)
                        .map(|(a, b)| f64::from(*a) * f64::from(*b))
                        .sum();
                    let s = dot * f64::from(params.scale);
                    params
                        .softcap
                        .map_or(s, |cap| (s / f64::from(cap)).tanh() * f64::from(cap))
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

    /// Paged attention of the last 3 of 11 positions, through a shuffled block table,
    /// against the contiguous reference.
    fn paged_against_reference(params: &AttentionParams) -> f32 {
        let layout = KvLayout {
            block_size: 4,
            kv_heads: 2,
            head_dim: 8,
        };
        let (heads, len) = (4, 11);
        let k = values(len * 2 * 8, 1);
        let v = values(len * 2 * 8, 2);
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
        let visible = [9, 10, 11];
        let q: Vec<f32> = values(3 * heads * 8, 3).iter().map(|x| x * 4.0).collect();
        let mut got = vec![0.0; q.len()];
        let kv = PagedKv {
            layout,
            k: &kp,
            v: &vp,
        };
        let tables = [&table[..]; 3];
        paged_attention(&q, &kv, &tables, &visible, heads, params, &mut got);
        let mut want = vec![0.0; q.len()];
        attention_reference(&q, &k, &v, 2, 8, heads, &visible, params, &mut want);
        let worst = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(worst < 1e-5, "{params:?}: differs by {worst}");
        // How far the result moved from plain causal attention: a parameter that did
        // nothing would leave it where it was.
        let mut plain = vec![0.0; q.len()];
        let causal = AttentionParams::causal(8);
        attention_reference(&q, &k, &v, 2, 8, heads, &visible, &causal, &mut plain);
        got.iter()
            .zip(&plain)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max)
    }

    #[test]
    fn paged_matches_contiguous_reference_across_blocks() {
        assert!(paged_against_reference(&AttentionParams::causal(8)) < 1e-5);
    }

    #[test]
    fn a_sliding_window_and_a_soft_cap_match_the_reference_and_change_the_result() {
        let windowed = AttentionParams {
            window: Some(3),
            ..AttentionParams::causal(8)
        };
        assert!(paged_against_reference(&windowed) > 1e-3);
        let capped = AttentionParams {
            scale: 0.9,
            softcap: Some(1.5),
            window: None,
        };
        assert!(paged_against_reference(&capped) > 1e-3);
        // A window no shorter than the context is plain causal attention.
        let wide = AttentionParams {
            window: Some(11),
            ..AttentionParams::causal(8)
        };
        assert!(paged_against_reference(&wide) < 1e-5);
    }

    #[test]
    fn the_span_keeps_the_last_window_positions_and_the_token_itself() {
        let p = AttentionParams {
            window: Some(4),
            ..AttentionParams::causal(8)
        };
        assert_eq!(p.span(10), 6..10);
        assert_eq!(p.span(3), 0..3);
        assert_eq!(AttentionParams::causal(8).span(10), 0..10);
    }

    /// Head dimensions 64 and 128 keep the weighted sum of V in registers: the same bits as
    /// the general path (summed through memory), and the reference's values, with a
    /// window starting inside a block.
    #[test]
    fn head_dims_known_at_compile_time_give_the_general_paths_bits() {
        for hd in [64, 128] {
            let layout = KvLayout {
                block_size: 16,
                kv_heads: 2,
                head_dim: hd,
            };
            let (len, table) = (37, [2u32, 0, 1]);
            let k = values(3 * layout.block_len(), 5);
            let v = values(3 * layout.block_len(), 6);
            let kv = PagedKv {
                layout,
                k: &k,
                v: &v,
            };
            let q: Vec<f32> = values(hd, 7).iter().map(|x| x * 2.0).collect();
            let params = AttentionParams {
                window: Some(30),
                ..AttentionParams::causal(hd)
            };
            let head = Head {
                q: &q,
                kv: &kv,
                block_table: &table,
                span: params.span(len),
                kv_head: 1,
                params: &params,
            };
            let (mut fixed, mut general) = (vec![0.0; hd], vec![0.0; hd]);
            attend_head(&head, &mut Vec::new(), &mut fixed);
            attend_head_with::<0>(&head, &mut Vec::new(), &mut general, dot_f32);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&fixed), bits(&general), "head_dim {hd}");
            // The reference, from the same values laid out contiguously.
            let contiguous = |pool: &[f32]| -> Vec<f32> {
                (0..len)
                    .flat_map(|p| (0..2).map(move |g| (p, g)))
                    .flat_map(|(p, g)| pool[layout.offset(&table, p, g)..][..hd].to_vec())
                    .collect()
            };
            let q2: Vec<f32> = [vec![0.0; hd], q.clone()].concat();
            let mut want = vec![0.0; 2 * hd];
            let (ck, cv) = (contiguous(&k), contiguous(&v));
            attention_reference(&q2, &ck, &cv, 2, hd, 2, &[len], &params, &mut want);
            let worst = (fixed.iter().zip(&want[hd..]))
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            assert!(worst < 1e-5, "head_dim {hd}: {worst}");
        }
    }
}
