//! What a model file asks for that Tessera cannot run, refused at load with one
//! [`ModelError::Unsupported`] that names the file, the key and what is supported: mixtures of
//! experts, MLP biases, and model classes other than the causal LMs Tessera runs
//! (activations and layer types are refused in `block`; rope scalings other than linear,
//! llama3 and LongRoPE, and partial rotary embeddings, in `rope`; pre-quantized checkpoints
//! other than FP8 in `quant`). A model is never run with a part of its config silently
//! ignored.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use crate::error::ModelError;
use crate::gguf::GgufFile;

/// The architectures Tessera runs (`model_type` in `config.json`, `general.architecture` in GGUF).
pub(super) const SUPPORTED_ARCHITECTURES: &str = "llama, mistral, qwen2, qwen3, gemma2, phi3";

/// The HuggingFace model classes Tessera runs (`architectures` in `config.json`).
const SUPPORTED_CLASSES: &str = "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, \
                                 Qwen3ForCausalLM, Gemma2ForCausalLM, Phi3ForCausalLM";

/// `config.json` keys that switch on features outside the dense Llama-family forward pass.
#[derive(Debug, Default, Deserialize)]
pub(super) struct HfFeatureSpec {
    mlp_bias: Option<bool>,
    /// Mixtral, Qwen2-MoE, DeepSeek spell the expert count three ways.
    num_local_experts: Option<u64>,
    num_experts: Option<u64>,
    n_routed_experts: Option<u64>,
    quantization_config: Option<Value>,
}

impl HfFeatureSpec {
    /// Refuses the first feature the forward pass would not honour.
    pub(super) fn check(&self, path: &Path) -> Result<(), ModelError> {
        if let Some(q) = self.quantization_config.as_ref().filter(|v| !v.is_null()) {
            super::quant::check(path, q)?;
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
        if self.mlp_bias == Some(true) {
            return Err(unsupported(path, "mlp_bias", "true".into(), "false"));
        }
        Ok(())
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

/// Refuses GGUF metadata of `arch_name` that the forward pass would not honour.
pub(super) fn check_gguf(file: &GgufFile, arch_name: &str) -> Result<(), ModelError> {
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
    Ok(())
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
