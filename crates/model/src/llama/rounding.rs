//! The CPU pass rounded as the cuda path rounds: the reference a GPU run is compared with.
//!
//! A cuda shard holds every matrix in bf16 (but Q8_0, Q5_0, Q4_K, Q5_K, Q6_K and FP8, which its matvecs read
//! as stored: [`device_keeps_quantized`]), keeps norms, biases and the residual stream in
//! f32, and rounds to bf16 what its bf16 GEMMs read (the normed hidden rows, the attention
//! output, SiLU·mul's output, the final norm) and what it writes into its KV cache. The
//! GEMMs multiply bf16 by bf16 exactly and sum in f32, as the CPU's exact matmul does. So
//! the CPU pass with the same roundings ([`DeviceRounding::Bf16`], after
//! [`Llama::round_like_cuda`]) differs from a GPU run by the order of f32 sums alone, and
//! from the f32 model by what the roundings do.
//!
//! [`DeviceRounding::Bf16TowardZero`] rounds the same values toward zero instead: every
//! rounding then moves by up to one bf16 step, which bounds what a different order of sums
//! can do (it moves a rounding by one step where a value lands on the other side of a
//! rounding boundary), and so gives a GPU test its tolerance.

use tessera_kernels::DType;

use super::Llama;
use crate::error::ModelError;
use crate::launch_plan::device_keeps_quantized;

/// How the CPU pass rounds the activations the cuda path rounds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeviceRounding {
    /// No rounding: the CPU's own arithmetic.
    #[default]
    Off,
    /// To bf16, to nearest even, as the device does.
    Bf16,
    /// To bf16, toward zero: each rounding up to a whole step from [`DeviceRounding::Bf16`].
    Bf16TowardZero,
}

impl DeviceRounding {
    /// Rounds `values` in place.
    pub fn apply(self, values: &mut [f32]) {
        match self {
            DeviceRounding::Off => {}
            DeviceRounding::Bf16 => values
                .iter_mut()
                .for_each(|v| *v = half::bf16::from_f32(*v).to_f32()),
            // bf16 is the high half of an f32: dropping the low half rounds toward zero
            // (NaN and infinities keep their class).
            DeviceRounding::Bf16TowardZero => values
                .iter_mut()
                .for_each(|v| *v = f32::from_bits(v.to_bits() & 0xffff_0000)),
        }
    }
}

impl Llama {
    /// Holds every matrix in bf16 as a cuda shard does (norms and biases stay as they
    /// are) and rounds the activations it rounds by `rounding` from now on. A model with
    /// matrices the device keeps quantized is refused: their matvecs read f32 rows, which
    /// this twin does not follow.
    pub fn round_like_cuda(&mut self, rounding: DeviceRounding) -> Result<(), ModelError> {
        // The embedding (first) is a bf16 table on the device whatever its type.
        let matrices = self.matrices_mut();
        if let Some(kept) = matrices[1..]
            .iter()
            .find(|w| device_keeps_quantized(w.dtype))
        {
            return Err(ModelError::Plan {
                message: format!(
                    "{} is {}, which a cuda shard reads as stored: the CPU twin of the cuda \
                     path covers models it holds in bf16",
                    kept.name, kept.dtype
                ),
            });
        }
        for w in matrices {
            if w.dtype != DType::BF16 {
                *w = w.converted(DType::BF16)?;
            }
        }
        self.rounding = rounding;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_roundings_land_on_bf16_values_a_step_apart_at_most() {
        let mut values: Vec<f32> = vec![
            1.0,
            -1.0,
            0.0,
            1.0 + 1.0 / 128.0,
            std::f32::consts::PI,
            -std::f32::consts::E,
        ];
        values.extend((0..1000).map(|i| (i as f32 * 0.7531).sin() * 10.0));
        let (mut near, mut zero) = (values.clone(), values.clone());
        DeviceRounding::Bf16.apply(&mut near);
        DeviceRounding::Bf16TowardZero.apply(&mut zero);
        let mut moved = 0;
        for ((v, n), z) in values.iter().zip(&near).zip(&zero) {
            assert_eq!(half::bf16::from_f32(*n).to_f32(), *n);
            assert_eq!(half::bf16::from_f32(*z).to_f32(), *z);
            assert!(z.abs() <= v.abs(), "{v} toward zero: {z}");
            // At most one step apart: one bf16 value, or none, between them.
            let steps = (n.to_bits() as i64 - z.to_bits() as i64).abs() >> 16;
            assert!(steps <= 1, "{v}: {n} and {z}");
            moved += usize::from(n != z);
        }
        assert!(
            moved > 300,
            "only {moved} of {} values round differently",
            values.len()
        );
        let mut off = values.clone();
        DeviceRounding::Off.apply(&mut off);
        assert_eq!(off, values);
    }
}
