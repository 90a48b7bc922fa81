//! A paged KV cache for one process: per layer, a pool of fixed-size blocks for K and V,
//! and a free list. Sequences hold block tables ([`SeqCache`]).
//!
//! This is the minimal allocator the one-process engine needs; the shard's allocator with
//! reference counts and a prefix cache builds on the same layout.

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
    free: Vec<u32>,
}

/// One sequence's view of the cache: its blocks in position order and its length.
#[derive(Clone, Debug, Default)]
pub struct SeqCache {
    pub block_table: Vec<u32>,
    pub len: usize,
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
            free: (0..num_blocks as u32).rev().collect(),
        }
    }

    /// How many blocks of `layout` fit in `budget_bytes` for `layers` layers (K and V, f32).
    /// On a tensor-parallel rank `layout.kv_heads` is the rank's own KV heads.
    pub fn blocks_for_budget(layout: KvLayout, layers: usize, budget_bytes: usize) -> usize {
        let block_bytes = 2 * layers * layout.block_len() * size_of::<f32>();
        budget_bytes.checked_div(block_bytes).unwrap_or(0)
    }

    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Grows `seq`'s block table to hold `new_len` positions.
    pub fn reserve(&mut self, seq: &mut SeqCache, new_len: usize) -> Result<(), ModelError> {
        let needed = new_len.div_ceil(self.layout.block_size);
        while seq.block_table.len() < needed {
            let block = self.free.pop().ok_or_else(|| ModelError::InvalidRequest {
                message: format!(
                    "the KV cache holds {} positions; this sequence needs {new_len}",
                    self.num_blocks * self.layout.block_size
                ),
            })?;
            seq.block_table.push(block);
        }
        Ok(())
    }

    /// Returns `seq`'s blocks to the free list.
    pub fn release(&mut self, seq: &mut SeqCache) {
        self.free.append(&mut seq.block_table);
        seq.len = 0;
    }

    /// Writes K and V of one position (`kv_heads × head_dim` values each) for `layer`.
    pub fn write(&mut self, layer: usize, seq: &SeqCache, pos: usize, k: &[f32], v: &[f32]) {
        let at = self.layout.offset(&seq.block_table, pos, 0);
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
}
