//! The CPU twins of the fused CUDA kernels: each composes the CPU steps it replaces and
//! rounds to bf16 where the kernel does, so it defines the kernel's result (the GPU tests
//! in `tests/gpu.rs` compare against it). They run on one token at a time, as the kernels'
//! blocks do.
//!
//! | Twin | Kernel | Replaces |
//! |---|---|---|
//! | [`add_rms_norm_bf16`] | `rmsnorm_residual_bf16` | `rmsnorm_residual_f32`, `round_bf16` |
//! | [`rope_kv_write`] | `rope_kv_write` | `add_bias_f32` (q, k, v), `rope_f32`, `kv_write_bf16` |
//! | [`silu_mul_bf16`] | `silu_mul_bf16` | `silu_mul_f32`, `round_bf16` |

use half::bf16;

use crate::rope::{Rope, RopeTables};

/// The bits of `x` rounded to bf16 (nearest even), as the kernels' `f32_to_bf16`.
pub fn bf16_bits(x: f32) -> u16 {
    bf16::from_f32(x).to_bits()
}

/// One token: `residual += x` (when given), then `out16 = bf16(rms_norm(residual) ·
/// weight)`; returns the f32 values before rounding (the kernel's optional `out32`).
pub fn add_rms_norm_bf16(
    residual: &mut [f32],
    x: Option<&[f32]>,
    weight: &[f32],
    eps: f32,
    out16: &mut [u16],
) -> Vec<f32> {
    let mut out = vec![0.0; residual.len()];
    match x {
        Some(x) => crate::norm::add_rms_norm(residual, x, weight, eps, &mut out),
        None => crate::norm::rms_norm(residual, weight, eps, &mut out),
    }
    for (o, &v) in out16.iter_mut().zip(&out) {
        *o = bf16_bits(v);
    }
    out
}

/// One token's row of the gate|up projection (gate, then up, `inter` each):
/// `out16 = bf16(silu(gate) · up)`; returns the f32 values before rounding.
pub fn silu_mul_bf16(gate_up: &[f32], out16: &mut [u16]) -> Vec<f32> {
    let inter = gate_up.len() / 2;
    let (gate, up) = gate_up.split_at(inter);
    let mut out = gate.to_vec();
    crate::activation::silu_mul(&mut out, up);
    for (o, &v) in out16.iter_mut().zip(&out) {
        *o = bf16_bits(v);
    }
    out
}

/// What [`rope_kv_write`] reads of one token.
#[derive(Clone, Copy, Debug)]
pub struct QkvRow<'a> {
    /// The stacked projection's row: q heads, then k heads, then v heads.
    pub qkv: &'a [f32],
    /// Its bias (q, k, v stacked the same way), if any.
    pub bias: Option<&'a [f32]>,
}

/// One token of `rope_kv_write`, the `t`-th position of `tables`: returns the rotated q
/// (f32) and writes bf16(rope(k + bias)) into `k_slot` and bf16(v + bias) into `v_slot`
/// (the token's slot of the cache, `kv_heads × head_dim` values each).
pub fn rope_kv_write(
    row: QkvRow<'_>,
    rope: &Rope,
    tables: &RopeTables,
    t: usize,
    k_slot: &mut [u16],
    v_slot: &mut [u16],
) -> Vec<f32> {
    let mut biased = row.qkv.to_vec();
    if let Some(bias) = row.bias {
        for (v, b) in biased.iter_mut().zip(bias) {
            *v += b;
        }
    }
    let kv_width = k_slot.len();
    let q_width = biased.len() - 2 * kv_width;
    let (q, rest) = biased.split_at_mut(q_width);
    let (k, v) = rest.split_at_mut(kv_width);
    rope.apply(tables, t, q);
    rope.apply(tables, t, k);
    for (dst, &x) in k_slot.iter_mut().zip(k.iter()) {
        *dst = bf16_bits(x);
    }
    for (dst, &x) in v_slot.iter_mut().zip(v.iter()) {
        *dst = bf16_bits(x);
    }
    q.to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rope::{RopePairing, RopeScaling};

    #[test]
    fn the_norm_twin_rounds_what_the_f32_norm_computes() {
        let mut residual = vec![1.0, -2.0, 3.0, 0.5];
        let x = [0.5, 0.5, -1.0, 0.25];
        let weight = [1.0, 0.5, 2.0, 1.5];
        let mut want_res = residual.clone();
        let mut want = vec![0.0; 4];
        crate::norm::add_rms_norm(&mut want_res, &x, &weight, 1e-5, &mut want);
        let mut out16 = vec![0u16; 4];
        let out = add_rms_norm_bf16(&mut residual, Some(&x), &weight, 1e-5, &mut out16);
        assert_eq!(residual, want_res);
        assert_eq!(out, want);
        let bits: Vec<u16> = want.iter().map(|&v| bf16_bits(v)).collect();
        assert_eq!(out16, bits);
    }

    #[test]
    fn rope_kv_write_adds_the_bias_before_rotating_and_leaves_v_unrotated() {
        let (hd, qh, kh) = (4, 2, 1);
        let rope = Rope::new(hd, 10_000.0, &RopeScaling::None, RopePairing::Halves);
        let tables = rope.tables(&[3]);
        let qkv: Vec<f32> = (0..(qh + 2 * kh) * hd).map(|i| i as f32 * 0.25).collect();
        let bias: Vec<f32> = (0..qkv.len()).map(|i| 1.0 - i as f32 * 0.125).collect();
        let (mut k, mut v) = (vec![0u16; kh * hd], vec![0u16; kh * hd]);
        let row = QkvRow {
            qkv: &qkv,
            bias: Some(&bias),
        };
        let q = rope_kv_write(row, &rope, &tables, 0, &mut k, &mut v);
        let biased: Vec<f32> = qkv.iter().zip(&bias).map(|(a, b)| a + b).collect();
        let mut want_q = biased[..qh * hd].to_vec();
        rope.apply(&tables, 0, &mut want_q);
        assert_eq!(q, want_q);
        let mut want_k = biased[qh * hd..(qh + kh) * hd].to_vec();
        rope.apply(&tables, 0, &mut want_k);
        let bits = |v: &[f32]| v.iter().map(|&x| bf16_bits(x)).collect::<Vec<_>>();
        assert_eq!(k, bits(&want_k));
        assert_eq!(v, bits(&biased[(qh + kh) * hd..]));
    }

    #[test]
    fn silu_mul_twin_reads_gate_then_up() {
        let gate_up = [1.0, -2.0, 3.0, 4.0];
        let mut out16 = vec![0u16; 2];
        let out = silu_mul_bf16(&gate_up, &mut out16);
        let silu = |g: f32| g / (1.0 + (-g).exp());
        assert_eq!(out, vec![silu(1.0) * 3.0, silu(-2.0) * 4.0]);
        assert_eq!(out16, vec![bf16_bits(out[0]), bf16_bits(out[1])]);
    }
}
