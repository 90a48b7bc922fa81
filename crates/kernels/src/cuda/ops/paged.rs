//! The paged KV cache's launches: the KV write and paged attention, with the device-side
//! index arrays (slots, block tables, contexts) they read, each checked against the cache
//! when it is made or refilled. Attention runs the kernel its index was made for
//! ([`AttentionKernel`]: the legacy one here, the grouped one in `attention.rs`, the
//! prefill one in `flash.rs`).

use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};

use super::attention::{GROUPED_MAX_PARTITIONS, grouped_entry, grouped_partitions};
use super::{
    ATTENTION_PART, ATTENTION_THREADS, AttentionKernel, MAX_HEAD_DIM, Ops, ROW_THREADS, check,
    grid_yz, rows, u32_of,
};
use crate::attention::{KvLayout, flash_tiles};
use crate::cuda::{CudaError, Held};

/// Cache slots of a batch's tokens on the device, checked against the cache they index.
#[derive(Debug)]
pub struct Slots {
    pub(super) slots: CudaSlice<i64>,
    pub(super) capacity: usize,
}

/// What an [`AttentionIndex`] is made for: the cache it reads, the query heads, the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionTarget {
    pub layout: KvLayout,
    /// Blocks in the cache (every block id is checked below it).
    pub cache_blocks: usize,
    pub q_heads: usize,
    pub kernel: AttentionKernel,
    /// The grouped kernel's partitions: `None` decides them from the device's
    /// multiprocessors and the longest context (what the model does); `Some(n)` makes n
    /// (tests of the split). The legacy kernel splits every 256 positions and the flash
    /// kernel never: both take `None`.
    pub partitions: Option<usize>,
}

/// One batch's attention queries on the device (see [`Ops::attention_index`]).
#[derive(Debug)]
pub struct AttentionIndex {
    pub(super) tables: CudaSlice<u32>,
    pub(super) query_seq: CudaSlice<u32>,
    pub(super) contexts: CudaSlice<u32>,
    pub(super) max_blocks: usize,
    pub(super) cache_blocks: usize,
    pub(super) q_heads: usize,
    pub(super) kernel: AttentionKernel,
    /// Blocks along the context per query (the grid's z).
    pub(super) partitions: usize,
    /// The sliding window of the next attention over the index (0: the whole context).
    pub(super) window: u32,
    pub(super) part_out: CudaSlice<f32>,
    pub(super) part_max: CudaSlice<f32>,
    pub(super) part_sum: CudaSlice<f32>,
    /// The flash kernel's query tiles (`[first, count]` pairs, [`flash_tiles`]); `None`
    /// for the other kernels.
    pub(super) tiles: Option<CudaSlice<u32>>,
}

impl AttentionIndex {
    /// The kernel [`Ops::paged_attention`] runs over this index.
    pub fn kernel(&self) -> AttentionKernel {
        self.kernel
    }

    /// Blocks along the context per query (1: not split).
    pub fn partitions(&self) -> usize {
        self.partitions
    }

    /// Makes the attentions over this index slide a window of the last `window` positions
    /// of each query's context, its own included (`None`: the whole context), as the layer
    /// they serve does; the CPU twin is [`crate::attention::AttentionParams::window`]. Set
    /// it before each layer's attention: a captured graph keeps each launch's window.
    pub fn set_window(&mut self, window: Option<usize>) -> Result<(), CudaError> {
        self.window = match window {
            None => 0,
            Some(0) => {
                return Err(CudaError::Shape {
                    what: "attention sliding window (at least 1 position)",
                    expected: 1,
                    actual: 0,
                });
            }
            Some(w) => u32_of("attention sliding window", w)?,
        };
        Ok(())
    }

    /// The caches' lengths against this index: each of its `cache_blocks` blocks of
    /// `layout`.
    pub(super) fn check_caches(
        &self,
        layout: KvLayout,
        k_cache: usize,
        v_cache: usize,
    ) -> Result<(), CudaError> {
        check(
            "attention k cache",
            self.cache_blocks * layout.block_len(),
            k_cache,
        )?;
        check("attention v cache", k_cache, v_cache)
    }
}

impl Ops<'_> {
    /// Cache slots on the device, each checked below `capacity` slots (blocks × block
    /// size): slot = block × block_size + offset; negative: skipped by [`Ops::kv_write`].
    pub fn slots(&self, host: &[i64], capacity: usize) -> Result<Slots, CudaError> {
        if let Some(&bad) = host.iter().find(|&&s| s >= capacity as i64) {
            return Err(CudaError::Shape {
                what: "kv_write slot (below the cache's slots)",
                expected: capacity,
                actual: bad as usize,
            });
        }
        Ok(Slots {
            slots: self.upload(host)?,
            capacity,
        })
    }

    /// Writes token t's K and V (`kv_width` values each) into cache slot `slots[t]`, as
    /// bf16 or f32 (the cache's type).
    pub fn kv_write<T: Held>(
        &self,
        k_cache: &mut CudaSlice<T>,
        v_cache: &mut CudaSlice<T>,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        slots: &Slots,
        kv_width: usize,
    ) -> Result<(), CudaError> {
        let tokens = slots.slots.len();
        check("kv_write k", tokens * kv_width, k.len())?;
        check("kv_write v", tokens * kv_width, v.len())?;
        check("kv_write k cache", slots.capacity * kv_width, k_cache.len())?;
        check("kv_write v cache", k_cache.len(), v_cache.len())?;
        let w = u32_of("kv_width", kv_width)?;
        let config = rows(tokens, ROW_THREADS)?;
        let entry = T::entry("kv_write_bf16", "kv_write_f32");
        let mut a = self.builder(entry)?;
        a.arg(k_cache)
            .arg(v_cache)
            .arg(k)
            .arg(v)
            .arg(&slots.slots)
            .arg(&w);
        self.run(entry, &mut a, config)
    }

    /// The block tables and contexts of one batch of attention queries, on the device,
    /// with the partition scratch of `target`'s kernel: query i reads the blocks of
    /// sequence `query_seq[i]` (a row of `tables`, each row `max_blocks` long) up to
    /// position `contexts[i]` (exclusive). Every id is checked below the cache's blocks; a
    /// shape the kernel does not serve is refused here.
    pub fn attention_index(
        &self,
        tables: &[u32],
        max_blocks: usize,
        query_seq: &[u32],
        contexts: &[u32],
        target: AttentionTarget,
    ) -> Result<AttentionIndex, CudaError> {
        let AttentionTarget {
            layout,
            cache_blocks,
            q_heads,
            kernel,
            ..
        } = target;
        let queries = query_seq.len();
        check("attention contexts", queries, contexts.len())?;
        if max_blocks == 0 || !tables.len().is_multiple_of(max_blocks) {
            return Err(CudaError::Shape {
                what: "attention tables (a multiple of max_blocks)",
                expected: max_blocks,
                actual: tables.len(),
            });
        }
        if let Some(&bad) = tables.iter().find(|&&b| b as usize >= cache_blocks) {
            return Err(CudaError::Shape {
                what: "attention block id (below the cache's blocks)",
                expected: cache_blocks,
                actual: bad as usize,
            });
        }
        let seqs = tables.len() / max_blocks;
        if let Some(&bad) = query_seq.iter().find(|&&s| s as usize >= seqs) {
            return Err(CudaError::Shape {
                what: "attention query_seq (below the tables' rows)",
                expected: seqs,
                actual: bad as usize,
            });
        }
        let reach = max_blocks * layout.block_size;
        let longest = contexts.iter().copied().max().unwrap_or(0) as usize;
        if longest > reach || contexts.contains(&0) {
            return Err(CudaError::Shape {
                what: "attention context (1 ..= max_blocks × block_size)",
                expected: reach,
                actual: longest,
            });
        }
        let partitions = self.partitions(target, queries, longest)?;
        // The grouped kernel unsplit writes the output directly: no scratch is read.
        let parts = match (kernel, partitions) {
            (AttentionKernel::Grouped | AttentionKernel::Flash, 1) => 1,
            _ => queries * q_heads * partitions,
        };
        let tiles = match kernel {
            AttentionKernel::Flash => {
                let pairs: Vec<u32> = flash_tiles(query_seq).into_iter().flatten().collect();
                Some(self.upload(&pairs)?)
            }
            _ => None,
        };
        Ok(AttentionIndex {
            tables: self.upload(tables)?,
            query_seq: self.upload(query_seq)?,
            contexts: self.upload(contexts)?,
            max_blocks,
            cache_blocks,
            q_heads,
            kernel,
            partitions,
            window: 0,
            part_out: self.alloc(parts * layout.head_dim)?,
            part_max: self.alloc(parts)?,
            part_sum: self.alloc(parts)?,
            tiles,
        })
    }

    /// The partitions of an index for `target` over `queries` queries, the longest
    /// `longest` positions; the grouped kernel's shape is checked here.
    fn partitions(
        &self,
        target: AttentionTarget,
        queries: usize,
        longest: usize,
    ) -> Result<usize, CudaError> {
        match (target.kernel, target.partitions) {
            (AttentionKernel::Legacy, None) => Ok(longest.div_ceil(ATTENTION_PART).max(1)),
            (AttentionKernel::Legacy | AttentionKernel::Flash, Some(_)) => {
                Err(CudaError::Unsupported {
                    what: format!(
                        "a chosen partition count with the {} attention kernel (the legacy \
                         one splits every 256 positions, the flash one never)",
                        target.kernel
                    ),
                })
            }
            (AttentionKernel::Flash, None) => {
                super::flash::flash_entry(target.layout, target.q_heads)?;
                Ok(1)
            }
            (AttentionKernel::Grouped, chosen) => {
                grouped_entry(target.layout, target.q_heads)?;
                let pairs = queries * target.layout.kv_heads;
                let partitions = chosen.unwrap_or_else(|| {
                    grouped_partitions(pairs, longest, self.device.multiprocessors())
                });
                if !(1..=GROUPED_MAX_PARTITIONS).contains(&partitions) {
                    return Err(CudaError::Shape {
                        what: "grouped attention partitions (1 ..= 64)",
                        expected: GROUPED_MAX_PARTITIONS,
                        actual: partitions,
                    });
                }
                Ok(partitions)
            }
        }
    }

    /// Refills `slots` (the same count) for another pass of a captured graph.
    pub fn update_slots(&self, slots: &mut Slots, host: &[i64]) -> Result<(), CudaError> {
        check("updated slots", slots.slots.len(), host.len())?;
        if let Some(&bad) = host.iter().find(|&&s| s >= slots.capacity as i64) {
            return Err(CudaError::Shape {
                what: "kv_write slot (below the cache's slots)",
                expected: slots.capacity,
                actual: bad as usize,
            });
        }
        self.copy_to_device(host, &mut slots.slots)
    }

    /// Refills the block tables and contexts of `index` (the same queries, one table row
    /// each, `query_seq` unchanged) for another pass of a captured graph. Contexts must fit
    /// the partitions the index was made with.
    pub fn update_attention_index(
        &self,
        index: &mut AttentionIndex,
        tables: &[u32],
        contexts: &[u32],
        block_size: usize,
    ) -> Result<(), CudaError> {
        check("updated tables", index.tables.len(), tables.len())?;
        check("updated contexts", index.contexts.len(), contexts.len())?;
        if let Some(&bad) = tables.iter().find(|&&b| b as usize >= index.cache_blocks) {
            return Err(CudaError::Shape {
                what: "attention block id (below the cache's blocks)",
                expected: index.cache_blocks,
                actual: bad as usize,
            });
        }
        // The grouped kernel fits its partitions to each context, and the flash kernel
        // has none; the legacy one's are 256 positions each.
        let reach = match index.kernel {
            AttentionKernel::Legacy => {
                (index.max_blocks * block_size).min(index.partitions * ATTENTION_PART)
            }
            AttentionKernel::Grouped | AttentionKernel::Flash => index.max_blocks * block_size,
        };
        let longest = contexts.iter().copied().max().unwrap_or(0) as usize;
        if longest > reach || contexts.contains(&0) {
            return Err(CudaError::Shape {
                what: "attention context (1 ..= the index's reach)",
                expected: reach,
                actual: longest,
            });
        }
        self.copy_to_device(tables, &mut index.tables)?;
        self.copy_to_device(contexts, &mut index.contexts)
    }

    /// Paged attention of the index's queries (`q`: queries × q_heads × head_dim) by the
    /// kernel the index was made for. `out` has q's shape.
    pub fn paged_attention<T: Held>(
        &self,
        out: &mut CudaSlice<f32>,
        q: &CudaSlice<f32>,
        cache: (&CudaSlice<T>, &CudaSlice<T>),
        layout: KvLayout,
        index: &mut AttentionIndex,
    ) -> Result<(), CudaError> {
        self.paged_attention_with_bf16(out, None, q, cache, layout, index)
    }

    /// [`Ops::paged_attention`], writing the output rounded to bf16 into `out16` as well
    /// (the o projection's GEMM input) when given: the grouped and flash kernels, so that
    /// no `round_bf16` launch follows them; the legacy kernel refuses it. An f32 cache
    /// (the exact path) is read by the legacy kernel only.
    pub fn paged_attention_with_bf16<T: Held>(
        &self,
        out: &mut CudaSlice<f32>,
        out16: Option<&mut CudaSlice<u16>>,
        q: &CudaSlice<f32>,
        cache: (&CudaSlice<T>, &CudaSlice<T>),
        layout: KvLayout,
        index: &mut AttentionIndex,
    ) -> Result<(), CudaError> {
        let (k_cache, v_cache) = cache;
        let queries = index.query_seq.len();
        check(
            "attention q",
            queries * index.q_heads * layout.head_dim,
            q.len(),
        )?;
        check("attention out", q.len(), out.len())?;
        if let Some(out16) = &out16 {
            check("attention bf16 out", q.len(), out16.len())?;
        }
        index.check_caches(layout, k_cache.len(), v_cache.len())?;
        if T::F32 && index.kernel != AttentionKernel::Legacy {
            return Err(CudaError::Unsupported {
                what: format!(
                    "an f32 KV cache with the {} attention kernel (only the legacy one \
                     reads f32)",
                    index.kernel
                ),
            });
        }
        match (index.kernel, out16) {
            (AttentionKernel::Legacy, None) => self.legacy_attention(out, q, cache, layout, index),
            (AttentionKernel::Legacy, Some(_)) => Err(CudaError::Unsupported {
                what: "a bf16 output from the legacy attention kernel (round it with \
                       round_bf16)"
                    .into(),
            }),
            (AttentionKernel::Grouped, out16) => {
                let (k, _k) = k_cache.device_ptr(&self.stream);
                let (v, _v) = v_cache.device_ptr(&self.stream);
                let query = super::attention::GroupedQuery::Rotated(q);
                self.grouped_attention(out, out16, query, (k, v), layout, index)
            }
            (AttentionKernel::Flash, out16) => {
                let (k, _k) = k_cache.device_ptr(&self.stream);
                let (v, _v) = v_cache.device_ptr(&self.stream);
                self.flash_attention(out, out16, q, (k, v), layout, index)
            }
        }
    }

    /// `attention.cu`: partitions of [`ATTENTION_PART`] positions, merged.
    fn legacy_attention<T: Held>(
        &self,
        out: &mut CudaSlice<f32>,
        q: &CudaSlice<f32>,
        cache: (&CudaSlice<T>, &CudaSlice<T>),
        layout: KvLayout,
        index: &mut AttentionIndex,
    ) -> Result<(), CudaError> {
        let (k_cache, v_cache) = cache;
        let hd = layout.head_dim;
        let q_heads = index.q_heads;
        let queries = index.query_seq.len();
        check(
            "attention scratch",
            queries * q_heads * index.partitions * hd,
            index.part_out.len(),
        )?;
        if hd > MAX_HEAD_DIM || layout.kv_heads == 0 || !q_heads.is_multiple_of(layout.kv_heads) {
            return Err(CudaError::Shape {
                what: "attention head_dim (at most 256) and heads (a multiple of kv heads)",
                expected: MAX_HEAD_DIM,
                actual: hd,
            });
        }
        let dims = [
            u32_of("max_blocks", index.max_blocks)?,
            u32_of("block_size", layout.block_size)?,
            u32_of("q_heads", q_heads)?,
            u32_of("kv_heads", layout.kv_heads)?,
            u32_of("head_dim", hd)?,
            u32_of("partitions", index.partitions)?,
            index.window,
        ];
        let scale = 1.0 / (hd as f32).sqrt();
        let grid = (
            dims[2],
            grid_yz("attention queries (grid y)", queries)?,
            grid_yz("attention partitions (grid z)", index.partitions)?,
        );
        let config = LaunchConfig {
            grid_dim: grid,
            block_dim: (ATTENTION_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let AttentionIndex {
            tables,
            query_seq,
            contexts,
            part_out,
            part_max,
            part_sum,
            ..
        } = index;
        let entry = T::entry("paged_attention_partition", "paged_attention_partition_f32");
        let mut a = self.builder(entry)?;
        a.arg(&mut *part_out)
            .arg(&mut *part_max)
            .arg(&mut *part_sum)
            .arg(q)
            .arg(k_cache)
            .arg(v_cache)
            .arg(&*tables)
            .arg(&*query_seq)
            .arg(&*contexts);
        for d in &dims {
            a.arg(d);
        }
        a.arg(&scale);
        self.run(entry, &mut a, config)?;
        let config = LaunchConfig {
            grid_dim: (grid.0, grid.1, 1),
            block_dim: (ATTENTION_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut a = self.builder("paged_attention_reduce")?;
        a.arg(out)
            .arg(&*part_out)
            .arg(&*part_max)
            .arg(&*part_sum)
            .arg(&*contexts)
            .arg(&dims[2])
            .arg(&dims[4])
            .arg(&dims[5])
            .arg(&dims[6]);
        self.run("paged_attention_reduce", &mut a, config)
    }
}
