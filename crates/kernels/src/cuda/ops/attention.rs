//! The choice of paged-attention kernel, and the launch of the grouped one
//! (`attention_grouped.cu`, the design of Flash-Decoding): one block per (query, KV head)
//! serving every query head of the KV head's group, split along the context only when the
//! batch's blocks do not fill the multiprocessors.
//!
//! [`AttentionKernel::Legacy`] (`attention.cu`) stays the default until the grouped
//! kernel has run on a GPU; the model reads the choice once (`TESSERA_ATTENTION`).

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::{AttentionIndex, Ops, check, grid_yz, u32_of};
use crate::attention::KvLayout;
use crate::cuda::CudaError;

/// Threads per block of the grouped kernels (`GROUPED_WARPS` warps in the `.cu` file,
/// and its `__launch_bounds__`).
pub const GROUPED_THREADS: u32 = 128;
/// The shortest partition of the grouped kernel (`GROUPED_MIN_PART`): a split into
/// shorter ones costs more (a reduce launch, the partials' bytes) than it spreads.
pub const GROUPED_MIN_PART: usize = 64;
/// The most partitions a grouped launch may have (`GROUPED_MAX_PARTITIONS`, the
/// reduce's shared weights).
pub const GROUPED_MAX_PARTITIONS: usize = 64;
/// The head sizes the grouped kernel is built for: 64 and 128 for real models, 16 and 32
/// for the test fixtures (the head's 8-value loads must divide a warp).
pub const GROUPED_HEAD_DIMS: [usize; 4] = [16, 32, 64, 128];
/// The grouped kernel's entries: a row per head size of [`GROUPED_HEAD_DIMS`], a column
/// per group of 1, 2, 4 and 8 query heads (smaller groups run in the next one up).
const GROUPED_ENTRIES: [[&str; 4]; 4] = [
    [
        "attention_grouped_d16_g1",
        "attention_grouped_d16_g2",
        "attention_grouped_d16_g4",
        "attention_grouped_d16_g8",
    ],
    [
        "attention_grouped_d32_g1",
        "attention_grouped_d32_g2",
        "attention_grouped_d32_g4",
        "attention_grouped_d32_g8",
    ],
    [
        "attention_grouped_d64_g1",
        "attention_grouped_d64_g2",
        "attention_grouped_d64_g4",
        "attention_grouped_d64_g8",
    ],
    [
        "attention_grouped_d128_g1",
        "attention_grouped_d128_g2",
        "attention_grouped_d128_g4",
        "attention_grouped_d128_g8",
    ],
];
/// The largest GQA group (query heads per KV head) the grouped kernel holds in registers.
pub const GROUPED_MAX_GROUP: usize = 8;
/// Blocks the grouped kernel aims for per multiprocessor when it splits: two, so that one
/// block's loads are in flight while the other computes.
const GROUPED_BLOCKS_PER_SM: usize = 2;

/// Which kernel runs paged attention.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttentionKernel {
    /// `attention.cu`: a block per (query head, query, 256 positions), every query head
    /// reading its KV head's cache again. The default: the grouped kernel has not run on
    /// a GPU yet.
    #[default]
    Legacy,
    /// `attention_grouped.cu`: a block per (KV head, query), 16-byte loads, online
    /// softmax; head_dim 16, 32, 64 or 128 and groups of at most 8 query heads.
    Grouped,
}

impl AttentionKernel {
    /// Every kernel, by [`AttentionKernel::name`].
    pub const ALL: [AttentionKernel; 2] = [AttentionKernel::Legacy, AttentionKernel::Grouped];

    /// The name `FromStr` takes: `legacy` or `grouped`.
    pub fn name(self) -> &'static str {
        match self {
            AttentionKernel::Legacy => "legacy",
            AttentionKernel::Grouped => "grouped",
        }
    }

    /// This kernel where it serves `layout` with `q_heads` query heads; the legacy one
    /// where the grouped kernel does not ([`grouped_entry`] says why).
    pub fn for_shape(self, layout: KvLayout, q_heads: usize) -> AttentionKernel {
        match self {
            AttentionKernel::Grouped if grouped_entry(layout, q_heads).is_err() => {
                AttentionKernel::Legacy
            }
            other => other,
        }
    }
}

impl std::fmt::Display for AttentionKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for AttentionKernel {
    type Err = CudaError;

    fn from_str(s: &str) -> Result<AttentionKernel, CudaError> {
        AttentionKernel::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| CudaError::UnknownAttention {
                name: s.to_string(),
            })
    }
}

/// The grouped kernel's entry for this shape: `attention_grouped_d{head_dim}_g{G}`, G the
/// group (q_heads / kv_heads) rounded up to 1, 2, 4 or 8; an error naming what it lacks
/// otherwise.
pub fn grouped_entry(layout: KvLayout, q_heads: usize) -> Result<&'static str, CudaError> {
    let kv_heads = layout.kv_heads;
    if kv_heads == 0 || q_heads == 0 || !q_heads.is_multiple_of(kv_heads) {
        return Err(CudaError::Unsupported {
            what: format!(
                "grouped attention over {q_heads} query heads and {kv_heads} KV heads \
                 (q_heads must be a multiple of kv_heads)"
            ),
        });
    }
    let group = q_heads / kv_heads;
    let Some(at) = GROUPED_HEAD_DIMS.iter().position(|&d| d == layout.head_dim) else {
        return Err(CudaError::Unsupported {
            what: format!(
                "grouped attention with head_dim {} (built for {GROUPED_HEAD_DIMS:?}; \
                 TESSERA_ATTENTION=legacy serves any head_dim up to 256)",
                layout.head_dim
            ),
        });
    };
    if group > GROUPED_MAX_GROUP {
        return Err(CudaError::Unsupported {
            what: format!(
                "grouped attention with {group} query heads per KV head (at most \
                 {GROUPED_MAX_GROUP}; TESSERA_ATTENTION=legacy serves any group)"
            ),
        });
    }
    Ok(GROUPED_ENTRIES[at][group.next_power_of_two().trailing_zeros() as usize])
}

/// Partitions of a grouped launch over `pairs` (query, KV head) blocks whose longest
/// context is `longest` positions, on a device with `multiprocessors` SMs: one when the
/// pairs fill the multiprocessors; else enough for [`GROUPED_BLOCKS_PER_SM`] blocks per
/// multiprocessor, but no partition under [`GROUPED_MIN_PART`] positions and at most
/// [`GROUPED_MAX_PARTITIONS`].
pub fn grouped_partitions(pairs: usize, longest: usize, multiprocessors: usize) -> usize {
    if pairs == 0 || pairs >= multiprocessors {
        return 1;
    }
    let fill = (GROUPED_BLOCKS_PER_SM * multiprocessors).div_ceil(pairs);
    fill.min(longest.div_ceil(GROUPED_MIN_PART))
        .clamp(1, GROUPED_MAX_PARTITIONS)
}

/// Positions per partition of a `context`-position query in a launch of `partitions`
/// (`grouped_part_len` in `attention_grouped.cu`, which both kernels compute): at least
/// [`GROUPED_MIN_PART`], a multiple of 16, and `context.div_ceil(len) ≤ partitions`.
pub fn grouped_part_len(context: usize, partitions: usize) -> usize {
    let even = context.div_ceil(partitions.max(1));
    GROUPED_MIN_PART.max(even.next_multiple_of(16))
}

impl Ops<'_> {
    /// The grouped kernel over `index` (made for [`AttentionKernel::Grouped`]); `q` and
    /// `out` are checked by [`Ops::paged_attention`], which calls this.
    pub(super) fn grouped_attention(
        &self,
        out: &mut CudaSlice<f32>,
        q: &CudaSlice<f32>,
        cache: (&CudaSlice<u16>, &CudaSlice<u16>),
        layout: KvLayout,
        index: &mut AttentionIndex,
    ) -> Result<(), CudaError> {
        let (k_cache, v_cache) = cache;
        let entry = grouped_entry(layout, index.q_heads)?;
        let hd = layout.head_dim;
        let queries = index.query_seq.len();
        let partitions = index.partitions;
        if partitions > 1 {
            check(
                "grouped attention scratch",
                queries * index.q_heads * partitions * hd,
                index.part_out.len(),
            )?;
            check(
                "grouped attention maxima",
                queries * index.q_heads * partitions,
                index.part_max.len(),
            )?;
            check(
                "grouped attention sums",
                index.part_max.len(),
                index.part_sum.len(),
            )?;
        }
        let dims = [
            u32_of("max_blocks", index.max_blocks)?,
            u32_of("block_size", layout.block_size)?,
            u32_of("q_heads", index.q_heads)?,
            u32_of("kv_heads", layout.kv_heads)?,
            u32_of("partitions", partitions)?,
        ];
        let scale_log2 = std::f32::consts::LOG2_E / (hd as f32).sqrt();
        let grid_y = grid_yz("attention queries (grid y)", queries)?;
        let config = LaunchConfig {
            // kv_heads × queries × partitions: x is far under its 2^31 − 1 limit (dims[3]
            // is a u32 of a head count), y and z are checked against 65,535.
            grid_dim: (
                dims[3],
                grid_y,
                grid_yz("attention partitions (grid z)", partitions)?,
            ),
            block_dim: (GROUPED_THREADS, 1, 1),
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
        let mut a = self.builder(entry)?;
        a.arg(&mut *out)
            .arg(&mut *part_out)
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
        a.arg(&scale_log2);
        self.run(entry, &mut a, config)?;
        if partitions == 1 {
            return Ok(()); // the kernel wrote every query's output
        }
        let head_dim = u32_of("head_dim", hd)?;
        let config = LaunchConfig {
            grid_dim: (dims[2], grid_y, 1),
            block_dim: (GROUPED_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut a = self.builder("attention_grouped_reduce")?;
        a.arg(out)
            .arg(&*part_out)
            .arg(&*part_max)
            .arg(&*part_sum)
            .arg(&*contexts)
            .arg(&dims[2])
            .arg(&head_dim)
            .arg(&dims[4]);
        self.run("attention_grouped_reduce", &mut a, config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(kv_heads: usize, head_dim: usize) -> KvLayout {
        KvLayout {
            block_size: 16,
            kv_heads,
            head_dim,
        }
    }

    #[test]
    fn the_entry_follows_head_dim_and_group() {
        let entry = |kv, hd, q| grouped_entry(layout(kv, hd), q);
        assert_eq!(entry(8, 64, 8).unwrap(), "attention_grouped_d64_g1");
        assert_eq!(entry(8, 64, 32).unwrap(), "attention_grouped_d64_g4");
        assert_eq!(entry(3, 64, 9).unwrap(), "attention_grouped_d64_g4");
        assert_eq!(entry(2, 64, 14).unwrap(), "attention_grouped_d64_g8");
        assert_eq!(entry(4, 128, 8).unwrap(), "attention_grouped_d128_g2");
        assert_eq!(entry(8, 128, 64).unwrap(), "attention_grouped_d128_g8");
        for (kv, hd, q) in [
            (8, 96, 32),
            (8, 256, 32),
            (1, 64, 16),
            (3, 64, 8),
            (0, 64, 8),
        ] {
            let err = entry(kv, hd, q).unwrap_err();
            assert!(matches!(err, CudaError::Unsupported { .. }), "{err}");
            assert_eq!(
                AttentionKernel::Grouped.for_shape(layout(kv, hd), q),
                AttentionKernel::Legacy
            );
        }
        assert!(entry(8, 96, 32).unwrap_err().to_string().contains("96"));
        assert_eq!(
            AttentionKernel::Grouped.for_shape(layout(8, 64), 32),
            AttentionKernel::Grouped
        );
        // Every entry it can name is a kernel of the family.
        let family = crate::cuda::source::family_of("attention_grouped_reduce").unwrap();
        for hd in GROUPED_HEAD_DIMS {
            for group in 1..=GROUPED_MAX_GROUP {
                let e = entry(2, hd, 2 * group).unwrap();
                assert!(family.entries.contains(&e), "{e}");
            }
        }
    }

    #[test]
    fn names_parse_back_and_legacy_is_the_default() {
        for kernel in AttentionKernel::ALL {
            assert_eq!(kernel.name().parse::<AttentionKernel>().unwrap(), kernel);
        }
        assert_eq!(AttentionKernel::default(), AttentionKernel::Legacy);
        let err = "flash".parse::<AttentionKernel>().unwrap_err().to_string();
        assert!(err.contains("flash") && err.contains("legacy"), "{err}");
    }

    #[test]
    fn a_batch_that_fills_the_multiprocessors_is_not_split() {
        // An H200 has 132 multiprocessors.
        assert_eq!(grouped_partitions(132, 100_000, 132), 1);
        assert_eq!(grouped_partitions(64 * 8, 4096, 132), 1);
        // Batch 1 of a Llama-3.2-1B shape (8 KV heads): 33 partitions at most, fewer where
        // the context is short.
        assert_eq!(grouped_partitions(8, 4096, 132), 33);
        assert_eq!(grouped_partitions(8, 256, 132), 4);
        assert_eq!(grouped_partitions(8, 1, 132), 1);
        assert_eq!(grouped_partitions(1, 1 << 20, 132), GROUPED_MAX_PARTITIONS);
        assert_eq!(grouped_partitions(0, 10, 132), 1);
    }

    #[test]
    fn partitions_cover_every_context_within_the_launch() {
        for partitions in 1..=GROUPED_MAX_PARTITIONS {
            for context in (1..=3000).chain([4095, 4096, 4097, 8191, 8192, 100_000]) {
                let len = grouped_part_len(context, partitions);
                let used = context.div_ceil(len);
                assert!(len >= GROUPED_MIN_PART && len.is_multiple_of(16));
                assert!(
                    (1..=partitions).contains(&used),
                    "{context} over {partitions}: {used} of {len}"
                );
                // No partition launched for this query is left with nothing but the last.
                assert!((used - 1) * len < context);
            }
            assert_eq!(grouped_part_len(1, partitions), GROUPED_MIN_PART);
        }
        // One partition holds the whole context.
        assert_eq!(grouped_part_len(1000, 1), 1008);
    }
}
