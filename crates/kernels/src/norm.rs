//! RMSNorm (Zhang & Sennrich, 2019, <https://arxiv.org/abs/1910.07467>), alone and fused
//! with the residual add that precedes it in every decoder layer.

/// `out = x / sqrt(mean(x²) + eps) · weight`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let inv = inv_rms(x, eps);
    for ((o, v), w) in out.iter_mut().zip(x).zip(weight) {
        *o = v * inv * w;
    }
}

/// [`rms_norm`] in place over every `weight.len()`-long head of `x` (Qwen3's q/k norm: one
/// weight vector shared by every head).
pub fn head_rms_norm(x: &mut [f32], weight: &[f32], eps: f32) {
    for head in x.chunks_exact_mut(weight.len()) {
        let inv = inv_rms(head, eps);
        head.iter_mut()
            .zip(weight)
            .for_each(|(v, w)| *v = *v * inv * w);
    }
}

/// `1 / sqrt(mean(x²) + eps)`. Accumulated in f64: O(hidden) work per token, and it keeps
/// the norm's error below the matmuls' so results track the reference to the last bits
/// that matter.
fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let mean_sq = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / x.len() as f64;
    (1.0 / (mean_sq + f64::from(eps)).sqrt()) as f32
}

/// `x += residual; out = rms_norm(x)`: one pass over `x` for both.
pub fn add_rms_norm(x: &mut [f32], residual: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let mut sum_sq = 0.0f64;
    for (v, r) in x.iter_mut().zip(residual) {
        *v += r;
        sum_sq += f64::from(*v) * f64::from(*v);
    }
    let inv = (1.0 / (sum_sq / x.len() as f64 + f64::from(eps)).sqrt()) as f32;
    for ((o, v), w) in out.iter_mut().zip(x.iter()).zip(weight) {
        *o = v * inv * w;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The textbook formula in f64.
    fn reference(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
        let ms = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / x.len() as f64;
        let inv = 1.0 / (ms + f64::from(eps)).sqrt();
        x.iter()
            .zip(w)
            .map(|(&v, &w)| (f64::from(v) * inv * f64::from(w)) as f32)
            .collect()
    }

    #[test]
    fn rms_norm_matches_reference() {
        let x: Vec<f32> = (0..576)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let w: Vec<f32> = (0..576).map(|i| 0.5 + (i % 13) as f32 / 10.0).collect();
        let mut out = vec![0.0; 576];
        rms_norm(&x, &w, 1e-5, &mut out);
        for (a, b) in out.iter().zip(reference(&x, &w, 1e-5)) {
            assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "{a} vs {b}");
        }
    }

    #[test]
    fn head_norm_normalizes_each_head_alone() {
        let mut x: Vec<f32> = (0..48)
            .map(|i| (i * 7 % 19) as f32 - 9.0 + i as f32)
            .collect();
        let w: Vec<f32> = (0..16).map(|i| 0.7 + i as f32 / 20.0).collect();
        let mut want = vec![0.0; 48];
        for (h, out) in x.chunks_exact(16).zip(want.chunks_exact_mut(16)) {
            rms_norm(h, &w, 1e-6, out);
        }
        head_rms_norm(&mut x, &w, 1e-6);
        assert_eq!(x, want);
        // Heads of different scale stay apart: the norm is per head, not over the row.
        let whole = reference(
            &(0..48).map(|i| i as f32).collect::<Vec<_>>(),
            &[1.0; 48],
            1e-6,
        );
        assert_ne!(&x[..16], &whole[..16]);
    }

    #[test]
    fn fused_add_equals_add_then_norm() {
        let mut x: Vec<f32> = (0..64).map(|i| i as f32 / 10.0 - 3.0).collect();
        let r: Vec<f32> = (0..64).map(|i| (i % 5) as f32 - 2.0).collect();
        let w = vec![1.5; 64];
        let summed: Vec<f32> = x.iter().zip(&r).map(|(a, b)| a + b).collect();
        let mut fused = vec![0.0; 64];
        add_rms_norm(&mut x, &r, &w, 1e-6, &mut fused);
        assert_eq!(x, summed);
        for (a, b) in fused.iter().zip(reference(&summed, &w, 1e-6)) {
            assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0));
        }
    }
}
