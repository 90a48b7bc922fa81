//! The choice of paged-attention kernel, and the launch of the grouped one
//! (`attention_grouped.cu`, the design of Flash-Decoding): one block per (query, KV head)
//! serving every query head of the KV head's group, split along the context only when the
//! batch's blocks do not fill the multiprocessors.
//!
//! [`AttentionKernel::Legacy`] (`attention.cu`) stays the default until the grouped
//! kernel has run on a GPU; the model reads the choice once (`TESSERA_ATTENTION`).

use cudarc::driver::{CudaSlice, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::{AttentionIndex, Ops, RopeKv, Slots, check, grid_yz, u32_of};
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

/// What a decode step's attention appends to the cache itself
/// ([`Ops::paged_attention_append`]): each query's row of the stacked q|k|v projection,
/// its bias, the rotation and the queries' cache slots.
#[derive(Clone, Copy, Debug)]
pub struct Append<'a> {
    pub qkv: &'a CudaSlice<f32>,
    pub bias: Option<&'a CudaSlice<f32>>,
    pub rope: RopeKv<'a>,
    pub slots: &'a Slots,
}

/// Where the grouped kernel's queries come from.
pub(super) enum GroupedQuery<'a> {
    /// Rotated already (`queries × q_heads × head_dim`).
    Rotated(&'a CudaSlice<f32>),
    /// Rotated by the kernel itself, which appends K and V too.
    Append(Append<'a>),
}

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
    /// `attention_flash.cu` ([`super::flash`]): a block per (query head, tile of up to 64
    /// queries of one sequence), Q·Kᵀ and P·V on the tensor cores; head_dim 16, 32, 64 or
    /// 128. For prefill: the model runs the grouped kernel (where it serves) for decode
    /// steps.
    Flash,
}

impl AttentionKernel {
    /// Every kernel, by [`AttentionKernel::name`].
    pub const ALL: [AttentionKernel; 3] = [
        AttentionKernel::Legacy,
        AttentionKernel::Grouped,
        AttentionKernel::Flash,
    ];

    /// The name `FromStr` takes: `legacy`, `grouped` or `flash`.
    pub fn name(self) -> &'static str {
        match self {
            AttentionKernel::Legacy => "legacy",
            AttentionKernel::Grouped => "grouped",
            AttentionKernel::Flash => "flash",
        }
    }

    /// This kernel where it serves `layout` with `q_heads` query heads; else the grouped
    /// one where that serves, else the legacy one ([`grouped_entry`] and
    /// [`super::flash::flash_entry`] say why).
    pub fn for_shape(self, layout: KvLayout, q_heads: usize) -> AttentionKernel {
        match self {
            AttentionKernel::Flash if super::flash::flash_entry(layout, q_heads).is_err() => {
                AttentionKernel::Grouped.for_shape(layout, q_heads)
            }
            AttentionKernel::Grouped if grouped_entry(layout, q_heads).is_err() => {
                AttentionKernel::Legacy
            }
            other => other,
        }
    }

    /// The kernel of a decode step's attention where this one is chosen: the flash kernel
    /// is for prefill (a decode query would fill one of its 64 rows), so decode steps run
    /// the grouped kernel, where it serves the shape.
    pub fn for_decode(self, layout: KvLayout, q_heads: usize) -> AttentionKernel {
        match self {
            AttentionKernel::Flash => AttentionKernel::Grouped.for_shape(layout, q_heads),
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
/// pairs fill the multiprocessors; else enough for `GROUPED_BLOCKS_PER_SM` blocks per
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
    /// A decode step's paged attention with the work of [`Ops::rope_kv_write`] fused
    /// in: the grouped kernel reads each query's row of the stacked q|k|v projection,
    /// adds the bias, rotates q and the token's k, and writes k and v into the token's
    /// cache slot before it attends (`append_fresh` in `attention_grouped.cu`). Every
    /// query must be the one new token of its sequence, at position context − 1 (a decode
    /// step; padding rows have a negative slot). `out16`, when given, receives the output
    /// in bf16 too. One launch (two when split) where the legacy path makes seven.
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention_append(
        &self,
        out: &mut CudaSlice<f32>,
        out16: Option<&mut CudaSlice<u16>>,
        cache: (&mut CudaSlice<u16>, &mut CudaSlice<u16>),
        layout: KvLayout,
        index: &mut AttentionIndex,
        append: Append<'_>,
    ) -> Result<(), CudaError> {
        let (k_cache, v_cache) = cache;
        if index.kernel != AttentionKernel::Grouped {
            return Err(CudaError::Unsupported {
                what: format!(
                    "the KV append fused into the {} attention kernel (only the grouped one \
                     appends: run rope_kv_write, then paged_attention)",
                    index.kernel
                ),
            });
        }
        let queries = index.query_seq.len();
        let hd = layout.head_dim;
        let q_width = index.q_heads * hd;
        let row = q_width + 2 * layout.kv_heads * hd;
        check("append qkv", queries * row, append.qkv.len())?;
        check("append positions", queries, append.rope.positions.len())?;
        check("append inv_freq", hd / 2, append.rope.inv_freq.len())?;
        check("append slots", queries, append.slots.slots.len())?;
        check("append q heads", index.q_heads, append.rope.q_heads)?;
        check("append kv heads", layout.kv_heads, append.rope.kv_heads)?;
        if let Some(bias) = append.bias {
            check("append bias", row, bias.len())?;
        }
        check("attention out", queries * q_width, out.len())?;
        if let Some(out16) = &out16 {
            check("attention bf16 out", out.len(), out16.len())?;
        }
        check(
            "append slots' cache",
            append.slots.capacity * layout.kv_heads * hd,
            k_cache.len(),
        )?;
        index.check_caches(layout, k_cache.len(), v_cache.len())?;
        let (k, _k) = k_cache.device_ptr_mut(&self.stream);
        let (v, _v) = v_cache.device_ptr_mut(&self.stream);
        let query = GroupedQuery::Append(append);
        self.grouped_attention(out, out16, query, (k, v), layout, index)
    }

    /// The grouped kernel over `index` (made for [`AttentionKernel::Grouped`]) and the
    /// caches at device addresses `cache`, writing `out16` too when given; the buffers are
    /// checked by its callers ([`Ops::paged_attention_with_bf16`],
    /// [`Ops::paged_attention_append`]).
    pub(super) fn grouped_attention(
        &self,
        out: &mut CudaSlice<f32>,
        out16: Option<&mut CudaSlice<u16>>,
        query: GroupedQuery<'_>,
        cache: (u64, u64),
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
            index.window,
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
        // A null pointer when there is no bf16 output; the guard keeps the buffer's
        // stream order until both launches are enqueued.
        let (out16, _out16) = self.optional_out(out16);
        let (null, no_pairing) = (0u64, 0u32);
        let mut a = self.builder(entry)?;
        a.arg(&mut *out).arg(&out16).arg(&mut *part_out);
        a.arg(&mut *part_max).arg(&mut *part_sum);
        match &query {
            GroupedQuery::Rotated(q) => a.arg(*q),
            GroupedQuery::Append(_) => a.arg(&null),
        };
        a.arg(&k_cache)
            .arg(&v_cache)
            .arg(&*tables)
            .arg(&*query_seq)
            .arg(&*contexts);
        for d in &dims {
            a.arg(d);
        }
        a.arg(&scale_log2);
        match &query {
            GroupedQuery::Rotated(_) => {
                for _ in 0..5 {
                    a.arg(&null);
                }
                a.arg(&no_pairing).arg(&null).arg(&null);
            }
            GroupedQuery::Append(ap) => {
                a.arg(ap.qkv);
                match ap.bias {
                    Some(b) => a.arg(b),
                    None => a.arg(&null),
                };
                a.arg(ap.rope.positions)
                    .arg(ap.rope.inv_freq)
                    .arg(&ap.slots.slots)
                    .arg(&ap.rope.pairing)
                    .arg(&k_cache)
                    .arg(&v_cache);
            }
        }
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
            .arg(&out16)
            .arg(&*part_out)
            .arg(&*part_max)
            .arg(&*part_sum)
            .arg(&*contexts)
            .arg(&dims[2])
            .arg(&head_dim)
            .arg(&dims[4])
            .arg(&dims[5]);
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
        let (shape, q) = (layout(2, 64), 8);
        assert_eq!(
            AttentionKernel::Flash.for_shape(shape, q),
            AttentionKernel::Flash
        );
        assert_eq!(
            AttentionKernel::Flash.for_decode(shape, q),
            AttentionKernel::Grouped
        );
        assert_eq!(
            AttentionKernel::Legacy.for_decode(shape, q),
            AttentionKernel::Legacy
        );
        // head_dim 96: neither flash nor grouped serves it.
        assert_eq!(
            AttentionKernel::Flash.for_shape(layout(2, 96), q),
            AttentionKernel::Legacy
        );
        let err = "paged".parse::<AttentionKernel>().unwrap_err().to_string();
        assert!(err.contains("paged") && err.contains("flash"), "{err}");
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
