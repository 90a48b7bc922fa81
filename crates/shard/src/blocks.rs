//! The shard's KV block allocator: a pure core (no I/O, no model) over block ids.
//!
//! Every block is in exactly one of three states:
//! - **referenced**: held by one or more sequences (`refs > 0`);
//! - **free**: unreferenced and holding nothing reusable;
//! - **cached**: unreferenced, but a full block whose K/V is registered in the prefix cache
//!   under the hash of its token chain. It is reused by the next sequence whose prompt
//!   starts with the same tokens, or evicted (least recently released first) when no free
//!   block is left.
//!
//! A full block is registered under `chain_hash(parent, tokens)`, where `parent` is the
//! hash of the block before it (0 for the first), so one hash names the whole prefix up to
//! the block's end (vLLM's automatic prefix caching). A lookup also compares the stored
//! parent hash and tokens, so a 64-bit collision cannot hand out another prompt's K/V.
//! Shared blocks are always full and never written again; a sequence appends into blocks
//! of its own, so no copy-on-write is needed.
//!
//! Ranks of a group apply the same plans in the same order, so their allocators make the
//! same decisions and stay in step.

use std::collections::{BTreeSet, HashMap};
use std::hash::{DefaultHasher, Hash, Hasher};

use bytemuck::{Pod, Zeroable};

/// A block's index in the KV pools. `repr(transparent)`, so that a block table is the
/// `[u32]` the model and its kernels read ([`BlockId::as_u32s`]) without a copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Pod, Zeroable)]
#[repr(transparent)]
pub struct BlockId(pub u32);

impl std::fmt::Display for BlockId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl BlockId {
    fn index(self) -> usize {
        self.0 as usize
    }

    /// A block table as the forward pass takes it.
    pub fn as_u32s(table: &[BlockId]) -> &[u32] {
        bytemuck::cast_slice(table)
    }
}

/// The hash of a token chain up to the end of a full block.
pub type ChainHash = u64;

/// What the prefix cache knows of one registered block.
#[derive(Debug, Clone)]
struct Entry {
    hash: ChainHash,
    parent: ChainHash,
    tokens: Box<[u32]>,
}

#[derive(Debug)]
pub struct BlockAllocator {
    block_size: usize,
    refs: Vec<u32>,
    /// Registered blocks: their cache entry.
    entries: Vec<Option<Entry>>,
    /// When each cached block was last released (its LRU key).
    released_at: Vec<u64>,
    free: Vec<BlockId>,
    /// Cached blocks with no reference, oldest release first.
    evictable: BTreeSet<(u64, BlockId)>,
    by_hash: HashMap<ChainHash, BlockId>,
    clock: u64,
}

/// The hash of `tokens` (one full block) following the chain `parent`.
pub fn chain_hash(parent: ChainHash, tokens: &[u32]) -> ChainHash {
    // SipHash with fixed keys: the same value in every process of the same build.
    let mut h = DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

impl BlockAllocator {
    pub fn new(num_blocks: usize, block_size: usize) -> BlockAllocator {
        BlockAllocator {
            block_size: block_size.max(1),
            refs: vec![0; num_blocks],
            entries: vec![None; num_blocks],
            released_at: vec![0; num_blocks],
            free: (0..num_blocks as u32).rev().map(BlockId).collect(),
            evictable: BTreeSet::new(),
            by_hash: HashMap::new(),
            clock: 0,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.refs.len()
    }

    /// Blocks that [`BlockAllocator::allocate`] can still hand out (free or evictable).
    pub fn available(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Blocks registered in the prefix cache (referenced or not).
    pub fn cached(&self) -> usize {
        self.by_hash.len()
    }

    /// A block for one sequence: a free one, else the least recently released cached one
    /// (which leaves the prefix cache). `None` when every block is referenced.
    pub fn allocate(&mut self) -> Option<BlockId> {
        let block = match self.free.pop() {
            Some(b) => b,
            None => {
                let (_, b) = self.evictable.pop_first()?;
                self.unregister(b);
                b
            }
        };
        self.refs[block.index()] = 1;
        Some(block)
    }

    /// Takes a reference on the longest run of cached blocks that holds a prefix of
    /// `tokens` (whole blocks only), and returns them with their chain hashes.
    pub fn acquire_prefix(&mut self, tokens: &[u32]) -> (Vec<BlockId>, Vec<ChainHash>) {
        let mut blocks = Vec::new();
        let mut hashes = Vec::new();
        let mut parent = 0;
        for chunk in tokens.chunks_exact(self.block_size) {
            let hash = chain_hash(parent, chunk);
            let Some(&b) = self.by_hash.get(&hash) else {
                break;
            };
            let matches = self.entries[b.index()]
                .as_ref()
                .is_some_and(|e| e.parent == parent && *e.tokens == *chunk);
            if !matches {
                break;
            }
            self.take_ref(b);
            blocks.push(b);
            hashes.push(hash);
            parent = hash;
        }
        (blocks, hashes)
    }

    /// Registers the full, referenced `block` (holding `tokens` after the chain `parent`)
    /// in the prefix cache and returns its chain hash. When another block already holds
    /// the same chain, this one stays unregistered (and is freed normally).
    pub fn register(&mut self, block: BlockId, parent: ChainHash, tokens: &[u32]) -> ChainHash {
        let hash = chain_hash(parent, tokens);
        let b = block.index();
        debug_assert!(self.refs[b] > 0 && tokens.len() == self.block_size);
        if self.entries[b].is_none() && !self.by_hash.contains_key(&hash) {
            self.by_hash.insert(hash, block);
            self.entries[b] = Some(Entry {
                hash,
                parent,
                tokens: tokens.into(),
            });
        }
        hash
    }

    /// Drops one reference on each of `blocks`; a block nobody holds becomes evictable
    /// (registered) or free.
    pub fn release(&mut self, blocks: &[BlockId]) {
        for &block in blocks {
            let b = block.index();
            debug_assert!(self.refs[b] > 0, "block {block} released twice");
            self.refs[b] = self.refs[b].saturating_sub(1);
            if self.refs[b] > 0 {
                continue;
            }
            if self.entries[b].is_some() {
                self.clock += 1;
                self.released_at[b] = self.clock;
                self.evictable.insert((self.clock, block));
            } else {
                self.free.push(block);
            }
        }
    }

    fn take_ref(&mut self, block: BlockId) {
        let b = block.index();
        if self.refs[b] == 0 {
            self.evictable.remove(&(self.released_at[b], block));
        }
        self.refs[b] += 1;
    }

    fn unregister(&mut self, block: BlockId) {
        if let Some(entry) = self.entries[block.index()].take() {
            self.by_hash.remove(&entry.hash);
        }
    }

    /// Checks every invariant against the block tables of the sequences that exist:
    /// each block's reference count equals its number of owners; every unreferenced
    /// block is free or evictable, exactly once; the hash index and the entries agree.
    pub fn audit<'a>(&self, tables: impl IntoIterator<Item = &'a [BlockId]>) -> Result<(), String> {
        let n = self.num_blocks();
        let mut owners = vec![0u32; n];
        for table in tables {
            for &b in table {
                *owners
                    .get_mut(b.index())
                    .ok_or(format!("block {b} out of range"))? += 1;
            }
        }
        let mut place = vec![0u8; n];
        for &b in &self.free {
            place[b.index()] += 1;
            if self.entries[b.index()].is_some() {
                return Err(format!("free block {b} is registered"));
            }
        }
        for &(at, b) in &self.evictable {
            place[b.index()] += 1;
            if self.entries[b.index()].is_none() || self.released_at[b.index()] != at {
                return Err(format!("evictable block {b} is not registered at {at}"));
            }
        }
        for b in 0..n {
            let (refs, placed) = (self.refs[b], place[b]);
            if refs != owners[b] {
                return Err(format!("block {b}: {refs} refs, {} owners", owners[b]));
            }
            if (refs == 0 && placed != 1) || (refs > 0 && placed != 0) {
                return Err(format!("block {b}: {refs} refs, on {placed} lists"));
            }
        }
        for (&hash, &b) in &self.by_hash {
            match &self.entries[b.index()] {
                Some(e) if e.hash == hash => {}
                _ => {
                    return Err(format!(
                        "hash {hash:x} points at block {b}, which disagrees"
                    ));
                }
            }
        }
        let registered = self.entries.iter().filter(|e| e.is_some()).count();
        if registered != self.by_hash.len() {
            return Err(format!(
                "{registered} registered blocks, {} hashes",
                self.by_hash.len()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// A sequence as the engine keeps it: tokens, blocks, chain hashes of its full blocks.
    struct Seq {
        tokens: Vec<u32>,
        table: Vec<BlockId>,
        hashes: Vec<ChainHash>,
    }

    impl Seq {
        /// Appends `tokens`, allocating blocks; registers every block that became full.
        fn extend(&mut self, a: &mut BlockAllocator, tokens: &[u32]) -> bool {
            let bs = a.block_size();
            let len = self.tokens.len() + tokens.len();
            while self.table.len() < len.div_ceil(bs) {
                match a.allocate() {
                    Some(b) => self.table.push(b),
                    None => return false,
                }
            }
            self.tokens.extend_from_slice(tokens);
            while self.hashes.len() < self.tokens.len() / bs {
                let i = self.hashes.len();
                let parent = self.hashes.last().copied().unwrap_or(0);
                let h = a.register(self.table[i], parent, &self.tokens[i * bs..(i + 1) * bs]);
                self.hashes.push(h);
            }
            true
        }
    }

    fn admit(a: &mut BlockAllocator, prompt: &[u32]) -> Option<Seq> {
        let (table, hashes) = a.acquire_prefix(prompt);
        let cached = table.len() * a.block_size();
        let mut seq = Seq {
            tokens: prompt[..cached].to_vec(),
            table,
            hashes,
        };
        if seq.extend(a, &prompt[cached..]) {
            Some(seq)
        } else {
            a.release(&seq.table);
            None
        }
    }

    #[test]
    fn a_repeated_prompt_reuses_its_full_blocks() {
        let mut a = BlockAllocator::new(8, 4);
        let prompt: Vec<u32> = (0..10).collect();
        let first = admit(&mut a, &prompt).unwrap();
        assert_eq!(first.table.len(), 3);
        let second = admit(&mut a, &prompt).unwrap();
        // Two full blocks shared, the partial third one is the second sequence's own.
        assert_eq!(second.table[..2], first.table[..2]);
        assert_ne!(second.table[2], first.table[2]);
        assert_eq!(a.available(), 8 - 4);
        a.release(&first.table);
        a.release(&second.table);
        a.audit([]).unwrap();
        // After release the prefix stays cached until the blocks are needed.
        assert_eq!(a.cached(), 2);
        let third = admit(&mut a, &prompt).unwrap();
        assert_eq!(third.table[..2], first.table[..2]);
        a.audit([third.table.as_slice()]).unwrap();
    }

    #[test]
    fn a_different_prefix_does_not_match_and_eviction_is_least_recent_first() {
        let mut a = BlockAllocator::new(4, 2);
        let x = admit(&mut a, &[1, 2, 3, 4]).unwrap();
        let y = admit(&mut a, &[5, 6, 7, 8]).unwrap();
        a.release(&x.table);
        a.release(&y.table);
        assert_eq!(a.available(), 4);
        // Same second block tokens after another first block: no match.
        let (blocks, _) = a.acquire_prefix(&[9, 9, 3, 4]);
        assert!(blocks.is_empty());
        // Taking all four blocks evicts x's (released first) before y's.
        let taken: Vec<BlockId> = (0..2).map(|_| a.allocate().unwrap()).collect();
        assert_eq!(taken, x.table);
        assert_eq!(a.acquire_prefix(&[5, 6, 7, 8]).0, y.table);
        assert!(a.acquire_prefix(&[1, 2]).0.is_empty());
    }

    #[test]
    fn random_operations_never_leak_or_double_own_a_block() {
        for seed in 0..40 {
            let mut rng = StdRng::seed_from_u64(seed);
            let bs = rng.random_range(1..6);
            let mut a = BlockAllocator::new(rng.random_range(1..40), bs);
            let mut seqs: Vec<Seq> = Vec::new();
            // A few shared prompt stems make prefix hits common.
            let stems: Vec<Vec<u32>> = (0..3)
                .map(|_| {
                    (0..rng.random_range(0..20))
                        .map(|_| rng.random_range(0..4))
                        .collect()
                })
                .collect();
            for _ in 0..500 {
                match rng.random_range(0..10) {
                    0..=3 => {
                        let mut prompt = stems[rng.random_range(0..3)].clone();
                        prompt.extend((0..rng.random_range(1..12)).map(|_| rng.random_range(0..4)));
                        if let Some(seq) = admit(&mut a, &prompt) {
                            seqs.push(seq);
                        }
                    }
                    4..=7 if !seqs.is_empty() => {
                        let i = rng.random_range(0..seqs.len());
                        let token = rng.random_range(0..4);
                        if !seqs[i].extend(&mut a, &[token]) {
                            let seq = seqs.swap_remove(i);
                            a.release(&seq.table);
                        }
                    }
                    _ if !seqs.is_empty() => {
                        let seq = seqs.swap_remove(rng.random_range(0..seqs.len()));
                        a.release(&seq.table);
                    }
                    _ => {}
                }
                a.audit(seqs.iter().map(|s| s.table.as_slice()))
                    .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
                // A sequence's cached blocks hold exactly its tokens.
                for s in &seqs {
                    for (i, &b) in s.table.iter().enumerate().take(s.hashes.len()) {
                        if let Some(e) = &a.entries[b.index()] {
                            assert_eq!(*e.tokens, s.tokens[i * bs..(i + 1) * bs]);
                        }
                    }
                }
            }
            for seq in seqs.drain(..) {
                a.release(&seq.table);
            }
            a.audit([]).unwrap();
            assert_eq!(a.available(), a.num_blocks(), "seed {seed}: blocks leaked");
        }
    }
}
