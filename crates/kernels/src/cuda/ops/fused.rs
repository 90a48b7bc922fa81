//! Launches of the fused kernels (issue 16): each replaces several launches of the
//! legacy path and writes the next GEMM's bf16 input itself. Their CPU twins are in
//! [`crate::fused`]. Until they have run on a GPU, the model runs them only when
//! `TESSERA_FUSED=1` (the legacy launches stay the default).

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::{Ops, ROW_THREADS, Slots, check, gate_up_tokens, rows, spread, u32_of, whole_rows};
use crate::cuda::CudaError;

/// What `rope_kv_write` rotates with, and the heads of one token's q|k|v row.
#[derive(Clone, Copy, Debug)]
pub struct RopeKv<'a> {
    /// Each token's position.
    pub positions: &'a CudaSlice<u32>,
    /// head_dim / 2 inverse frequencies, scaling applied (`rope::Rope::inv_freq`).
    pub inv_freq: &'a CudaSlice<f32>,
    /// 0: halves (HuggingFace), 1: adjacent (GGUF).
    pub pairing: u32,
    pub q_heads: usize,
    pub kv_heads: usize,
}

/// Where an rmsnorm launch writes: the legacy kernel's f32 output, or the fused kernel's
/// bf16 output with its f32 value when given.
pub(super) enum NormOut<'b> {
    F32(&'b mut CudaSlice<f32>),
    Bf16(&'b mut CudaSlice<u16>, Option<&'b mut CudaSlice<f32>>),
}

impl Ops<'_> {
    /// The launch of [`Ops::rmsnorm_residual`] (`rmsnorm_residual_f32`) and of
    /// [`Ops::rmsnorm_residual_bf16`] (`rmsnorm_residual_bf16`), as `out` says: per token,
    /// `residual += x` (if given), then `out = rmsnorm(residual) · weight`.
    pub(super) fn rmsnorm(
        &self,
        out: NormOut<'_>,
        residual: &mut CudaSlice<f32>,
        x: Option<&CudaSlice<f32>>,
        weight: &CudaSlice<f32>,
        eps: f32,
    ) -> Result<(), CudaError> {
        let hidden = weight.len();
        let tokens = whole_rows("residual (a multiple of hidden)", residual.len(), hidden)?;
        match &out {
            NormOut::F32(out) => check("rmsnorm out", residual.len(), out.len())?,
            NormOut::Bf16(out16, out32) => {
                check("rmsnorm bf16 out", residual.len(), out16.len())?;
                if let Some(out32) = out32 {
                    check("rmsnorm f32 out", residual.len(), out32.len())?;
                }
            }
        }
        if let Some(x) = x {
            check("rmsnorm x", residual.len(), x.len())?;
        }
        let h = u32_of("hidden", hidden)?;
        let null: u64 = 0;
        let config = rows(tokens, ROW_THREADS)?;
        // The bf16 kernel's optional f32 output: its address (0 when absent) and the guard
        // that orders it on this stream until the launch is enqueued.
        let (out32, _out32);
        let (entry, mut a) = match out {
            NormOut::F32(out) => {
                let mut a = self.builder("rmsnorm_residual_f32")?;
                a.arg(out);
                ("rmsnorm_residual_f32", a)
            }
            NormOut::Bf16(out16, f32_out) => {
                (out32, _out32) = self.optional_out(f32_out);
                let mut a = self.builder("rmsnorm_residual_bf16")?;
                a.arg(out16).arg(&out32);
                ("rmsnorm_residual_bf16", a)
            }
        };
        a.arg(residual);
        match x {
            Some(x) => a.arg(x),
            None => a.arg(&null),
        };
        a.arg(weight).arg(&h).arg(&eps);
        self.run(entry, &mut a, config)
    }

    /// Per token: `residual += x` (if given), then `out16 = bf16(rmsnorm(residual) ·
    /// weight)`, and `out32` the same before rounding when given (a quantized matvec's
    /// input). One launch where the legacy path makes two (`rmsnorm_residual_f32`,
    /// `round_bf16`).
    pub fn rmsnorm_residual_bf16(
        &self,
        out16: &mut CudaSlice<u16>,
        out32: Option<&mut CudaSlice<f32>>,
        residual: &mut CudaSlice<f32>,
        x: Option<&CudaSlice<f32>>,
        weight: &CudaSlice<f32>,
        eps: f32,
    ) -> Result<(), CudaError> {
        self.rmsnorm(NormOut::Bf16(out16, out32), residual, x, weight, eps)
    }

    /// Per token of the stacked q|k|v projection `qkv` (`tokens × (q_heads + 2 kv_heads)
    /// × head_dim`): `q_out = rope(q + bias)`, and the token's cache slot gets
    /// `bf16(rope(k + bias))` and `bf16(v + bias)` (a negative slot: skipped). One launch
    /// where the legacy path makes five (three `add_bias_f32`, `rope_f32`,
    /// `kv_write_bf16`).
    pub fn rope_kv_write(
        &self,
        q_out: &mut CudaSlice<f32>,
        cache: (&mut CudaSlice<u16>, &mut CudaSlice<u16>),
        qkv: &CudaSlice<f32>,
        bias: Option<&CudaSlice<f32>>,
        slots: &Slots,
        rope: RopeKv<'_>,
    ) -> Result<(), CudaError> {
        let (k_cache, v_cache) = cache;
        let head_dim = rope.inv_freq.len() * 2;
        let tokens = slots.slots.len();
        let (q_width, kv_width) = (rope.q_heads * head_dim, rope.kv_heads * head_dim);
        let row = q_width + 2 * kv_width;
        check("rope_kv positions", tokens, rope.positions.len())?;
        check("rope_kv qkv", tokens * row, qkv.len())?;
        check("rope_kv q out", tokens * q_width, q_out.len())?;
        if let Some(bias) = bias {
            check("rope_kv bias", row, bias.len())?;
        }
        check("rope_kv k cache", slots.capacity * kv_width, k_cache.len())?;
        check("rope_kv v cache", k_cache.len(), v_cache.len())?;
        if head_dim == 0 {
            return Err(CudaError::Shape {
                what: "rope_kv head_dim (2 × inv_freq, at least 2)",
                expected: 2,
                actual: 0,
            });
        }
        let (qh, kh, hd) = (
            u32_of("q_heads", rope.q_heads)?,
            u32_of("kv_heads", rope.kv_heads)?,
            u32_of("head_dim", head_dim)?,
        );
        let null: u64 = 0;
        let config = rows(tokens, ROW_THREADS)?;
        let mut a = self.builder("rope_kv_write")?;
        a.arg(q_out).arg(k_cache).arg(v_cache).arg(qkv);
        match bias {
            Some(b) => a.arg(b),
            None => a.arg(&null),
        };
        a.arg(rope.positions)
            .arg(rope.inv_freq)
            .arg(&slots.slots)
            .arg(&qh)
            .arg(&kh)
            .arg(&hd)
            .arg(&rope.pairing);
        self.run("rope_kv_write", &mut a, config)
    }

    /// `out16[t, i] = bf16(silu(gate_up[t, i]) · gate_up[t, inter + i])`, and `out32` the
    /// same before rounding when given (a quantized matvec's input). One launch where the
    /// legacy path makes two (`silu_mul_f32`, `round_bf16`).
    pub fn silu_mul_bf16(
        &self,
        out16: &mut CudaSlice<u16>,
        out32: Option<&mut CudaSlice<f32>>,
        gate_up: &CudaSlice<f32>,
        inter: usize,
    ) -> Result<(), CudaError> {
        let tokens = gate_up_tokens(gate_up.len(), inter)?;
        check("silu_mul bf16 out", tokens * inter, out16.len())?;
        if let Some(out32) = &out32 {
            check("silu_mul f32 out", tokens * inter, out32.len())?;
        }
        let (i, t) = (u32_of("inter", inter)?, u32_of("tokens", tokens)?);
        // Four values a thread when inter allows the kernel's 16-byte loads.
        let per_thread = if inter.is_multiple_of(4) { 4 } else { 1 };
        let config: LaunchConfig = spread(tokens * inter / per_thread);
        let (out32, _out32) = self.optional_out(out32);
        let mut a = self.builder("silu_mul_bf16")?;
        a.arg(out16).arg(&out32).arg(gate_up).arg(&i).arg(&t);
        self.run("silu_mul_bf16", &mut a, config)
    }
}
