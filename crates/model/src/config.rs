//! Model configuration: the Llama-family hyper-parameters, read from a HuggingFace
//! `config.json` (+ `generation_config.json`) or from GGUF metadata, and validated once.
//!
//! Raw file contents deserialize into `HfConfigSpec`; [`ModelConfig`] is the validated form
//! that the rest of Tessera uses.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use tessera_kernels::rope::{RopePairing, RopeScaling};
use tessera_topology::ModelShape;

use crate::error::ModelError;
use crate::gguf::GgufFile;

mod block;
mod quant;
mod refuse;
mod rope;

pub use block::{Activation, BlockConfig};

/// The decoder architectures Tessera runs. They share one forward pass and differ in
/// biases, tying, the per-head q/k norm, the block's variations ([`BlockConfig`]) and
/// defaults.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Mistral,
    Qwen2,
    /// Qwen2 without q/k/v biases, with an RMSNorm over every q and k head before RoPE.
    Qwen3,
    /// GeGLU, norms after each branch too, soft-capped logits, alternating sliding windows,
    /// a scaled embedding ([`BlockConfig`]).
    Gemma2,
    /// The Llama graph with q|k|v and gate|up fused in the checkpoint (split at load),
    /// LongRoPE, and a sliding window on every layer when set.
    Phi3,
}

/// Rotary position embedding settings.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeConfig {
    pub theta: f32,
    pub scaling: RopeScaling,
    pub pairing: RopePairing,
}

/// Validated model hyper-parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f32,
    pub rope: RopeConfig,
    /// q/k/v projections carry a bias (Qwen2).
    pub attention_bias: bool,
    /// The LM head reuses the token embedding.
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// What the block does beyond the Llama graph.
    pub block: BlockConfig,
}

impl ModelConfig {
    /// Reads the configuration of the model at `path`: a HuggingFace directory or a `.gguf` file.
    pub fn from_path(path: &Path) -> Result<ModelConfig, ModelError> {
        if is_gguf_path(path) {
            let file = GgufFile::open(path)?;
            return ModelConfig::from_gguf(&file);
        }
        if path.is_dir() {
            return ModelConfig::from_hf_dir(path);
        }
        if !path.exists() {
            return Err(ModelError::io(
                path,
                std::io::Error::new(std::io::ErrorKind::NotFound, "no such file or directory"),
            ));
        }
        Err(ModelError::UnknownFormat { path: path.into() })
    }

    /// Reads `config.json` and, if present, `generation_config.json` from a HuggingFace directory.
    pub fn from_hf_dir(dir: &Path) -> Result<ModelConfig, ModelError> {
        let path = dir.join("config.json");
        let spec: HfConfigSpec = read_json(&path)?;
        let mut config = spec.validate(&path)?;
        let generation = dir.join("generation_config.json");
        if generation.exists() {
            let value: Value = read_json(&generation)?;
            let eos = token_ids(value.get("eos_token_id"), &generation, "eos_token_id")?;
            if !eos.is_empty() {
                config.eos_token_ids = eos;
            }
            if let Some(bos) =
                token_ids(value.get("bos_token_id"), &generation, "bos_token_id")?.first()
            {
                config.bos_token_id = Some(*bos);
            }
        }
        Ok(config)
    }

    /// Reads the `<arch>.*` metadata of a GGUF file.
    pub fn from_gguf(file: &GgufFile) -> Result<ModelConfig, ModelError> {
        let path = file.path();
        let arch_name = file
            .get_str("general.architecture")?
            .ok_or_else(|| missing(path, "general.architecture"))?;
        let architecture = match arch_name {
            "llama" => Architecture::Llama,
            "mistral" => Architecture::Mistral,
            "qwen2" => Architecture::Qwen2,
            "qwen3" => Architecture::Qwen3,
            "gemma2" => Architecture::Gemma2,
            "phi3" => Architecture::Phi3,
            other => {
                return Err(refuse::unsupported(
                    path,
                    "general.architecture",
                    other.into(),
                    refuse::SUPPORTED_ARCHITECTURES,
                ));
            }
        };
        let key = |name: &str| format!("{arch_name}.{name}");
        let required = |name: &str| -> Result<usize, ModelError> {
            let k = key(name);
            Ok(file.get_u64(&k)?.ok_or_else(|| missing(path, &k))? as usize)
        };
        let hidden_size = required("embedding_length")?;
        let num_attention_heads = required("attention.head_count")?;
        let num_key_value_heads = file
            .get_u64(&key("attention.head_count_kv"))?
            .map_or(num_attention_heads, |v| v as usize);
        let head_dim = file
            .get_u64(&key("attention.key_length"))?
            .map(|v| v as usize)
            .unwrap_or(hidden_size / num_attention_heads.max(1));
        let vocab_size = match file.get_u64(&key("vocab_size"))? {
            Some(v) => v as usize,
            None => file
                .tensor("token_embd.weight")
                .map(|t| t.rows())
                .ok_or_else(|| missing(path, &key("vocab_size")))?,
        };
        let context = required("context_length")?;
        let scaling = rope::gguf_scaling(file, arch_name, head_dim, context)?;
        refuse::check_gguf(file, arch_name)?;
        let eos = file.get_u32("tokenizer.ggml.eos_token_id")?;
        let spec = HfConfigSpec {
            model_type: Some(arch_name.into()),
            architectures: None,
            hidden_size: Some(hidden_size),
            intermediate_size: Some(required("feed_forward_length")?),
            num_hidden_layers: Some(required("block_count")?),
            num_attention_heads: Some(num_attention_heads),
            num_key_value_heads: Some(num_key_value_heads),
            head_dim: Some(head_dim),
            vocab_size: Some(vocab_size),
            max_position_embeddings: Some(context),
            rms_norm_eps: file.get_f32(&key("attention.layer_norm_rms_epsilon"))?,
            rope: rope::HfRopeSpec::with_theta(file.get_f32(&key("rope.freq_base"))?),
            attention_bias: Some(file.tensor("blk.0.attn_q.bias").is_some()),
            tie_word_embeddings: Some(file.tensor("output.weight").is_none()),
            bos_token_id: file
                .get_u32("tokenizer.ggml.bos_token_id")?
                .map(Value::from),
            eos_token_id: eos.map(Value::from),
            features: refuse::HfFeatureSpec::default(),
            block: block::HfBlockSpec::default(),
        };
        let mut config = spec.validate(path)?;
        config.block = BlockConfig::from_gguf(file, architecture, arch_name, config.block_shape())?;
        config.rope.scaling = scaling;
        if architecture == Architecture::Llama || architecture == Architecture::Mistral {
            config.rope.pairing = RopePairing::Interleaved;
        }
        Ok(config)
    }

    /// q|k|v and gate|up are one tensor each in the checkpoint (Phi-3's `qkv_proj` and
    /// `gate_up_proj`), split into their parts at load.
    pub fn fused_projections(&self) -> bool {
        self.architecture == Architecture::Phi3
    }

    /// Every q and k head is RMS-normalized (weights of `head_dim`) between its projection
    /// and RoPE (Qwen3's `q_norm` / `k_norm`).
    pub fn qk_norm(&self) -> bool {
        self.architecture == Architecture::Qwen3
    }

    /// The sizes the block's defaults depend on.
    fn block_shape(&self) -> block::BlockShape {
        block::BlockShape {
            layers: self.num_hidden_layers,
            hidden: self.hidden_size,
            heads: self.num_attention_heads,
            head_dim: self.head_dim,
        }
    }

    /// Query heads per KV head (grouped-query attention).
    pub fn group_size(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }

    /// The hyper-parameters that decide how the model splits over a tensor-parallel group.
    pub fn shape(&self) -> ModelShape {
        ModelShape {
            num_attention_heads: self.num_attention_heads,
            num_key_value_heads: self.num_key_value_heads,
            intermediate_size: self.intermediate_size,
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            num_hidden_layers: self.num_hidden_layers,
        }
    }
}

/// True when `path` names a GGUF file (by extension).
pub fn is_gguf_path(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

fn missing(path: &Path, key: &str) -> ModelError {
    ModelError::MissingKey {
        path: path.into(),
        key: key.into(),
    }
}

fn invalid(path: &Path, key: &str, message: impl Into<String>) -> ModelError {
    ModelError::InvalidConfig {
        path: path.into(),
        key: key.into(),
        message: message.into(),
    }
}

/// Reads and parses a JSON file, naming the file in every error.
pub(crate) fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, ModelError> {
    let bytes = std::fs::read(path).map_err(|e| ModelError::io(path, e))?;
    serde_json::from_slice(&bytes).map_err(|source| ModelError::Json {
        path: path.into(),
        source,
    })
}

/// A token id field that may be absent, a number or a list of numbers.
fn token_ids(value: Option<&Value>, path: &Path, key: &str) -> Result<Vec<u32>, ModelError> {
    let as_id = |v: &Value| {
        v.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| invalid(path, key, format!("must be a token id, got {v}")))
    };
    match value {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(items)) => items.iter().map(as_id).collect(),
        Some(v) => Ok(vec![as_id(v)?]),
    }
}

/// `config.json` as written by transformers (4.x and 5.x field names).
#[derive(Debug, Deserialize)]
struct HfConfigSpec {
    model_type: Option<String>,
    architectures: Option<Vec<String>>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: Option<usize>,
    max_position_embeddings: Option<usize>,
    rms_norm_eps: Option<f32>,
    #[serde(flatten)]
    rope: rope::HfRopeSpec,
    attention_bias: Option<bool>,
    tie_word_embeddings: Option<bool>,
    bos_token_id: Option<Value>,
    eos_token_id: Option<Value>,
    #[serde(flatten)]
    features: refuse::HfFeatureSpec,
    #[serde(flatten)]
    block: block::HfBlockSpec,
}

impl HfConfigSpec {
    fn validate(self, path: &Path) -> Result<ModelConfig, ModelError> {
        let model_type = self
            .model_type
            .clone()
            .or_else(|| self.architectures.as_ref()?.first().cloned())
            .ok_or_else(|| missing(path, "model_type"))?;
        let architecture = match model_type.to_ascii_lowercase().as_str() {
            "llama" | "llamaforcausallm" => Architecture::Llama,
            "mistral" | "mistralforcausallm" => Architecture::Mistral,
            "qwen2" | "qwen2forcausallm" => Architecture::Qwen2,
            "qwen3" | "qwen3forcausallm" => Architecture::Qwen3,
            "gemma2" | "gemma2forcausallm" => Architecture::Gemma2,
            "phi3" | "phi3forcausallm" => Architecture::Phi3,
            _ => {
                let key = if self.model_type.is_some() {
                    "model_type"
                } else {
                    "architectures"
                };
                return Err(refuse::unsupported(
                    path,
                    key,
                    model_type,
                    refuse::SUPPORTED_ARCHITECTURES,
                ));
            }
        };
        refuse::check_classes(path, self.architectures.as_deref())?;
        self.features.check(path)?;
        let need = |v: Option<usize>, key: &str| -> Result<usize, ModelError> {
            match v {
                None => Err(missing(path, key)),
                Some(0) => Err(invalid(path, key, "must be greater than 0")),
                Some(n) => Ok(n),
            }
        };
        let hidden_size = need(self.hidden_size, "hidden_size")?;
        let num_attention_heads = need(self.num_attention_heads, "num_attention_heads")?;
        let num_key_value_heads = need(
            self.num_key_value_heads.or(Some(num_attention_heads)),
            "num_key_value_heads",
        )?;
        if num_attention_heads % num_key_value_heads != 0 {
            return Err(invalid(
                path,
                "num_key_value_heads",
                format!(
                    "= {num_key_value_heads} must divide num_attention_heads = {num_attention_heads}"
                ),
            ));
        }
        let head_dim = need(
            self.head_dim.or(Some(hidden_size / num_attention_heads)),
            "head_dim",
        )?;
        if head_dim % 2 != 0 {
            return Err(invalid(
                path,
                "head_dim",
                format!("= {head_dim} must be even for RoPE"),
            ));
        }
        let max_position_embeddings = self.max_position_embeddings.unwrap_or(4096);
        let rope = self.rope.validate(
            path,
            rope::RopeShape {
                arch: architecture,
                head_dim,
                max_position_embeddings,
            },
        )?;
        let eos_token_ids = token_ids(self.eos_token_id.as_ref(), path, "eos_token_id")?;
        let bos_token_id = token_ids(self.bos_token_id.as_ref(), path, "bos_token_id")?
            .first()
            .copied();
        let num_hidden_layers = need(self.num_hidden_layers, "num_hidden_layers")?;
        let shape = block::BlockShape {
            layers: num_hidden_layers,
            hidden: hidden_size,
            heads: num_attention_heads,
            head_dim,
        };
        Ok(ModelConfig {
            architecture,
            hidden_size,
            intermediate_size: need(self.intermediate_size, "intermediate_size")?,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            vocab_size: need(self.vocab_size, "vocab_size")?,
            max_position_embeddings,
            rms_norm_eps: self.rms_norm_eps.unwrap_or(1e-6),
            rope,
            // transformers' Phi-3 has no q/k/v bias, whatever the key says.
            attention_bias: self
                .attention_bias
                .unwrap_or(architecture == Architecture::Qwen2)
                && architecture != Architecture::Phi3,
            tie_word_embeddings: self
                .tie_word_embeddings
                .unwrap_or(architecture == Architecture::Gemma2),
            bos_token_id,
            eos_token_ids,
            block: self.block.validate(path, architecture, shape)?,
        })
    }
}
