//! Opens a model path — a HuggingFace directory or a GGUF file — into a runnable model
//! with its tokenizer and chat template when the checkpoint has them.
//!
//! - [`load`]: weights + tokenizer + chat template (one process, tp = 1).
//! - [`load_weights`]: the whole model's weights; [`load_rank`]: one tensor-parallel
//!   rank's slice of them (the shard).
//! - [`load_metadata`]: config, tokenizer and chat template without the weights (the
//!   coordinator, which tokenizes but runs no layers).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tessera_topology::RankPlan;

use crate::chat::ChatTemplate;
use crate::config::{ModelConfig, is_gguf_path};
use crate::error::ModelError;
use crate::gguf::GgufFile;
use crate::gguf_source::GgufSource;
use crate::llama::{Llama, LoadProgress};
use crate::safetensors_source::SafetensorsSource;
use crate::tokenizer::Tokenizer;
use crate::weights::TensorSource;

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

/// What a model path says about the model, without its weights.
#[derive(Debug)]
pub struct ModelMeta {
    pub path: PathBuf,
    pub config: ModelConfig,
    pub tokenizer: Option<Tokenizer>,
    pub chat_template: Option<ChatTemplate>,
}

/// A model path opened for reading: its config, and the parsed GGUF file when it is one
/// (opening maps the file and reads its header, not its tensors).
struct Opened {
    config: ModelConfig,
    gguf: Option<Arc<GgufFile>>,
}

fn open(path: &Path) -> Result<Opened, ModelError> {
    if is_gguf_path(path) {
        let file = Arc::new(GgufFile::open(path)?);
        let config = ModelConfig::from_gguf(&file)?;
        return Ok(Opened {
            config,
            gguf: Some(file),
        });
    }
    Ok(Opened {
        config: ModelConfig::from_path(path)?,
        gguf: None,
    })
}

impl Opened {
    fn source(&self, path: &Path) -> Result<Box<dyn TensorSource>, ModelError> {
        Ok(match &self.gguf {
            Some(file) => Box::new(GgufSource::new(Arc::clone(file))),
            None => Box::new(SafetensorsSource::open(path)?),
        })
    }

    fn meta(self, path: &Path) -> Result<ModelMeta, ModelError> {
        let tokenizer = match &self.gguf {
            Some(file) => Tokenizer::from_gguf(file).map_err(|e| tokenizer_error(path, e))?,
            None => {
                let tokenizer_path = path.join("tokenizer.json");
                if tokenizer_path.exists() {
                    Some(
                        Tokenizer::from_file(&tokenizer_path)
                            .map_err(|e| tokenizer_error(path, e))?,
                    )
                } else {
                    None
                }
            }
        };
        let chat_template = match &tokenizer {
            Some(t) => ChatTemplate::from_tokenizer(t).map_err(|e| ModelError::Tokenizer {
                path: path.into(),
                message: format!("chat template: {e}"),
            })?,
            None => None,
        };
        Ok(ModelMeta {
            path: path.into(),
            config: self.config,
            tokenizer,
            chat_template,
        })
    }
}

/// Loads the weights only (no tokenizer): enough for token-id driven runs and tests.
pub fn load_weights(path: &Path) -> Result<Llama, ModelError> {
    let opened = open(path)?;
    let source = opened.source(path)?;
    Llama::load(source.as_ref(), opened.config)
}

/// Loads one tensor-parallel rank's slice of the weights (no tokenizer): `plan` is this
/// rank's entry of `plan_group(tp, config.shape())`.
pub fn load_rank(path: &Path, plan: &RankPlan, tp: usize) -> Result<Llama, ModelError> {
    load_rank_with_progress(path, plan, tp, &mut |_| {})
}

/// [`load_rank`], reporting after each layer.
pub fn load_rank_with_progress(
    path: &Path,
    plan: &RankPlan,
    tp: usize,
    progress: &mut dyn FnMut(LoadProgress),
) -> Result<Llama, ModelError> {
    let opened = open(path)?;
    let source = opened.source(path)?;
    Llama::load_rank_with_progress(source.as_ref(), opened.config, plan, tp, progress)
}

/// Reads config, tokenizer and chat template of the model at `path`; no weight is read.
pub fn load_metadata(path: &Path) -> Result<ModelMeta, ModelError> {
    open(path)?.meta(path)
}

/// Loads weights, tokenizer and chat template of the model at `path`.
pub fn load(path: &Path) -> Result<LoadedModel, ModelError> {
    let opened = open(path)?;
    let llama = Llama::load(opened.source(path)?.as_ref(), opened.config.clone())?;
    let meta = opened.meta(path)?;
    Ok(LoadedModel {
        path: meta.path,
        llama,
        tokenizer: meta.tokenizer,
        chat_template: meta.chat_template,
    })
}

fn tokenizer_error(path: &Path, e: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer {
        path: path.into(),
        message: e.to_string(),
    }
}
