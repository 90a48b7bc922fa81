//! The bf16 GEMV of small decode batches (`gemv.cu`): `ys[t, r] = Σ_c W[r, c] · xs[t, c]`
//! for 1 to [`GEMV_MAX_TOKENS`] tokens, the semantics and layouts of `Blas::gemm_bf16`
//! (whose shape checks it shares), with each weight byte read once for the whole batch.
//! Until it has run on a GPU the model runs it only when `TESSERA_GEMV=1`; cuBLAS stays
//! the default.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::{Ops, projection_tokens, u32_of};
use crate::cuda::CudaError;

/// The most tokens one GEMV launch serves (an entry per count: `gemv_bf16_t1` …
/// `gemv_bf16_t8`); larger batches are GEMMs, where cuBLAS reuses each weight tile.
pub const GEMV_MAX_TOKENS: usize = 8;
/// Threads per block (`GEMV_WARPS` warps in `gemv.cu`, and its `__launch_bounds__`).
pub const GEMV_THREADS: u32 = 128;
/// Rows per block (`GEMV_ROWS` in `gemv.cu`; its `GEMV_WARPS` warps split their columns).
pub const GEMV_ROWS_PER_BLOCK: usize = 2;

/// The entry for each token count, from 1 (the family's entries in `source`).
pub(crate) const GEMV_ENTRIES: [&str; GEMV_MAX_TOKENS] = [
    "gemv_bf16_t1",
    "gemv_bf16_t2",
    "gemv_bf16_t3",
    "gemv_bf16_t4",
    "gemv_bf16_t5",
    "gemv_bf16_t6",
    "gemv_bf16_t7",
    "gemv_bf16_t8",
];

/// One checked GEMV launch: its entry, grid and the kernel's `rows` and `cols`.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct GemvLaunch {
    pub(super) entry: &'static str,
    pub(super) blocks: u32,
    pub(super) rows: u32,
    pub(super) cols: u32,
}

/// The launch of a projection of `rows × cols` whose weights, inputs and outputs hold
/// `lens` values: the shapes of `Blas::gemm_bf16`, and 1 to [`GEMV_MAX_TOKENS`] tokens.
pub(super) fn gemv_launch(
    lens: (usize, usize, usize),
    (rows, cols): (usize, usize),
) -> Result<GemvLaunch, CudaError> {
    let tokens = projection_tokens(lens, (rows, cols))?;
    if !(1..=GEMV_MAX_TOKENS).contains(&tokens) {
        return Err(CudaError::GemvTokens { tokens });
    }
    // The kernel indexes rows in 32 bits: every row must be a u32 (cols too).
    let (r, c) = (u32_of("gemv rows", rows)?, u32_of("gemv cols", cols)?);
    Ok(GemvLaunch {
        entry: GEMV_ENTRIES[tokens - 1],
        blocks: u32_of("gemv blocks", rows.div_ceil(GEMV_ROWS_PER_BLOCK))?,
        rows: r,
        cols: c,
    })
}

impl Ops<'_> {
    /// `ys[t, r] = Σ_c W[r, c] · xs[t, c]` for `W` of `rows × cols` (bf16 bits), `xs` of
    /// `tokens × cols` (bf16 bits) and `ys` of `tokens × rows` (f32), 1 to
    /// [`GEMV_MAX_TOKENS`] tokens: `Blas::gemm_bf16` for small batches (one launch).
    pub fn gemv_bf16(
        &self,
        ys: &mut impl DevicePtrMut<f32>,
        w: &CudaSlice<u16>,
        xs: &impl DevicePtr<u16>,
        shape: (usize, usize),
    ) -> Result<(), CudaError> {
        let launch = gemv_launch((w.len(), xs.len(), ys.len()), shape)?;
        let config = LaunchConfig {
            // A projection of no rows still launches (one block, which returns at once).
            grid_dim: (launch.blocks.max(1), 1, 1),
            block_dim: (GEMV_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (ys, _ys) = ys.device_ptr_mut(self.stream());
        let (xs, _xs) = xs.device_ptr(self.stream());
        let mut a = self.builder(launch.entry)?;
        a.arg(&ys)
            .arg(w)
            .arg(&xs)
            .arg(&launch.rows)
            .arg(&launch.cols);
        self.run(launch.entry, &mut a, config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_token_count_has_its_entry_and_rows_round_up_to_blocks() {
        for tokens in 1..=GEMV_MAX_TOKENS {
            let (rows, cols) = (1001, 577);
            let launch =
                gemv_launch((rows * cols, tokens * cols, tokens * rows), (rows, cols)).unwrap();
            assert_eq!(launch.entry, format!("gemv_bf16_t{tokens}"));
            assert_eq!(launch.blocks, 501, "1001 rows in blocks of 2");
            assert_eq!((launch.rows, launch.cols), (1001, 577));
            assert!(crate::cuda::source::family_of(launch.entry).is_some());
        }
        // No rows: no block to cover them (the launch still runs one, which returns).
        let none = gemv_launch((0, 2 * 64, 0), (0, 64)).unwrap();
        assert_eq!((none.entry, none.blocks), ("gemv_bf16_t2", 0));
    }

    #[test]
    fn a_batch_outside_one_to_eight_tokens_is_refused() {
        let (rows, cols) = (16, 64);
        for tokens in [0, 9, 64] {
            let err =
                gemv_launch((rows * cols, tokens * cols, tokens * rows), (rows, cols)).unwrap_err();
            assert!(matches!(err, CudaError::GemvTokens { tokens: t } if t == tokens));
            assert!(
                err.to_string().contains(&format!("{tokens} tokens")),
                "{err}"
            );
        }
    }

    #[test]
    fn a_wrong_buffer_size_is_a_shape_error() {
        let (rows, cols, tokens) = (16, 64, 2);
        let good = (rows * cols, tokens * cols, tokens * rows);
        assert!(gemv_launch(good, (rows, cols)).is_ok());
        let wrong = [
            (good.0 - 1, good.1, good.2),
            (good.0, good.1 + 1, good.2),
            (good.0, good.1, good.2 + rows),
            (good.0, good.1, good.2 - 1),
        ];
        for lens in wrong {
            let err = gemv_launch(lens, (rows, cols)).unwrap_err();
            assert!(matches!(err, CudaError::Shape { .. }), "{lens:?}: {err}");
        }
        assert!(matches!(
            gemv_launch((0, 0, 0), (rows, 0)).unwrap_err(),
            CudaError::Shape { .. }
        ));
    }
}
