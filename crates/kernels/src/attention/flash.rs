//! The prefill attention kernel's tiles and its CPU twin (`cuda/attention_flash.cu`, in the
//! style of FlashAttention-2): queries go in tiles of up to [`FLASH_ROWS`] of one sequence,
//! keys in tiles of [`FLASH_KEYS`] positions, and the tensor cores take bf16 inputs. The
//! twin rounds where the kernel rounds, so a test can hold the kernel to the summation
//! order's error plus a bound it derives for the roundings of the softmax's weights.

use half::bf16;

use super::PagedKv;

/// Queries per tile of the prefill kernel (its 4 warps × the mma's 16 rows).
pub const FLASH_ROWS: usize = 64;
/// Positions per key tile of the prefill kernel.
pub const FLASH_KEYS: usize = 64;

/// The prefill kernel's query tiles, `[first query, count]`: each run of consecutive queries
/// of one sequence (`query_seq`) cut into tiles of at most [`FLASH_ROWS`]. A decode query
/// is a tile of its own.
pub fn flash_tiles(query_seq: &[u32]) -> Vec<[u32; 2]> {
    let mut tiles: Vec<[u32; 2]> = Vec::new();
    for (i, &seq) in query_seq.iter().enumerate() {
        match tiles.last_mut() {
            Some(tile) if query_seq[tile[0] as usize] == seq && (tile[1] as usize) < FLASH_ROWS => {
                tile[1] += 1;
            }
            _ => tiles.push([i as u32, 1]),
        }
    }
    tiles
}

/// What the twin computes: the output, and for each (query, head) a bound on what the
/// kernel's output may differ by from it where an exponential lands on the other side of a
/// bf16 rounding (the device's `exp2f` and the logits' summation order differ from the
/// twin's in the last bits): each weight may move by one bf16 step, which moves the output
/// by at most Σᵢ step(pᵢ) · maxₐ |vᵢₐ − oₐ| / Σᵢ pᵢ.
#[derive(Clone, Debug, PartialEq)]
pub struct FlashTwin {
    pub out: Vec<f32>,
    pub bound: Vec<f32>,
}

/// What the kernel may differ from its twin by besides [`FlashTwin::bound`]: the order of
/// f32 sums (the tensor cores' within each 16-term k-step, the twin's one by one; each
/// row's sum of weights added per lane, then over its 4 lanes), a few ulp of outputs of
/// magnitude ≤ 1 (logits of ≤ 128 products of magnitude ≤ 2, sums of ≤ 4,097 weights ≤ 1).
pub const FLASH_ORDER_TOLERANCE: f32 = 2e-5;

impl FlashTwin {
    /// `got` (the kernel's output over `heads` heads of `head_dim`) against the twin: the
    /// largest difference, or the first value off by more than its bound plus
    /// [`FLASH_ORDER_TOLERANCE`].
    pub fn compare(&self, got: &[f32], heads: usize, head_dim: usize) -> Result<f32, String> {
        if got.len() != self.out.len() {
            return Err(format!(
                "{} values, the twin has {}",
                got.len(),
                self.out.len()
            ));
        }
        let mut worst = 0.0f32;
        for (i, (g, w)) in got.iter().zip(&self.out).enumerate() {
            let allowed = FLASH_ORDER_TOLERANCE + self.bound[i / head_dim];
            let err = (g - w).abs();
            if err.is_nan() || err > allowed {
                let query = i / head_dim / heads;
                return Err(format!(
                    "[{i}] (query {query}): {g} vs twin {w} (allowed {allowed})"
                ));
            }
            worst = worst.max(err);
        }
        Ok(worst)
    }
}

/// The CPU twin of the prefill kernel over `tiles` ([`flash_tiles`]): query `t` attends to
/// the last `window` (all when `None`) of positions `0..visible[t]` through `tables[t]`,
/// with the kernel's roundings: q scaled by `scale · log2(e)` and rounded to bf16; base-2
/// logits summed in f32; per key tile (from the lowest first position of the query tile)
/// the running maximum, the weights 2^(s − m) rounded to bf16, added to the sum and to
/// the weighted V in f32. The K/V pools hold bf16-rounded values, as the device's do.
pub fn flash_reference(
    q: &[f32],
    kv: &PagedKv<'_>,
    (tables, visible): (&[&[u32]], &[usize]),
    heads: usize,
    window: Option<usize>,
    tiles: &[[u32; 2]],
) -> FlashTwin {
    let hd = kv.layout.head_dim;
    let group = heads / kv.layout.kv_heads;
    let scale_log2 = std::f32::consts::LOG2_E / (hd as f32).sqrt();
    let first_key = |t: usize| window.map_or(0, |w| visible[t].saturating_sub(w));
    let mut out = vec![0.0f32; q.len()];
    let mut bound = vec![0.0f32; q.len() / hd];
    for &[first, count] in tiles {
        let rows = first as usize..(first + count) as usize;
        let tile_lo = rows.clone().map(first_key).min().unwrap_or(0);
        let tile_hi = rows.clone().map(|t| visible[t]).max().unwrap_or(0);
        for t in rows {
            let span = first_key(t)..visible[t];
            for h in 0..heads {
                let at = (t * heads + h) * hd;
                let qs: Vec<f32> = q[at..at + hd]
                    .iter()
                    .map(|&x| bf16::from_f32(x * scale_log2).to_f32())
                    .collect();
                let offset = |pos: usize| kv.layout.offset(tables[t], pos, h / group);
                let mut m = f32::NEG_INFINITY;
                let mut l = 0.0f32;
                let mut o = vec![0.0f32; hd];
                // Each weight with the V row it weighs, for the bound.
                let mut weights: Vec<(f32, usize)> = Vec::new();
                for base in (tile_lo..tile_hi).step_by(FLASH_KEYS) {
                    let keys = base.max(span.start)..(base + FLASH_KEYS).min(span.end);
                    let s: Vec<f32> = keys
                        .clone()
                        .map(|pos| {
                            let k = &kv.k[offset(pos)..offset(pos) + hd];
                            qs.iter()
                                .zip(k)
                                .fold(0.0f32, |acc, (a, b)| a.mul_add(*b, acc))
                        })
                        .collect();
                    let top = s.iter().copied().fold(m, f32::max);
                    if top == f32::NEG_INFINITY {
                        continue;
                    }
                    let rescale = (m - top).exp2();
                    m = top;
                    l *= rescale;
                    o.iter_mut().for_each(|x| *x *= rescale);
                    for (&score, pos) in s.iter().zip(keys) {
                        let p = bf16::from_f32((score - m).exp2()).to_f32();
                        l += p;
                        let v = &kv.v[offset(pos)..offset(pos) + hd];
                        o.iter_mut()
                            .zip(v)
                            .for_each(|(x, v)| *x = p.mul_add(*v, *x));
                        weights.push((p, offset(pos)));
                    }
                }
                for (x, acc) in out[at..at + hd].iter_mut().zip(&o) {
                    *x = acc / l;
                }
                let o = &out[at..at + hd];
                let moved: f32 = weights
                    .iter()
                    .map(|&(p, vat)| {
                        let far = kv.v[vat..vat + hd]
                            .iter()
                            .zip(o)
                            .map(|(v, x)| (v - x).abs())
                            .fold(0.0f32, f32::max);
                        bf16_step(p) * far
                    })
                    .sum();
                bound[at / hd] = moved / l;
            }
        }
    }
    FlashTwin { out, bound }
}

/// The distance from `p` (a bf16 value in [0, 1]) to its next bf16 neighbour upwards.
fn bf16_step(p: f32) -> f32 {
    let next = bf16::from_bits(bf16::from_f32(p).to_bits() + 1).to_f32();
    next - p
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::{Rng as _, SeedableRng as _};

    use super::*;
    use crate::attention::{AttentionParams, KvLayout, paged_attention};

    #[test]
    fn tiles_cut_runs_of_one_sequence_at_64_queries() {
        assert_eq!(flash_tiles(&[]), Vec::<[u32; 2]>::new());
        // A decode query, a 130-token chunk, two more decode queries.
        let mut seqs = vec![3u32];
        seqs.extend(std::iter::repeat_n(0, 130));
        seqs.extend([5, 3]);
        assert_eq!(
            flash_tiles(&seqs),
            vec![[0, 1], [1, 64], [65, 64], [129, 2], [131, 1], [132, 1]]
        );
    }

    fn rounded(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| bf16::from_f32(rng.random_range(-scale..scale)).to_f32())
            .collect()
    }

    /// The twin against the exact f32 attention: it differs only by its roundings (q and
    /// the weights to bf16), each within 2^-9 relative, so well under 1e-2 on outputs of
    /// magnitude ≤ 1; a wrong key tile, mask or rescale is off by far more. Chunks start
    /// mid-sequence and cross the key tiles' and the cache blocks' edges; GQA 1, 4 and 8;
    /// head_dim 64 and 128; with and without a sliding window.
    #[test]
    fn the_twin_is_attention_up_to_its_bf16_roundings() {
        let mut rng = StdRng::seed_from_u64(5);
        for (kv_heads, heads, hd) in [(2, 2, 64), (2, 8, 128), (1, 8, 64)] {
            let layout = KvLayout {
                block_size: 16,
                kv_heads,
                head_dim: hd,
            };
            // Sequence 0: a 150-token chunk after 37 cached positions; sequence 1: one
            // decode query at position 200; sequence 2: a 3-token chunk from the start.
            let (tables, pool) = {
                let blocks = [12usize, 13, 1];
                let total: usize = blocks.iter().sum();
                let mut ids: Vec<u32> = (0..total as u32).rev().collect();
                let rows: Vec<Vec<u32>> = blocks
                    .iter()
                    .map(|&n| ids.split_off(ids.len() - n))
                    .collect();
                (rows, total * layout.block_len())
            };
            let k = rounded(&mut rng, pool, 2.0);
            let v = rounded(&mut rng, pool, 1.0);
            let kv = PagedKv {
                layout,
                k: &k,
                v: &v,
            };
            let mut query_seq = vec![0u32; 150];
            query_seq.extend([1, 2, 2, 2]);
            let mut visible: Vec<usize> = (38..188).collect();
            visible.extend([201, 1, 2, 3]);
            let rows: Vec<&[u32]> = query_seq
                .iter()
                .map(|&s| tables[s as usize].as_slice())
                .collect();
            let q = rounded(&mut rng, query_seq.len() * heads * hd, 1.0);
            let tiles = flash_tiles(&query_seq);
            for window in [None, Some(50)] {
                let twin = flash_reference(&q, &kv, (&rows, &visible), heads, window, &tiles);
                let mut want = vec![0.0f32; q.len()];
                let params = AttentionParams {
                    window,
                    ..AttentionParams::causal(hd)
                };
                paged_attention(&q, &kv, &rows, &visible, heads, &params, &mut want);
                let worst = twin
                    .out
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0f32, f32::max);
                assert!(
                    worst < 1e-2,
                    "{kv_heads}/{heads} heads, d {hd}, {window:?}: {worst}"
                );
                assert!(worst > 0.0, "the twin rounds: it cannot be exact");
                let widest = twin.bound.iter().copied().fold(0.0f32, f32::max);
                assert!(widest > 0.0 && widest < 0.05, "bound {widest}");
            }
        }
    }
}
