//! A batch of sequence chunks as a forward pass indexes it: one row per token for the
//! embedding, RoPE and the KV write, one block-table row per sequence for attention
//! (the CPU pass reads the token rows; the device kernels read them all). Pure host
//! arithmetic, tested without a GPU.

use crate::error::ModelError;
use crate::kv_cache::SeqChunk;

/// The index arrays of one forward pass.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct BatchIndex {
    pub(crate) tokens: Vec<u32>,
    pub(crate) positions: Vec<u32>,
    /// Cache slot of each token: block × block_size + offset.
    pub(crate) slots: Vec<i64>,
    /// One row of `max_blocks` block ids per chunk (zero-padded).
    pub(crate) tables: Vec<u32>,
    pub(crate) max_blocks: usize,
    /// The chunk (table row) of each token.
    pub(crate) query_seq: Vec<u32>,
    /// Positions each token attends to: causal, its position + 1.
    pub(crate) contexts: Vec<u32>,
    /// Tokens whose logits are wanted, in batch order.
    pub(crate) wanted: Vec<usize>,
}

impl BatchIndex {
    /// The index of `batch` after checking it: at least one token, every token inside a
    /// vocabulary of `vocab`, every block table covering its positions inside a cache of
    /// `blocks` blocks of `block_size` positions.
    #[cfg(feature = "cuda")]
    pub(crate) fn checked(
        batch: &[SeqChunk<'_>],
        vocab: usize,
        cache: (usize, usize),
    ) -> Result<BatchIndex, ModelError> {
        let mut ix = BatchIndex::default();
        ix.check_and_fill(batch, vocab, cache)?;
        Ok(ix)
    }

    /// [`BatchIndex::checked`] into this index's arrays, reusing them.
    pub(crate) fn check_and_fill(
        &mut self,
        batch: &[SeqChunk<'_>],
        vocab: usize,
        (block_size, blocks): (usize, usize),
    ) -> Result<(), ModelError> {
        if batch.iter().all(|c| c.tokens.is_empty()) {
            return Err(ModelError::InvalidRequest {
                message: "no tokens to run".into(),
            });
        }
        for chunk in batch {
            check_chunk(vocab, chunk, (block_size, blocks))?;
        }
        self.fill(batch, block_size);
        Ok(())
    }

    /// The index of `batch`, whose chunks were checked (tokens in the vocabulary, block
    /// tables covering their positions).
    #[cfg(test)]
    pub(crate) fn new(batch: &[SeqChunk<'_>], block_size: usize) -> BatchIndex {
        let mut ix = BatchIndex::default();
        ix.fill(batch, block_size);
        ix
    }

    /// [`BatchIndex::new`] into this index's arrays.
    fn fill(&mut self, batch: &[SeqChunk<'_>], block_size: usize) {
        let blocks_of = |c: &SeqChunk<'_>| (c.start + c.tokens.len()).div_ceil(block_size);
        let max_blocks = batch.iter().map(blocks_of).max().unwrap_or(0).max(1);
        let ix = self;
        ix.tokens.clear();
        ix.positions.clear();
        ix.slots.clear();
        ix.query_seq.clear();
        ix.contexts.clear();
        ix.wanted.clear();
        ix.max_blocks = max_blocks;
        ix.tables.clear();
        ix.tables.resize(batch.len() * max_blocks, 0);
        for (row, chunk) in batch.iter().enumerate() {
            let used = blocks_of(chunk);
            ix.tables[row * max_blocks..row * max_blocks + used]
                .copy_from_slice(&chunk.block_table[..used]);
            for (i, &token) in chunk.tokens.iter().enumerate() {
                let pos = chunk.start + i;
                let block = i64::from(chunk.block_table[pos / block_size]);
                ix.tokens.push(token);
                ix.positions.push(pos as u32);
                ix.slots
                    .push(block * block_size as i64 + (pos % block_size) as i64);
                ix.query_seq.push(row as u32);
                ix.contexts.push(pos as u32 + 1);
            }
            if wants_logits(chunk) {
                ix.wanted.push(ix.tokens.len() - 1);
            }
        }
    }

    /// Whether every query is the only token of its sequence in this batch (a decode
    /// step), so each sees its own K and V as the last position of its context: what the
    /// fused attention's KV append needs. Queries are pushed in row order, so distinct
    /// sequences are strictly increasing ones.
    #[cfg(any(feature = "cuda", test))]
    pub(crate) fn one_token_per_sequence(&self) -> bool {
        self.query_seq.windows(2).all(|w| w[0] < w[1])
    }
}

/// Whether `chunk` gives a row of logits (its last token's): it asks, and has tokens.
pub(crate) fn wants_logits(chunk: &SeqChunk<'_>) -> bool {
    chunk.logits && !chunk.tokens.is_empty()
}

/// Refuses a chunk with tokens outside a vocabulary of `vocab`, or whose block table does
/// not cover its positions inside a cache of `blocks` blocks of `block_size` positions.
fn check_chunk(
    vocab: usize,
    chunk: &SeqChunk<'_>,
    (block_size, blocks): (usize, usize),
) -> Result<(), ModelError> {
    if let Some(&bad) = chunk.tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(ModelError::InvalidRequest {
            message: format!("token id {bad} is outside the vocabulary of {vocab}"),
        });
    }
    let end = chunk.start + chunk.tokens.len();
    let needed = end.div_ceil(block_size);
    if chunk.block_table.len() < needed || chunk.block_table.iter().any(|&b| b as usize >= blocks) {
        return Err(ModelError::InvalidRequest {
            message: format!(
                "the block table ({} blocks) does not hold positions 0..{end} in a cache of {blocks} blocks",
                chunk.block_table.len()
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefill_chunk_and_a_decode_token_index_their_own_blocks() {
        // Sequence A: positions 3..6 of blocks [7, 2] (block size 4); sequence B: one
        // decode token at position 9 of blocks [5, 0, 8].
        let a = [11, 12, 13];
        let b = [21];
        let batch = [
            SeqChunk {
                tokens: &a,
                start: 3,
                block_table: &[7, 2, 99],
                logits: true,
            },
            SeqChunk {
                tokens: &b,
                start: 9,
                block_table: &[5, 0, 8],
                logits: true,
            },
        ];
        let ix = BatchIndex::new(&batch, 4);
        assert_eq!(ix.tokens, [11, 12, 13, 21]);
        assert_eq!(ix.positions, [3, 4, 5, 9]);
        // Position 3 is offset 3 of block 7; 4 and 5 are offsets 0, 1 of block 2; 9 is
        // offset 1 of block 8.
        assert_eq!(ix.slots, [31, 8, 9, 33]);
        assert_eq!(ix.max_blocks, 3);
        // A prefill chunk is not a decode step; B alone is, and so is a chunk of one.
        assert!(!ix.one_token_per_sequence());
        assert!(BatchIndex::new(&batch[1..], 4).one_token_per_sequence());
        let one = [SeqChunk {
            tokens: &a[..1],
            ..batch[0]
        }];
        assert!(BatchIndex::new(&[one[0], batch[1]], 4).one_token_per_sequence());
        // A's table stops at the blocks its positions use (the third entry is unused).
        assert_eq!(ix.tables, [7, 2, 0, 5, 0, 8]);
        assert_eq!(ix.query_seq, [0, 0, 0, 1]);
        assert_eq!(ix.contexts, [4, 5, 6, 10]);
        assert_eq!(ix.wanted, [2, 3]);
    }

    #[test]
    fn only_chunks_that_ask_for_logits_are_wanted() {
        let a = [1, 2];
        let batch = [SeqChunk {
            tokens: &a,
            start: 0,
            block_table: &[0],
            logits: false,
        }];
        let ix = BatchIndex::new(&batch, 16);
        assert!(ix.wanted.is_empty());
        assert_eq!(ix.slots, [0, 1]);
    }
}
