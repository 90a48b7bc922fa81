//! The launch of the prefill attention kernel (`attention_flash.cu`, in the style of
//! FlashAttention-2): a block per (query head, tile of up to 64 queries of one sequence),
//! Q·Kᵀ and P·V on the tensor cores. Its twin is [`crate::attention::flash_reference`].
//!
//! [`AttentionKernel::Flash`] is chosen by `TESSERA_ATTENTION=flash`; the model then runs
//! it for batches that are not decode steps and the grouped kernel for decode steps. It
//! stays off by default until it has run on a GPU.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::{AttentionIndex, Ops, grid_yz, u32_of};
use crate::attention::KvLayout;
use crate::cuda::CudaError;

#[cfg(doc)]
use super::AttentionKernel;

/// Threads per block of the prefill kernel (`FLASH_WARPS` warps of 16 query rows, and its
/// `__launch_bounds__`).
pub const FLASH_THREADS: u32 = 128;
/// The head sizes the prefill kernel is built for: multiples of the mma's 16, as the
/// grouped kernel's ([`super::attention::GROUPED_HEAD_DIMS`]).
const FLASH_ENTRIES: [(usize, &str); 4] = [
    (16, "attention_flash_d16"),
    (32, "attention_flash_d32"),
    (64, "attention_flash_d64"),
    (128, "attention_flash_d128"),
];

/// The prefill kernel's entry for this shape: `attention_flash_d{head_dim}`; an error
/// naming what it lacks otherwise.
pub fn flash_entry(layout: KvLayout, q_heads: usize) -> Result<&'static str, CudaError> {
    if layout.kv_heads == 0 || !q_heads.is_multiple_of(layout.kv_heads) || q_heads == 0 {
        return Err(CudaError::Unsupported {
            what: format!(
                "flash attention over {q_heads} query heads and {} KV heads (a positive \
                 multiple)",
                layout.kv_heads
            ),
        });
    }
    FLASH_ENTRIES
        .iter()
        .find(|(d, _)| *d == layout.head_dim)
        .map(|(_, entry)| *entry)
        .ok_or_else(|| CudaError::Unsupported {
            what: format!(
                "flash attention with head_dim {} (it serves 16, 32, 64 and 128)",
                layout.head_dim
            ),
        })
}

impl Ops<'_> {
    /// The prefill kernel over `index` (made for [`AttentionKernel::Flash`], whose tiles it
    /// holds), q rotated already, the caches at device addresses `cache`; `out16` receives
    /// the output in bf16 too when given. The buffers are checked by the caller
    /// ([`Ops::paged_attention_with_bf16`]).
    pub(super) fn flash_attention(
        &self,
        out: &mut CudaSlice<f32>,
        out16: Option<&mut CudaSlice<u16>>,
        q: &CudaSlice<f32>,
        cache: (u64, u64),
        layout: KvLayout,
        index: &AttentionIndex,
    ) -> Result<(), CudaError> {
        let entry = flash_entry(layout, index.q_heads)?;
        let tiles = index.tiles.as_ref().ok_or_else(|| CudaError::Unsupported {
            what: "flash attention over an index made for another kernel".into(),
        })?;
        // Made with the index from its queries (`flash_tiles`), which a refill keeps.
        let count = tiles.len() / 2;
        let dims = [
            u32_of("max_blocks", index.max_blocks)?,
            u32_of("block_size", layout.block_size)?,
            u32_of("q_heads", index.q_heads)?,
            u32_of("kv_heads", layout.kv_heads)?,
            index.window,
        ];
        let scale_log2 = std::f32::consts::LOG2_E / (layout.head_dim as f32).sqrt();
        let config = LaunchConfig {
            grid_dim: (
                dims[2],
                grid_yz("flash attention tiles (grid y)", count)?,
                1,
            ),
            block_dim: (FLASH_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (k_cache, v_cache) = cache;
        let (out16, _out16) = self.optional_out(out16);
        let mut a = self.builder(entry)?;
        a.arg(out)
            .arg(&out16)
            .arg(q)
            .arg(&k_cache)
            .arg(&v_cache)
            .arg(&index.tables)
            .arg(&index.query_seq)
            .arg(&index.contexts)
            .arg(tiles);
        for d in &dims {
            a.arg(d);
        }
        a.arg(&scale_log2);
        self.run(entry, &mut a, config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::{FLASH_KEYS, FLASH_ROWS};

    /// The tile sizes the twin and the tiles follow are the kernel's `#define`s.
    #[test]
    fn the_kernels_tiles_are_the_twins() {
        let code = include_str!("../../../cuda/attention_flash.cu");
        let define = |name: &str| -> usize {
            let line = code
                .lines()
                .find_map(|l| l.strip_prefix(&format!("#define {name} ")))
                .unwrap_or_else(|| panic!("{name} is not defined"));
            line.trim().parse().unwrap()
        };
        assert_eq!(define("FLASH_ROWS"), FLASH_ROWS);
        assert_eq!(define("FLASH_KEYS"), FLASH_KEYS);
        assert_eq!(define("FLASH_WARPS") * 32, FLASH_THREADS as usize);
        assert_eq!(define("FLASH_WARPS") * 16, FLASH_ROWS, "16 rows a warp");
    }

    #[test]
    fn the_entry_follows_head_dim_and_refuses_what_it_lacks() {
        let layout = |kv_heads, head_dim| KvLayout {
            block_size: 16,
            kv_heads,
            head_dim,
        };
        assert_eq!(
            flash_entry(layout(8, 64), 32).unwrap(),
            "attention_flash_d64"
        );
        assert_eq!(
            flash_entry(layout(1, 128), 16).unwrap(),
            "attention_flash_d128"
        );
        assert_eq!(
            flash_entry(layout(2, 16), 2).unwrap(),
            "attention_flash_d16"
        );
        for (kv, hd, q) in [
            (8, 96, 32),
            (8, 256, 32),
            (3, 64, 8),
            (0, 64, 8),
            (2, 64, 0),
        ] {
            assert!(flash_entry(layout(kv, hd), q).is_err(), "{kv} {hd} {q}");
        }
    }
}
