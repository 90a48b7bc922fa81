//! The models the API serves: their tokenizers, chat templates and limits, read from each
//! model's files (metadata only: the coordinator runs no layers), as the topology in force
//! names them. [`follow`] loads the models an applied topology adds and drops the ones it
//! removes; `/ready` does not wait for a model added that way until it has been ready
//! once ([`ServedModels::lets_ready`]).

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{SystemTime, UNIX_EPOCH};

use tessera_model::ModelError;
use tessera_model::chat::ChatTemplate;
use tessera_model::loader;
use tessera_model::tokenizer::Tokenizer;
use tessera_topology::{Model, Topology};
use tracing::{info, warn};

use crate::live::LiveTopology;

/// A model the API serves, with what validation needs to know of it.
#[derive(Clone, Debug)]
pub struct ServedModel {
    /// The topology's model name: the `model` field of requests.
    pub name: String,
    /// `None`: prompts must be token ids and responses carry no text.
    pub tokenizer: Option<Arc<Tokenizer>>,
    /// `None`: the model has no chat template and chat completions answer 400.
    pub chat_template: Option<Arc<ChatTemplate>>,
    /// Ids that end generation unless the request sets `ignore_eos`.
    pub eos_token_ids: Vec<u32>,
    /// Prompt plus completion tokens one sequence may hold.
    pub context_tokens: usize,
    /// Token ids run from 0 to `vocab_size - 1`.
    pub vocab_size: usize,
    /// Unix seconds, for the model object's `created`.
    pub created: u64,
}

/// The served models, replaced as topologies are applied.
#[derive(Debug, Default)]
pub struct ServedModels {
    /// Looked up by name; the first of two with the same name wins.
    models: RwLock<Arc<Vec<ServedModel>>>,
    /// Added after this peer started and not ready yet.
    warming: Mutex<BTreeSet<String>>,
}

impl ServedModels {
    pub fn new(models: Vec<ServedModel>) -> ServedModels {
        ServedModels {
            models: RwLock::new(Arc::new(models)),
            warming: Mutex::default(),
        }
    }

    pub fn all(&self) -> Arc<Vec<ServedModel>> {
        Arc::clone(&self.models.read().unwrap_or_else(PoisonError::into_inner))
    }

    pub fn get(&self, name: &str) -> Option<ServedModel> {
        self.all().iter().find(|m| m.name == name).cloned()
    }

    /// Serves `models` from now on; those not served before are warming.
    pub fn replace(&self, models: Vec<ServedModel>) {
        let before = self.all();
        let mut warming = self.warming.lock().unwrap_or_else(PoisonError::into_inner);
        warming.retain(|name| models.iter().any(|m| &m.name == name));
        let added = models
            .iter()
            .filter(|m| !before.iter().any(|b| b.name == m.name));
        warming.extend(added.map(|m| m.name.clone()));
        *self.models.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(models);
    }

    /// Whether model `name`, `ready` or not now, lets `/ready` answer 200: when ready,
    /// or while it warms (added after start, never ready yet). A model served since start
    /// holds `/ready` back whenever it is not ready; one added later, once it has been.
    pub fn lets_ready(&self, name: &str, ready: bool) -> bool {
        let mut warming = self.warming.lock().unwrap_or_else(PoisonError::into_inner);
        if ready {
            warming.remove(name);
            return true;
        }
        warming.contains(name)
    }
}

/// Reads what the API needs of `model` from its files.
pub fn load(model: &Model) -> Result<ServedModel, ModelError> {
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let meta = loader::load_metadata(&model.path)?;
    let mut eos_token_ids = meta.config.eos_token_ids.clone();
    if let Some(t) = &meta.tokenizer {
        eos_token_ids.extend(t.eos_token_ids());
    }
    eos_token_ids.sort_unstable();
    eos_token_ids.dedup();
    let chat_template = meta.tokenizer.as_ref().and_then(|t| {
        ChatTemplate::from_tokenizer(t)
            .map_err(|error| {
                // Completions still work; chat answers 400 for this model.
                warn!(model = %model.name, %error, "chat template does not compile");
            })
            .ok()
            .flatten()
            .map(Arc::new)
    });
    Ok(ServedModel {
        name: model.name.clone(),
        context_tokens: meta.config.max_position_embeddings,
        vocab_size: meta.config.vocab_size,
        tokenizer: meta.tokenizer.map(Arc::new),
        chat_template,
        eos_token_ids,
        created,
    })
}

/// Keeps `models` the models of the topology in force: those it adds are loaded (a model
/// whose files this peer cannot read is left out, with a warning), those it drops go.
/// Must run inside a tokio runtime; ends when `live` has no sender left.
pub async fn follow(live: LiveTopology, models: Arc<ServedModels>) {
    let mut changes = live.subscribe();
    loop {
        let topology: Arc<Topology> = changes.borrow_and_update().clone();
        let before = models.all();
        let mut next = Vec::with_capacity(topology.models.len());
        for model in &topology.models {
            if let Some(kept) = before.iter().find(|m| m.name == model.name) {
                next.push(kept.clone());
                continue;
            }
            let read = {
                let model = model.clone();
                tokio::task::spawn_blocking(move || load(&model)).await
            };
            match read {
                Ok(Ok(served)) => {
                    info!(model = %model.name, "model added");
                    next.push(served);
                }
                Ok(Err(error)) => warn!(model = %model.name, %error, "model files unreadable"),
                Err(error) => warn!(model = %model.name, %error, "reading the model failed"),
            }
        }
        models.replace(next);
        if changes.changed().await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(name: &str) -> ServedModel {
        ServedModel {
            name: name.into(),
            tokenizer: None,
            chat_template: None,
            eos_token_ids: Vec::new(),
            context_tokens: 64,
            vocab_size: 8,
            created: 0,
        }
    }

    #[test]
    fn a_model_added_later_counts_for_readiness_once_it_was_ready() {
        let models = ServedModels::new(vec![model("a")]);
        assert!(
            !models.lets_ready("a", false),
            "served from the start: waited for"
        );
        models.replace(vec![model("a"), model("b")]);
        assert_eq!(models.get("b").map(|m| m.name), Some("b".into()));
        assert!(
            models.lets_ready("b", false),
            "still loading: not waited for"
        );
        assert!(models.lets_ready("b", true));
        assert!(
            !models.lets_ready("b", false),
            "ready once: counted from now on"
        );
        models.replace(vec![model("b")]);
        assert!(models.get("a").is_none());
    }
}
