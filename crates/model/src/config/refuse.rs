//! What a model file asks for that Tessera cannot run, refused at load with one
//! [`ModelError::Unsupported`] that names the file, the key and what is supported: mixtures of
//! experts, activations other than SiLU, MLP biases, pre-quantized HuggingFace checkpoints (FP8
//! and the like), rope scaling types other than linear and llama3, and model classes other than
//! the four causal LMs. A model is never run with a part of its config silently ignored.
//!
//! A sliding attention window is honoured instead of refused: the served context is cut to the
//! window, and over a sequence no longer than the window, sliding-window attention attends to
//! every earlier position, exactly as full attention does.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use super::Architecture;
use crate::error::ModelError;
use crate::gguf::GgufFile;

/// The architectures Tessera runs (`model_type` in `config.json`, `general.architecture` in GGUF).
pub(super) const SUPPORTED_ARCHITECTURES: &str = "llama, mistral, qwen2, qwen3";

/// The HuggingFace model classes Tessera runs (`architectures` in `config.json`).
const SUPPORTED_CLASSES: &str =
    "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM";

/// `config.json` keys that switch on features outside the dense Llama-family forward pass.
#[derive(Debug, Default, Deserialize)]
pub(super) struct HfFeatureSpec {
    hidden_act: Option<String>,
    mlp_bias: Option<bool>,
    /// Mixtral, Qwen2-MoE, DeepSeek spell the expert count three ways.
    num_local_experts: Option<u64>,
    num_experts: Option<u64>,
    n_routed_experts: Option<u64>,
    quantization_config: Option<Value>,
    sliding_window: Option<u64>,
    /// Qwen2 and Qwen3 only slide when this is true; Mistral slides whenever `sliding_window` is set.
    use_sliding_window: Option<bool>,
}

impl HfFeatureSpec {
    /// Refuses the first feature the forward pass would not honour.
    pub(super) fn check(&self, path: &Path) -> Result<(), ModelError> {
        if let Some(q) = self.quantization_config.as_ref().filter(|v| !v.is_null()) {
            let method = q.get("quant_method").and_then(Value::as_str);
            return Err(unsupported(
                path,
                "quantization_config",
                method.map_or_else(|| q.to_string(), |m| format!("quant_method {m}")),
                "float32, float16 or bfloat16 safetensors; for quantized weights use a GGUF file",
            ));
        }
        for (key, count) in [
            ("num_local_experts", self.num_local_experts),
            ("num_experts", self.num_experts),
            ("n_routed_experts", self.n_routed_experts),
        ] {
            if let Some(n) = count.filter(|n| *n > 0) {
                return Err(unsupported(
                    path,
                    key,
                    n.to_string(),
                    "dense models only (no mixture of experts)",
                ));
            }
        }
        if let Some(act) = self.hidden_act.as_deref() {
            // transformers maps both names to the same SiLU.
            if act != "silu" && act != "swish" {
                return Err(unsupported(path, "hidden_act", act.into(), "silu"));
            }
        }
        if self.mlp_bias == Some(true) {
            return Err(unsupported(path, "mlp_bias", "true".into(), "false"));
        }
        Ok(())
    }

    /// The attention window the config asks `arch` to slide, if any.
    pub(super) fn sliding_window(&self, arch: Architecture) -> Option<usize> {
        let slides = match arch {
            Architecture::Mistral => true,
            Architecture::Qwen2 | Architecture::Qwen3 => self.use_sliding_window == Some(true),
            Architecture::Llama => false,
        };
        self.sliding_window.filter(|_| slides).map(|w| w as usize)
    }
}

/// Refuses `architectures` entries other than the supported model classes.
pub(super) fn check_classes(path: &Path, classes: Option<&[String]>) -> Result<(), ModelError> {
    let supported: Vec<&str> = SUPPORTED_CLASSES.split(", ").collect();
    match classes
        .unwrap_or_default()
        .iter()
        .find(|c| !supported.contains(&c.as_str()))
    {
        Some(class) => Err(unsupported(
            path,
            "architectures",
            class.clone(),
            SUPPORTED_CLASSES,
        )),
        None => Ok(()),
    }
}

/// Refuses GGUF metadata of `arch_name` that the forward pass would not honour, and returns the
/// sliding window the file asks for, if any.
pub(super) fn check_gguf(file: &GgufFile, arch_name: &str) -> Result<Option<usize>, ModelError> {
    let path = file.path();
    let key = format!("{arch_name}.expert_count");
    if let Some(n) = file.get_u64(&key)?.filter(|n| *n > 0) {
        return Err(unsupported(
            path,
            &key,
            n.to_string(),
            "dense models only (no mixture of experts)",
        ));
    }
    let key = format!("{arch_name}.attention.sliding_window");
    Ok(file.get_u64(&key)?.filter(|w| *w > 0).map(|w| w as usize))
}

/// Cuts the served context to a sliding window shorter than it (see the module doc).
pub(super) fn honour_window(context_tokens: &mut usize, window: Option<usize>, path: &Path) {
    if let Some(w) = window.filter(|w| *w < *context_tokens) {
        tracing::info!(
            path = %path.display(),
            window_tokens = w,
            context_tokens = *context_tokens,
            "context cut to the sliding attention window"
        );
        *context_tokens = w;
    }
}

/// The one error for a feature Tessera cannot run.
pub(super) fn unsupported(path: &Path, key: &str, found: String, supported: &str) -> ModelError {
    ModelError::Unsupported {
        path: path.into(),
        key: key.into(),
        found,
        supported: supported.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(json: &str) -> HfFeatureSpec {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn qwen2_slides_only_when_asked() {
        let off = spec(r#"{"sliding_window": 16, "use_sliding_window": false}"#);
        assert_eq!(off.sliding_window(Architecture::Qwen2), None);
        let on = spec(r#"{"sliding_window": 16, "use_sliding_window": true}"#);
        assert_eq!(on.sliding_window(Architecture::Qwen2), Some(16));
        assert_eq!(on.sliding_window(Architecture::Qwen3), Some(16));
        assert_eq!(off.sliding_window(Architecture::Qwen3), None);
        let mistral = spec(r#"{"sliding_window": 16}"#);
        assert_eq!(mistral.sliding_window(Architecture::Mistral), Some(16));
        assert_eq!(mistral.sliding_window(Architecture::Llama), None);
        let null = spec(r#"{"sliding_window": null}"#);
        assert_eq!(null.sliding_window(Architecture::Mistral), None);
    }

    #[test]
    fn honour_window_only_shortens() {
        let path = Path::new("config.json");
        let mut context = 128;
        honour_window(&mut context, Some(4096), path);
        assert_eq!(context, 128);
        honour_window(&mut context, Some(16), path);
        assert_eq!(context, 16);
    }
}
