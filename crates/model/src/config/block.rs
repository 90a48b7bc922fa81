//! What a decoder block does beyond the Llama graph: the MLP's activation, how attention
//! scales, caps and windows its logits, Gemma 2's extra norms, embedding scale and final
//! logit cap. Read from `config.json` ([`HfBlockSpec`]) or GGUF metadata
//! ([`BlockConfig::from_gguf`]) into one [`BlockConfig`].
//!
//! Sliding windows follow transformers 5, layer by layer:
//! - Mistral and Phi-3 slide every layer whenever `sliding_window` is set (they ignore
//!   `layer_types`);
//! - Qwen2 and Qwen3 slide only when `use_sliding_window` is true, on the layers that
//!   `layer_types` names `sliding_attention` (by default those from `max_window_layers` on);
//! - Gemma 2 slides the layers `layer_types` names (by default the even ones: 0, 2, …);
//! - Llama never slides.
//!
//! A GGUF file's `<arch>.attention.sliding_window` slides every layer, except Gemma 2's,
//! which alternate as llama.cpp runs them.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;
use tessera_kernels::attention::AttentionParams;

use super::{Architecture, invalid, refuse};
use crate::error::ModelError;
use crate::gguf::GgufFile;

/// The gated MLP's activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `silu(gate) · up` (SwiGLU).
    Silu,
    /// `gelu_tanh(gate) · up` (GeGLU with the tanh approximation, `gelu_pytorch_tanh`).
    GeluTanh,
}

/// The block's variations on the Llama graph.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockConfig {
    pub activation: Activation,
    /// Multiplies q·k: `1/√head_dim`, or Gemma 2's `query_pre_attn_scalar^-½`.
    pub attention_scale: f32,
    /// Gemma 2's cap on attention logits (`attn_logit_softcapping`).
    pub attn_softcap: Option<f32>,
    /// Gemma 2's cap on the output logits (`final_logit_softcapping`).
    pub final_softcap: Option<f32>,
    /// Multiplies the token embedding (Gemma: `√hidden_size`).
    pub embed_scale: Option<f32>,
    /// Gemma 2's RMSNorm of each branch's output before it joins the residual.
    pub post_norms: bool,
    /// Added to every RMSNorm weight at load. Gemma's HuggingFace checkpoints store `w` of
    /// `x̂ · (1 + w)`; its GGUF files store `1 + w` already.
    pub norm_offset: f32,
    /// Each layer's sliding attention window (`None`: the whole context).
    pub windows: Vec<Option<usize>>,
}

impl BlockConfig {
    /// How layer `l` attends.
    pub fn attention(&self, l: usize) -> AttentionParams {
        AttentionParams {
            scale: self.attention_scale,
            softcap: self.attn_softcap,
            window: self.windows.get(l).copied().flatten(),
        }
    }

    /// The shortest sliding window of any layer, if one slides.
    pub fn shortest_window(&self) -> Option<usize> {
        self.windows.iter().flatten().copied().min()
    }

    /// The block of a GGUF file of architecture `arch` (`arch_name` in its keys).
    pub(super) fn from_gguf(
        file: &GgufFile,
        arch: Architecture,
        arch_name: &str,
        shape: BlockShape,
    ) -> Result<BlockConfig, ModelError> {
        let key = |name: &str| format!("{arch_name}.{name}");
        let window = file
            .get_u64(&key("attention.sliding_window"))?
            .filter(|w| *w > 0)
            .map(|w| w as usize);
        if arch != Architecture::Gemma2 {
            return Ok(BlockConfig {
                windows: vec![window; shape.layers],
                ..BlockConfig::llama(shape)
            });
        }
        // llama.cpp's Gemma 2: 4096-token windows on even layers, caps 50 and 30 unless the
        // file says otherwise, and q scaled by 1/√head_dim except in the 46-layer 27B
        // model, whose query_pre_attn_scalar is hidden / heads (the file has no key for it).
        let window = Some(window.unwrap_or(4096));
        let scalar = if shape.layers == 46 {
            shape.hidden / shape.heads
        } else {
            shape.head_dim
        };
        Ok(BlockConfig {
            activation: Activation::GeluTanh,
            attention_scale: 1.0 / (scalar as f32).sqrt(),
            attn_softcap: Some(
                file.get_f32(&key("attn_logit_softcapping"))?
                    .unwrap_or(50.0),
            ),
            final_softcap: Some(
                file.get_f32(&key("final_logit_softcapping"))?
                    .unwrap_or(30.0),
            ),
            embed_scale: Some((shape.hidden as f32).sqrt()),
            post_norms: true,
            norm_offset: 0.0,
            windows: (0..shape.layers)
                .map(|l| window.filter(|_| l % 2 == 0))
                .collect(),
        })
    }

    /// The plain Llama block.
    fn llama(shape: BlockShape) -> BlockConfig {
        BlockConfig {
            activation: Activation::Silu,
            attention_scale: 1.0 / (shape.head_dim as f32).sqrt(),
            attn_softcap: None,
            final_softcap: None,
            embed_scale: None,
            post_norms: false,
            norm_offset: 0.0,
            windows: vec![None; shape.layers],
        }
    }
}

/// The sizes a block's defaults depend on.
#[derive(Clone, Copy, Debug)]
pub(super) struct BlockShape {
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub head_dim: usize,
}

/// The block's keys in `config.json` (transformers 4.x and 5.x).
#[derive(Debug, Default, Deserialize)]
pub(super) struct HfBlockSpec {
    hidden_act: Option<String>,
    /// Gemma 2's MLP reads this one (`hidden_act` is ignored there).
    hidden_activation: Option<String>,
    sliding_window: Option<u64>,
    /// Qwen2 and Qwen3 only slide when this is true.
    use_sliding_window: Option<bool>,
    max_window_layers: Option<usize>,
    layer_types: Option<Vec<String>>,
    query_pre_attn_scalar: Option<f64>,
    /// Absent: Gemma 2's default; `null`: no cap.
    #[serde(default, deserialize_with = "present")]
    attn_logit_softcapping: Option<Value>,
    #[serde(default, deserialize_with = "present")]
    final_logit_softcapping: Option<Value>,
}

/// A key that is present, `null` included (a plain `Option` reads `null` as absent).
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Value>, D::Error> {
    Value::deserialize(d).map(Some)
}

impl HfBlockSpec {
    pub(super) fn validate(
        &self,
        path: &Path,
        arch: Architecture,
        shape: BlockShape,
    ) -> Result<BlockConfig, ModelError> {
        let llama = BlockConfig::llama(shape);
        let windows = self.windows(path, arch, shape.layers)?;
        if arch != Architecture::Gemma2 {
            return Ok(BlockConfig {
                activation: activation(path, "hidden_act", self.hidden_act.as_deref())?,
                windows,
                ..llama
            });
        }
        let act_key = if self.hidden_activation.is_some() {
            "hidden_activation"
        } else {
            "hidden_act"
        };
        let act = self
            .hidden_activation
            .as_deref()
            .or(self.hidden_act.as_deref());
        let scalar = self.query_pre_attn_scalar.unwrap_or(256.0);
        if scalar <= 0.0 {
            return Err(invalid(path, "query_pre_attn_scalar", "must be positive"));
        }
        Ok(BlockConfig {
            activation: activation(path, act_key, Some(act.unwrap_or("gelu_pytorch_tanh")))?,
            attention_scale: scalar.powf(-0.5) as f32,
            attn_softcap: softcap(
                path,
                "attn_logit_softcapping",
                &self.attn_logit_softcapping,
                50.0,
            )?,
            final_softcap: softcap(
                path,
                "final_logit_softcapping",
                &self.final_logit_softcapping,
                30.0,
            )?,
            embed_scale: Some((shape.hidden as f32).sqrt()),
            post_norms: true,
            norm_offset: 1.0,
            windows,
        })
    }

    /// Each layer's window, by the rules in the module doc.
    fn windows(
        &self,
        path: &Path,
        arch: Architecture,
        layers: usize,
    ) -> Result<Vec<Option<usize>>, ModelError> {
        let window = match arch {
            Architecture::Llama => None,
            Architecture::Mistral | Architecture::Phi3 => self.sliding_window,
            Architecture::Qwen2 | Architecture::Qwen3 => self
                .sliding_window
                .filter(|_| self.use_sliding_window == Some(true)),
            Architecture::Gemma2 => Some(self.sliding_window.unwrap_or(4096)),
        };
        let Some(window) = window else {
            return Ok(vec![None; layers]);
        };
        if window == 0 {
            return Err(invalid(path, "sliding_window", "must be greater than 0"));
        }
        let window = Some(window as usize);
        let types = match (&self.layer_types, arch) {
            (_, Architecture::Mistral | Architecture::Phi3) => return Ok(vec![window; layers]),
            (Some(types), _) => types,
            (None, Architecture::Gemma2) => {
                return Ok((0..layers).map(|l| window.filter(|_| l % 2 == 0)).collect());
            }
            (None, _) => {
                let first = self.max_window_layers.unwrap_or(28);
                return Ok((0..layers).map(|l| window.filter(|_| l >= first)).collect());
            }
        };
        if types.len() != layers {
            return Err(invalid(
                path,
                "layer_types",
                format!("names {} layers; the model has {layers}", types.len()),
            ));
        }
        types
            .iter()
            .map(|t| match t.as_str() {
                "sliding_attention" => Ok(window),
                "full_attention" => Ok(None),
                other => Err(refuse::unsupported(
                    path,
                    "layer_types",
                    other.into(),
                    "sliding_attention, full_attention",
                )),
            })
            .collect()
    }
}

fn activation(path: &Path, key: &str, name: Option<&str>) -> Result<Activation, ModelError> {
    match name {
        // transformers maps both names to the same SiLU.
        None | Some("silu") | Some("swish") => Ok(Activation::Silu),
        Some("gelu_pytorch_tanh") => Ok(Activation::GeluTanh),
        Some(other) => Err(refuse::unsupported(
            path,
            key,
            other.into(),
            "silu, gelu_pytorch_tanh",
        )),
    }
}

/// A soft cap: `default` when the key is absent, none when it is `null`.
fn softcap(
    path: &Path,
    key: &str,
    value: &Option<Value>,
    default: f32,
) -> Result<Option<f32>, ModelError> {
    match value {
        None => Ok(Some(default)),
        Some(Value::Null) => Ok(None),
        Some(v) => match v.as_f64() {
            Some(cap) if cap > 0.0 => Ok(Some(cap as f32)),
            _ => Err(invalid(
                path,
                key,
                format!("must be a positive number, got {v}"),
            )),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: BlockShape = BlockShape {
        layers: 4,
        hidden: 64,
        heads: 4,
        head_dim: 16,
    };

    fn block(arch: Architecture, json: &str) -> Result<BlockConfig, ModelError> {
        let spec: HfBlockSpec = serde_json::from_str(json).unwrap();
        spec.validate(Path::new("config.json"), arch, SHAPE)
    }

    fn windows(arch: Architecture, json: &str) -> Vec<Option<usize>> {
        block(arch, json).unwrap().windows
    }

    #[test]
    fn windows_follow_each_architecture_rule() {
        use Architecture::*;
        let w = Some(16);
        let off = r#"{"sliding_window": 16, "use_sliding_window": false}"#;
        assert_eq!(windows(Qwen2, off), vec![None; 4]);
        let on = r#"{"sliding_window": 16, "use_sliding_window": true, "max_window_layers": 2}"#;
        assert_eq!(windows(Qwen2, on), vec![None, None, w, w]);
        assert_eq!(windows(Qwen3, on), vec![None, None, w, w]);
        let typed = r#"{"sliding_window": 16, "use_sliding_window": true,
            "layer_types": ["full_attention", "sliding_attention", "full_attention", "full_attention"]}"#;
        assert_eq!(windows(Qwen2, typed), vec![None, w, None, None]);
        // Mistral and Phi-3 slide every layer, whatever layer_types says.
        assert_eq!(windows(Mistral, typed), vec![w; 4]);
        assert_eq!(windows(Phi3, typed), vec![w; 4]);
        assert_eq!(windows(Phi3, r#"{"sliding_window": null}"#), vec![None; 4]);
        assert_eq!(
            windows(Mistral, r#"{"sliding_window": null}"#),
            vec![None; 4]
        );
        assert_eq!(windows(Llama, r#"{"sliding_window": 16}"#), vec![None; 4]);
        assert_eq!(
            windows(Gemma2, r#"{"sliding_window": 16}"#),
            vec![w, None, w, None]
        );
        assert_eq!(windows(Gemma2, typed), vec![None, w, None, None]);
    }

    #[test]
    fn bad_layer_types_and_activations_are_refused_by_name() {
        let short = r#"{"sliding_window": 16, "layer_types": ["full_attention"]}"#;
        let e = block(Architecture::Gemma2, short).unwrap_err().to_string();
        assert!(
            e.contains("layer_types") && e.contains("names 1 layers"),
            "{e}"
        );
        let odd = r#"{"sliding_window": 16, "layer_types": ["chunked_attention", "full_attention",
            "full_attention", "full_attention"]}"#;
        let e = block(Architecture::Gemma2, odd).unwrap_err().to_string();
        assert!(e.contains("chunked_attention"), "{e}");
        let e = block(Architecture::Llama, r#"{"hidden_act": "relu"}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("hidden_act") && e.contains("relu"), "{e}");
        let e = block(Architecture::Gemma2, r#"{"hidden_activation": "gelu"}"#)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("hidden_activation") && e.contains("gelu_pytorch_tanh"),
            "{e}"
        );
    }

    #[test]
    fn gemma2_defaults_and_null_caps_follow_transformers() {
        let b = block(Architecture::Gemma2, "{}").unwrap();
        assert_eq!(b.activation, Activation::GeluTanh);
        assert_eq!((b.attn_softcap, b.final_softcap), (Some(50.0), Some(30.0)));
        assert_eq!(b.attention_scale, 1.0 / 16.0);
        assert_eq!(b.embed_scale, Some(8.0));
        assert_eq!(b.windows[0], Some(4096));
        let b = block(
            Architecture::Gemma2,
            r#"{"final_logit_softcapping": null, "query_pre_attn_scalar": 64}"#,
        )
        .unwrap();
        assert_eq!((b.attn_softcap, b.final_softcap), (Some(50.0), None));
        assert_eq!(b.attention_scale, 0.125);
    }
}
