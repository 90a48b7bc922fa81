//! The paged KV cache of one process: per layer, a pool of fixed-size blocks for K and V.
//!
//! This is storage only. Which blocks a sequence holds is decided by its owner: the
//! shard's block allocator (reference counts, prefix cache) for a serving group, or
//! [`SeqCache`] for one sequence that owns the whole cache (single-process generation).

use tessera_kernels::attention::{KvLayout, PagedKv};

use crate::error::ModelError;

/// Positions per block unless configured otherwise (vLLM's default as well).
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// K and V pools of every layer.
#[derive(Debug)]
pub struct KvCache {
    layout: KvLayout,
    num_blocks: usize,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

/// One sequence's part of a batched forward pass.
#[derive(Clone, Copy, Debug)]
pub struct SeqChunk<'a> {
    /// The tokens to run, at positions `start..start + tokens.len()`.
    pub tokens: &'a [u32],
    /// The sequence's length in the cache before this chunk.
    pub start: usize,
    /// The blocks of positions `0..start + tokens.len()`, in position order.
    pub block_table: &'a [u32],
    /// Whether the logits of the chunk's last token are wanted.
    pub logits: bool,
}

/// A sequence that owns the cache from block 0 on: its block table is `0, 1, 2, …`.
#[derive(Clone, Debug, Default)]
pub struct SeqCache {
    pub block_table: Vec<u32>,
    pub len: usize,
}

impl SeqCache {
    /// Extends the block table to hold `new_len` positions.
    pub fn grow(&mut self, new_len: usize, cache: &KvCache) -> Result<(), ModelError> {
        let needed = new_len.div_ceil(cache.layout.block_size);
        if needed > cache.num_blocks {
            return Err(ModelError::InvalidRequest {
                message: format!(
                    "the KV cache holds {} positions; this sequence needs {new_len}",
                    cache.num_blocks * cache.layout.block_size
                ),
            });
        }
        while self.block_table.len() < needed {
            self.block_table.push(self.block_table.len() as u32);
        }
        Ok(())
    }
}

/// How many blocks of `layout` fit in `budget_bytes` for `layers` layers, K and V stored
/// with `value_bytes` bytes per value (f32 on the CPU, bf16 on a GPU, f32 on its exact path).
pub fn blocks_for_budget(
    layout: KvLayout,
    layers: usize,
    budget_bytes: usize,
    value_bytes: usize,
) -> usize {
    let block_bytes = 2 * layers * layout.block_len() * value_bytes;
    budget_bytes.checked_div(block_bytes).unwrap_or(0)
}

impl KvCache {
    /// A cache of `num_blocks` blocks for `layers` layers.
    pub fn new(layout: KvLayout, layers: usize, num_blocks: usize) -> KvCache {
        let pool = num_blocks * layout.block_len();
        KvCache {
            layout,
            num_blocks,
            k: (0..layers).map(|_| vec![0.0; pool]).collect(),
            v: (0..layers).map(|_| vec![0.0; pool]).collect(),
        }
    }

    /// How many blocks of `layout` fit in `budget_bytes` for `layers` layers (K and V, f32).
    /// On a tensor-parallel rank `layout.kv_heads` is the rank's own KV heads.
    pub fn blocks_for_budget(layout: KvLayout, layers: usize, budget_bytes: usize) -> usize {
        blocks_for_budget(layout, layers, budget_bytes, size_of::<f32>())
    }

    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Writes K and V of one position (`kv_heads × head_dim` values each) for `layer`.
    pub fn write(&mut self, layer: usize, block_table: &[u32], pos: usize, k: &[f32], v: &[f32]) {
        let at = self.layout.offset(block_table, pos, 0);
        let n = k.len();
        self.k[layer][at..at + n].copy_from_slice(k);
        self.v[layer][at..at + n].copy_from_slice(v);
    }

    /// The pools of `layer`, for attention.
    pub fn layer(&self, layer: usize) -> PagedKv<'_> {
        PagedKv {
            layout: self.layout,
            k: &self.k[layer],
            v: &self.v[layer],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_for_budget_counts_k_and_v_of_every_layer() {
        let layout = KvLayout {
            block_size: 16,
            kv_heads: 1,
            head_dim: 64,
        };
        // 16 × 64 × 4 bytes = 4 KiB per pool per layer; K + V over 30 layers = 240 KiB.
        let per_block = 2 * 30 * 16 * 64 * 4;
        assert_eq!(KvCache::blocks_for_budget(layout, 30, per_block * 10), 10);
        assert_eq!(
            KvCache::blocks_for_budget(layout, 30, per_block * 10 - 1),
            9
        );
        assert_eq!(KvCache::blocks_for_budget(layout, 0, 1 << 20), 0);
    }

    #[test]
    fn a_lone_sequence_grows_through_the_blocks_in_order() {
        let layout = KvLayout {
            block_size: 4,
            kv_heads: 1,
            head_dim: 2,
        };
        let cache = KvCache::new(layout, 1, 3);
        let mut seq = SeqCache::default();
        seq.grow(5, &cache).unwrap();
        assert_eq!(seq.block_table, [0, 1]);
        seq.grow(12, &cache).unwrap();
        assert_eq!(seq.block_table, [0, 1, 2]);
        assert!(seq.grow(13, &cache).is_err());
    }
}
