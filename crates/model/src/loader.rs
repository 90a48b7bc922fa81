//! Opens a model path — a HuggingFace directory or a GGUF file — into a runnable model
//! with its tokenizer and chat template when the checkpoint has them.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::chat::ChatTemplate;
use crate::config::{ModelConfig, is_gguf_path};
use crate::error::ModelError;
use crate::gguf::GgufFile;
use crate::gguf_source::GgufSource;
use crate::llama::Llama;
use crate::safetensors_source::SafetensorsSource;
use crate::tokenizer::Tokenizer;

/// A model ready to generate.
#[derive(Debug)]
pub struct LoadedModel {
    pub path: PathBuf,
    pub llama: Llama,
    pub tokenizer: Option<Tokenizer>,
    pub chat_template: Option<ChatTemplate>,
}

impl LoadedModel {
    /// Tokens that end generation: the config's EOS ids and the tokenizer's end-of-turn ids.
    pub fn eos_token_ids(&self) -> Vec<u32> {
        let mut ids = self.llama.config().eos_token_ids.clone();
        if let Some(t) = &self.tokenizer {
            ids.extend(t.eos_token_ids());
        }
        ids.sort_unstable();
        ids.dedup();
        ids
    }
}

/// Loads the weights only (no tokenizer): enough for token-id driven runs and tests.
pub fn load_weights(path: &Path) -> Result<Llama, ModelError> {
    if is_gguf_path(path) {
        let file = Arc::new(GgufFile::open(path)?);
        let config = ModelConfig::from_gguf(&file)?;
        return Llama::load(&GgufSource::new(file), config);
    }
    let config = ModelConfig::from_path(path)?;
    Llama::load(&SafetensorsSource::open(path)?, config)
}

/// Loads weights, tokenizer and chat template of the model at `path`.
pub fn load(path: &Path) -> Result<LoadedModel, ModelError> {
    let (llama, tokenizer) = if is_gguf_path(path) {
        let file = Arc::new(GgufFile::open(path)?);
        let config = ModelConfig::from_gguf(&file)?;
        let tokenizer = Tokenizer::from_gguf(&file).map_err(|e| tokenizer_error(path, e))?;
        (Llama::load(&GgufSource::new(file), config)?, tokenizer)
    } else {
        let config = ModelConfig::from_path(path)?;
        let llama = Llama::load(&SafetensorsSource::open(path)?, config)?;
        let tokenizer_path = path.join("tokenizer.json");
        let tokenizer = if tokenizer_path.exists() {
            Some(Tokenizer::from_file(&tokenizer_path).map_err(|e| tokenizer_error(path, e))?)
        } else {
            None
        };
        (llama, tokenizer)
    };
    let chat_template = match &tokenizer {
        Some(t) => ChatTemplate::from_tokenizer(t).map_err(|e| ModelError::Tokenizer {
            path: path.into(),
            message: format!("chat template: {e}"),
        })?,
        None => None,
    };
    Ok(LoadedModel {
        path: path.into(),
        llama,
        tokenizer,
        chat_template,
    })
}

fn tokenizer_error(path: &Path, e: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer {
        path: path.into(),
        message: e.to_string(),
    }
}
