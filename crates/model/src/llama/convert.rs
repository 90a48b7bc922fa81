//! Weights held in another type than the file's: the topology's `dtype` (`f32`, `bf16`,
//! `f16`; `auto` keeps the file's), as transformers holds a model loaded with that
//! `torch_dtype`. Every matrix (the projections, the token embedding, the LM head) is
//! dequantized row by row to f32 and, for the 16-bit types, rounded to nearest even, as
//! torch rounds. Norm weights and biases take the type's values too (rounded the same
//! way), kept in f32 for the kernels.

use tessera_kernels::DType;
use tessera_topology::ModelDtype;
use tracing::info;

use super::Llama;
use crate::error::ModelError;
use crate::weights::Weight;

/// The type `dtype` holds weights in; `None` for `auto` (the file's).
fn held_type(dtype: ModelDtype) -> Option<DType> {
    match dtype {
        ModelDtype::Auto => None,
        ModelDtype::F32 => Some(DType::F32),
        ModelDtype::Bf16 => Some(DType::BF16),
        ModelDtype::F16 => Some(DType::F16),
    }
}

impl Llama {
    /// The type every matrix is held in by the topology's `dtype` ([`Llama::hold_as`]);
    /// `None` for `auto` (each as loaded). A cuda shard runs its exact path for `F32`.
    pub fn held(&self) -> Option<DType> {
        self.held
    }

    /// Holds every matrix in the type `dtype` names (nothing changes for `auto`); returns
    /// how many tensors were converted.
    pub fn hold_as(&mut self, dtype: ModelDtype) -> Result<usize, ModelError> {
        let Some(to) = held_type(dtype) else {
            return Ok(0);
        };
        self.held = Some(to);
        let (mut converted, mut before, mut after) = (0, 0, 0);
        let mut convert = |w: &mut Weight| -> Result<(), ModelError> {
            if w.dtype != to {
                before += w.storage_bytes();
                *w = w.converted(to)?;
                after += w.storage_bytes();
                converted += 1;
            }
            Ok(())
        };
        let round: fn(f32) -> f32 = match to {
            DType::BF16 => |v| half::bf16::from_f32(v).to_f32(),
            DType::F16 => |v| half::f16::from_f32(v).to_f32(),
            _ => |v| v,
        };
        let round_all = |values: &mut [f32]| values.iter_mut().for_each(|v| *v = round(*v));
        // A norm's stored weight is rounded, not the offset added at load (Gemma's
        // `1 + w` is computed in f32 from the held `w`, as transformers does).
        let offset = self.config.block.norm_offset;
        let round_norm = |values: &mut [f32]| {
            values
                .iter_mut()
                .for_each(|v| *v = round(*v - offset) + offset)
        };
        round_norm(&mut self.final_norm);
        for layer in &mut self.layers {
            let norms = [&mut layer.post_attn_norm, &mut layer.post_ffn_norm];
            for norm in [&mut layer.attn_norm, &mut layer.ffn_norm]
                .into_iter()
                .chain(norms.into_iter().flatten())
            {
                round_norm(norm);
            }
            for norm in [&mut layer.q_norm, &mut layer.k_norm].into_iter().flatten() {
                round_norm(norm);
            }
            for linear in [&mut layer.q, &mut layer.k, &mut layer.v, &mut layer.o] {
                if let Some(bias) = &mut linear.bias {
                    round_all(bias);
                }
            }
        }
        for w in self.matrices_mut() {
            convert(w)?;
        }
        if converted > 0 {
            info!(
                tensors = converted,
                to = %to,
                bytes_before = before,
                bytes_after = after,
                "weights held as the topology's dtype"
            );
        }
        Ok(converted)
    }
}
