//! Rotary position embedding settings: read from `config.json` ([`HfRopeSpec`], the
//! transformers 4 keys `rope_theta` + `rope_scaling` or the transformers 5 `rope_parameters`)
//! or from GGUF metadata ([`gguf_scaling`]) into one [`RopeConfig`]. The computation lives in
//! `tessera_kernels::rope`.
//!
//! Scalings: none, linear, llama3 (GGUF: the tensor `rope_freqs.weight`) and LongRoPE
//! (`longrope`; Phi-3 also reads `su` and `yarn` as it, as transformers' `Phi3Config` does;
//! GGUF: the tensors `rope_factors_short.weight` / `rope_factors_long.weight` and the keys
//! `<arch>.rope.scaling.original_context_length` / `attn_factor`, as llama.cpp's converter
//! writes them). A rotation over part of each head (`partial_rotary_factor`) is refused.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;
use tessera_kernels::rope::{LongRope, RopePairing, RopeScaling};

use super::{Architecture, RopeConfig, invalid, missing, refuse};
use crate::error::ModelError;
use crate::gguf::GgufFile;

/// The rope keys of `config.json`.
#[derive(Debug, Default, Deserialize)]
pub(super) struct HfRopeSpec {
    rope_theta: Option<f32>,
    rope_scaling: Option<Value>,
    /// transformers 5 moves `rope_theta` and `rope_scaling` here.
    rope_parameters: Option<Value>,
    /// Phi-3 keeps its pretraining context here; transformers prefers it to the one in
    /// `rope_scaling` (and defaults it to 4096 for Phi-3).
    original_max_position_embeddings: Option<usize>,
    partial_rotary_factor: Option<f64>,
}

/// What a scaling needs of the rest of the config.
#[derive(Clone, Copy, Debug)]
pub(super) struct RopeShape {
    pub(super) arch: Architecture,
    pub(super) head_dim: usize,
    pub(super) max_position_embeddings: usize,
}

impl HfRopeSpec {
    /// A GGUF file's: only the base (its scaling is [`gguf_scaling`]'s).
    pub(super) fn with_theta(rope_theta: Option<f32>) -> HfRopeSpec {
        HfRopeSpec {
            rope_theta,
            ..HfRopeSpec::default()
        }
    }

    pub(super) fn validate(&self, path: &Path, shape: RopeShape) -> Result<RopeConfig, ModelError> {
        let params = self.rope_parameters.as_ref();
        let theta = self
            .rope_theta
            .or_else(|| params?.get("rope_theta")?.as_f64().map(|v| v as f32))
            .unwrap_or(
                if matches!(shape.arch, Architecture::Qwen2 | Architecture::Qwen3) {
                    1_000_000.0
                } else {
                    10_000.0
                },
            );
        let scaling_value = self
            .rope_scaling
            .as_ref()
            .or(params)
            .filter(|v| !v.is_null());
        let partial = self
            .partial_rotary_factor
            .or_else(|| scaling_value?.get("partial_rotary_factor")?.as_f64());
        if let Some(p) = partial.filter(|p| *p != 1.0) {
            return Err(refuse::unsupported(
                path,
                "partial_rotary_factor",
                p.to_string(),
                "1 (RoPE over the whole head)",
            ));
        }
        let scaling = match scaling_value {
            None => RopeScaling::None,
            Some(v) => self.scaling(v, path, shape)?,
        };
        Ok(RopeConfig {
            theta,
            scaling,
            pairing: RopePairing::Halves,
        })
    }

    fn scaling(&self, v: &Value, path: &Path, shape: RopeShape) -> Result<RopeScaling, ModelError> {
        let key = "rope_scaling";
        let kind = v
            .get("rope_type")
            .or_else(|| v.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("default");
        let num = |name: &str| -> Result<f32, ModelError> {
            v.get(name)
                .and_then(Value::as_f64)
                .map(|x| x as f32)
                .ok_or_else(|| {
                    invalid(path, key, format!("of type {kind} needs a number `{name}`"))
                })
        };
        let phi3 = shape.arch == Architecture::Phi3;
        match kind {
            "default" => Ok(RopeScaling::None),
            "linear" => Ok(RopeScaling::Linear {
                factor: num("factor")?,
            }),
            "llama3" => Ok(RopeScaling::Llama3 {
                factor: num("factor")?,
                low_freq_factor: num("low_freq_factor")?,
                high_freq_factor: num("high_freq_factor")?,
                original_max_position_embeddings: num("original_max_position_embeddings")? as usize,
            }),
            "longrope" => self.longrope(v, path, shape),
            // transformers' Phi3Config renames both to longrope.
            "su" | "yarn" if phi3 => self.longrope(v, path, shape),
            other => Err(refuse::unsupported(
                path,
                key,
                format!("type {other}"),
                "default, linear, llama3, longrope",
            )),
        }
    }

    /// LongRoPE as transformers 5's `_compute_longrope_parameters` reads it.
    fn longrope(
        &self,
        v: &Value,
        path: &Path,
        shape: RopeShape,
    ) -> Result<RopeScaling, ModelError> {
        let key = "rope_scaling";
        let original = match (shape.arch, self.original_max_position_embeddings) {
            (_, Some(n)) => n,
            (Architecture::Phi3, None) => 4096,
            (_, None) => v
                .get("original_max_position_embeddings")
                .and_then(Value::as_u64)
                .map_or(shape.max_position_embeddings, |n| n as usize),
        };
        if original < 2 {
            return Err(invalid(
                path,
                "original_max_position_embeddings",
                format!("= {original} must be at least 2"),
            ));
        }
        let factors = |name: &str| -> Result<Vec<f32>, ModelError> {
            let values = v.get(name).and_then(Value::as_array).ok_or_else(|| {
                invalid(path, key, format!("of type longrope needs a list `{name}`"))
            })?;
            let floats: Option<Vec<f32>> = values
                .iter()
                .map(|x| x.as_f64().map(|f| f as f32))
                .collect();
            let floats = floats
                .ok_or_else(|| invalid(path, key, format!("`{name}` must be a list of numbers")))?;
            check_factors(path, key, &format!("`{name}` "), &floats, shape.head_dim)?;
            Ok(floats)
        };
        let factor = v
            .get("factor")
            .and_then(Value::as_f64)
            .unwrap_or(shape.max_position_embeddings as f64 / original as f64);
        let attention_factor = match v.get("attention_factor").and_then(Value::as_f64) {
            Some(a) => a as f32,
            None => LongRope::default_attention_factor(factor, original),
        };
        Ok(RopeScaling::LongRope(LongRope {
            short_factor: factors("short_factor")?,
            long_factor: factors("long_factor")?,
            original_max_position_embeddings: original,
            attention_factor,
        }))
    }
}

/// Refuses LongRoPE factors that are not one positive number per frequency; `what` names
/// the list within `key` (with a trailing space), if it needs naming.
fn check_factors(
    path: &Path,
    key: &str,
    what: &str,
    factors: &[f32],
    head_dim: usize,
) -> Result<(), ModelError> {
    if factors.len() != head_dim / 2 {
        return Err(invalid(
            path,
            key,
            format!(
                "{what}has {} values; a head of {head_dim} has {} frequencies",
                factors.len(),
                head_dim / 2
            ),
        ));
    }
    if let Some(bad) = factors.iter().find(|f| !(f.is_finite() && **f > 0.0)) {
        return Err(invalid(
            path,
            key,
            format!("{what}holds {bad}; factors must be positive"),
        ));
    }
    Ok(())
}

/// The rope scaling of a GGUF file of `arch_name`, whose heads are `head_dim` wide and whose
/// context is `context` positions; refuses a rotation of part of each head.
pub(super) fn gguf_scaling(
    file: &GgufFile,
    arch_name: &str,
    head_dim: usize,
    context: usize,
) -> Result<RopeScaling, ModelError> {
    let path = file.path();
    let key = |name: &str| format!("{arch_name}.{name}");
    let dims = file.get_u64(&key("rope.dimension_count"))?;
    if let Some(dims) = dims.filter(|d| *d as usize != head_dim) {
        return Err(refuse::unsupported(
            path,
            &key("rope.dimension_count"),
            dims.to_string(),
            &format!("the head dimension, {head_dim} (RoPE over the whole head)"),
        ));
    }
    if let Some(factors) = vector(file, "rope_freqs.weight")? {
        return Ok(RopeScaling::Factors(factors));
    }
    if let Some(long_factor) = vector(file, "rope_factors_long.weight")? {
        let short_name = "rope_factors_short.weight";
        let short_factor = vector(file, short_name)?.ok_or_else(|| ModelError::MissingTensor {
            path: path.into(),
            tensor: short_name.into(),
        })?;
        let orig_key = key("rope.scaling.original_context_length");
        let original = file
            .get_u64(&orig_key)?
            .ok_or_else(|| missing(path, &orig_key))? as usize;
        if original < 2 {
            return Err(invalid(path, &orig_key, "must be at least 2"));
        }
        for (name, factors) in [
            ("rope_factors_short.weight", &short_factor),
            ("rope_factors_long.weight", &long_factor),
        ] {
            check_factors(path, name, "", factors, head_dim)?;
        }
        let attention_factor = match file.get_f32(&key("rope.scaling.attn_factor"))? {
            Some(a) => a,
            None => LongRope::default_attention_factor(context as f64 / original as f64, original),
        };
        return Ok(RopeScaling::LongRope(LongRope {
            short_factor,
            long_factor,
            original_max_position_embeddings: original,
            attention_factor,
        }));
    }
    match file.get_str(&key("rope.scaling.type"))? {
        None | Some("none") => Ok(RopeScaling::None),
        Some("linear") => Ok(RopeScaling::Linear {
            factor: file.get_f32(&key("rope.scaling.factor"))?.unwrap_or(1.0),
        }),
        Some(other) => Err(refuse::unsupported(
            path,
            &key("rope.scaling.type"),
            other.into(),
            "none, linear (llama3 scaling travels as the tensor rope_freqs.weight, LongRoPE as \
             rope_factors_short.weight and rope_factors_long.weight)",
        )),
    }
}

/// A one-row tensor of the file as f32 values, if the file has it.
fn vector(file: &GgufFile, name: &str) -> Result<Option<Vec<f32>>, ModelError> {
    let Some(info) = file.tensor(name) else {
        return Ok(None);
    };
    let mut values = vec![0.0; info.cols()];
    tessera_kernels::quant::dequantize_row(info.dtype, file.tensor_data(info), &mut values)?;
    Ok(Some(values))
}

#[cfg(test)]
mod tests {
    use super::*;

    const PHI3: RopeShape = RopeShape {
        arch: Architecture::Phi3,
        head_dim: 8,
        max_position_embeddings: 128,
    };

    fn rope(json: &str, shape: RopeShape) -> Result<RopeConfig, ModelError> {
        let spec: HfRopeSpec = serde_json::from_str(json).unwrap();
        spec.validate(Path::new("config.json"), shape)
    }

    #[test]
    fn phi3_longrope_follows_transformers() {
        let json = r#"{"original_max_position_embeddings": 32, "rope_scaling": {"type": "su",
            "short_factor": [1, 1, 1.5, 2], "long_factor": [1, 2, 4, 8]}}"#;
        let RopeScaling::LongRope(l) = rope(json, PHI3).unwrap().scaling else {
            panic!("not longrope");
        };
        assert_eq!(l.original_max_position_embeddings, 32);
        assert_eq!(l.long_factor, vec![1.0, 2.0, 4.0, 8.0]);
        // 128 / 32 = 4: √(1 + ln 4 / ln 32).
        assert!((l.attention_factor - 1.4f32.sqrt()).abs() < 1e-6);
        // An explicit factor and attention factor win; Phi-3 defaults the original to 4096.
        let json = r#"{"rope_parameters": {"rope_type": "longrope", "factor": 1.0,
            "attention_factor": 1.25, "original_max_position_embeddings": 64,
            "short_factor": [1, 1, 1, 1], "long_factor": [1, 1, 1, 1]}}"#;
        let RopeScaling::LongRope(l) = rope(json, PHI3).unwrap().scaling else {
            panic!("not longrope");
        };
        assert_eq!(
            (l.attention_factor, l.original_max_position_embeddings),
            (1.25, 4096)
        );
        let llama = RopeShape {
            arch: Architecture::Llama,
            ..PHI3
        };
        let RopeScaling::LongRope(l) = rope(json, llama).unwrap().scaling else {
            panic!("not longrope");
        };
        assert_eq!(l.original_max_position_embeddings, 64);
    }

    #[test]
    fn bad_longrope_and_partial_rotary_are_refused_by_name() {
        let short = r#"{"rope_scaling": {"type": "longrope", "short_factor": [1, 1, 1],
            "long_factor": [1, 1, 1, 1]}}"#;
        let e = rope(short, PHI3).unwrap_err().to_string();
        assert!(
            e.contains("`short_factor` has 3 values; a head of 8 has 4 frequencies"),
            "{e}"
        );
        let e = rope(r#"{"rope_scaling": {"type": "longrope"}}"#, PHI3)
            .unwrap_err()
            .to_string();
        assert!(e.contains("needs a list `short_factor`"), "{e}");
        let e = rope(
            r#"{"rope_scaling": {"type": "dynamic", "factor": 2}}"#,
            PHI3,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("type dynamic") && e.contains("llama3, longrope"),
            "{e}"
        );
        let llama = RopeShape {
            arch: Architecture::Llama,
            ..PHI3
        };
        let e = rope(r#"{"rope_scaling": {"type": "su"}}"#, llama)
            .unwrap_err()
            .to_string();
        assert!(e.contains("type su"), "{e}");
        let e = rope(r#"{"partial_rotary_factor": 0.5}"#, PHI3)
            .unwrap_err()
            .to_string();
        assert!(e.contains("`partial_rotary_factor` = 0.5"), "{e}");
        let whole =
            r#"{"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 1.0}}"#;
        assert_eq!(rope(whole, PHI3).unwrap().scaling, RopeScaling::None);
    }
}
