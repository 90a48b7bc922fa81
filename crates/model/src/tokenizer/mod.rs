//! The tokenizer: text to token ids and back, for HuggingFace `tokenizer.json` files and for the
//! vocabularies GGUF files carry.
//!
//! [`Tokenizer`] wraps a `tokenizers::Tokenizer` and adds what serving needs beside it: the BOS
//! and end-of-sequence ids, whether encoding adds BOS, and the chat template source. It is built
//! either by [`Tokenizer::from_file`] (a `tokenizer.json`, with `tokenizer_config.json`,
//! `chat_template.jinja` and `generation_config.json` read from beside it when present), by
//! [`Tokenizer::from_gguf`] (a GGUF file's `tokenizer.ggml.*` metadata) or by
//! [`Tokenizer::from_gguf_vocab`] (that metadata as a plain [`GgufVocab`]). [`DecodeStream`]
//! turns ids into text one id at a time for streaming.
//!
//! HuggingFace transformers is the reference, and golden tests
//! (`crates/model/tests/tokenizer_golden.rs`) hold this module to its ids and decodes. The rules
//! follow transformers v5:
//! - `tokenizer.json` decides what `encode(.., add_special_tokens = true)` adds: its
//!   post-processor (a BOS template or not). `add_bos_token` / `add_eos_token` in
//!   `tokenizer_config.json` are ignored when a `tokenizer.json` exists, as transformers does.
//! - The named special tokens of `tokenizer_config.json` (bos, eos, unk, pad, and the
//!   additional/extra special tokens) are registered as special tokens if `tokenizer.json` has
//!   not done so, so text that contains them is never split into pieces.
//! - `clean_up_tokenization_spaces` is not applied: transformers ignores it for BPE models, and
//!   every model family Tessera serves is BPE.
//!
//! End-of-sequence ids ([`Tokenizer::eos_token_ids`]) are, in order, without repeats: the eos
//! token; the `eos_token_id` entries of `generation_config.json` beside a `tokenizer.json`; and
//! each end-of-turn token of [`END_OF_TURN_TOKENS`] that the chat template mentions literally and
//! the vocabulary has (ChatML's `<|im_end|>` for a model whose eos is `<|endoftext|>`, Llama 3's
//! `<|eot_id|>`, Gemma's `<end_of_turn>`, ...). Generation stops at any of them.

mod gguf_vocab;
mod stream;

use std::fmt;
use std::path::{Path, PathBuf};

use serde_json::Value;
use tokenizers::AddedToken;

use crate::gguf::{GgufError, GgufFile};

pub use gguf_vocab::GgufVocab;
pub use stream::DecodeStream;

/// Tokens that end an assistant turn in the chat formats Tessera knows. Each counts as an
/// end-of-sequence token when the chat template writes it and the vocabulary has it.
pub const END_OF_TURN_TOKENS: &[&str] = &[
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<|return|>",
    "<|call|>",
];

/// Loading a tokenizer, encoding or decoding failed.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not valid JSON: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{path}: not a tokenizer the `tokenizers` library can load: {message}")]
    Load { path: PathBuf, message: String },
    #[error("{path}: `{key}` {message}")]
    Config {
        path: PathBuf,
        key: String,
        message: String,
    },
    #[error("GGUF tokenizer model `{model}` is not supported; supported: gpt2, llama")]
    UnsupportedModel { model: String },
    #[error("GGUF tokenizer: `{key}` {message}")]
    Vocab { key: String, message: String },
    #[error("{path}: `{key}` {message}")]
    GgufKey {
        path: PathBuf,
        key: String,
        message: String,
    },
    #[error("{source}")]
    GgufRead {
        #[source]
        source: GgufError,
    },
    #[error("cannot encode a text of {len_bytes} bytes: {message}")]
    Encode { len_bytes: usize, message: String },
    #[error("cannot decode {count} token ids: {message}")]
    Decode { count: usize, message: String },
    #[error("streaming decode at token {id}: the text {actual:?} does not extend {expected:?}")]
    StreamPrefix {
        id: u32,
        expected: String,
        actual: String,
    },
}

/// Text to token ids and back, with the special tokens serving needs.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos_token: Option<String>,
    eos_token: Option<String>,
    bos_token_id: Option<u32>,
    eos_token_ids: Vec<u32>,
    add_bos_token: bool,
    chat_template: Option<String>,
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("eos_token_ids", &self.eos_token_ids)
            .field("add_bos_token", &self.add_bos_token)
            .field("has_chat_template", &self.chat_template.is_some())
            .finish()
    }
}

/// What `tokenizer_config.json` (and the files beside it) add to a `tokenizer.json`.
#[derive(Debug, Default)]
struct SideConfig {
    bos_token: Option<String>,
    eos_token: Option<String>,
    /// unk, pad and the additional/extra special tokens.
    other_special: Vec<String>,
    chat_template: Option<String>,
    generation_eos_ids: Vec<u32>,
}

impl Tokenizer {
    /// Loads a HuggingFace `tokenizer.json` (`path` may also be the directory holding it), with
    /// `tokenizer_config.json`, `chat_template.jinja` and `generation_config.json` from the same
    /// directory when they exist.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, TokenizerError> {
        let path = path.as_ref();
        let json_path = if path.is_dir() {
            path.join("tokenizer.json")
        } else {
            path.to_path_buf()
        };
        let text = read_text(&json_path)?;
        let mut inner: tokenizers::Tokenizer =
            text.parse()
                .map_err(|e: tokenizers::Error| TokenizerError::Load {
                    path: json_path.clone(),
                    message: e.to_string(),
                })?;
        let dir = json_path.parent().unwrap_or(Path::new("."));
        let side = read_side_config(dir)?;
        let named = side
            .bos_token
            .iter()
            .chain(&side.eos_token)
            .chain(&side.other_special);
        let missing: Vec<AddedToken> = named
            .filter(|t| {
                !inner
                    .get_added_vocabulary()
                    .get_vocab()
                    .contains_key(t.as_str())
            })
            .map(|t| AddedToken::from(t.clone(), true).normalized(false))
            .collect();
        inner
            .add_special_tokens(missing)
            .map_err(|e| TokenizerError::Load {
                path: json_path.clone(),
                message: format!("cannot register the special tokens: {e}"),
            })?;
        let mut tokenizer = Tokenizer {
            bos_token_id: side.bos_token.as_deref().and_then(|t| inner.token_to_id(t)),
            inner,
            bos_token: side.bos_token,
            eos_token: side.eos_token,
            eos_token_ids: Vec::new(),
            add_bos_token: false,
            chat_template: side.chat_template,
        };
        tokenizer.add_bos_token = tokenizer.encode_adds_bos()?;
        let eos = tokenizer
            .eos_token
            .as_deref()
            .and_then(|t| tokenizer.token_to_id(t));
        tokenizer.eos_token_ids = tokenizer.collect_eos_ids(eos, &side.generation_eos_ids);
        Ok(tokenizer)
    }

    /// The tokenizer of a GGUF file; `None` when the file carries none. Errors name the file.
    pub fn from_gguf(file: &GgufFile) -> Result<Option<Self>, TokenizerError> {
        let Some(vocab) = GgufVocab::from_gguf(file)? else {
            return Ok(None);
        };
        Tokenizer::from_gguf_vocab(vocab)
            .map(Some)
            .map_err(|e| match e {
                TokenizerError::Vocab { key, message } => TokenizerError::GgufKey {
                    path: file.path().to_path_buf(),
                    key,
                    message,
                },
                TokenizerError::UnsupportedModel { model } => TokenizerError::GgufKey {
                    path: file.path().to_path_buf(),
                    key: "tokenizer.ggml.model".to_string(),
                    message: format!("is {model:?}; supported: gpt2, llama"),
                },
                other => other,
            })
    }

    /// Builds the tokenizer a GGUF file's metadata describes, as transformers does for the same
    /// file: byte-level BPE for `model = "gpt2"` (split regex chosen by `pre`), SentencePiece-style
    /// BPE with byte fallback for `model = "llama"` (merges recovered from the scores when the
    /// file has none); control tokens become special tokens, user-defined tokens added tokens.
    /// BOS is added when `add_bos_token` says so (default: yes for `llama`, no for `gpt2`).
    pub fn from_gguf_vocab(vocab: GgufVocab) -> Result<Self, TokenizerError> {
        let inner = gguf_vocab::build(&vocab)?;
        let bos_token = vocab.token(vocab.bos_token_id, "tokenizer.ggml.bos_token_id")?;
        let eos_token = vocab.token(vocab.eos_token_id, "tokenizer.ggml.eos_token_id")?;
        let mut tokenizer = Tokenizer {
            inner,
            bos_token: bos_token.map(str::to_string),
            eos_token: eos_token.map(str::to_string),
            bos_token_id: vocab.bos_token_id,
            eos_token_ids: Vec::new(),
            add_bos_token: vocab.adds_bos() && vocab.bos_token_id.is_some(),
            chat_template: vocab.chat_template,
        };
        tokenizer.eos_token_ids = tokenizer.collect_eos_ids(vocab.eos_token_id, &[]);
        Ok(tokenizer)
    }

    /// The token ids of `text`. With `add_special_tokens`, BOS (and EOS) are added as the
    /// tokenizer's source asks ([`Tokenizer::add_bos_token`]). Special tokens written in the text
    /// (`<|im_start|>`, ...) always become their ids.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(|e| TokenizerError::Encode {
                len_bytes: text.len(),
                message: e.to_string(),
            })?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The text of `ids`. Ids outside the vocabulary are skipped, as in `tokenizers`.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| TokenizerError::Decode {
                count: ids.len(),
                message: e.to_string(),
            })
    }

    /// A streaming decoder for one sequence (see [`DecodeStream`]).
    pub fn decode_stream(&self, skip_special_tokens: bool) -> DecodeStream {
        DecodeStream::new(skip_special_tokens)
    }

    /// The BOS token's id, whether or not encoding adds it.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token_id
    }

    /// The BOS token's text (`<s>`, `<|begin_of_text|>`, ...).
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// The EOS token's text.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// Every id that ends generation: see the module documentation for the rule.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    /// Whether `encode(.., add_special_tokens = true)` puts BOS first.
    pub fn add_bos_token(&self) -> bool {
        self.add_bos_token
    }

    /// The chat template's Jinja source, if the tokenizer's files have one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Number of ids, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The id of a token given as it is spelled in the vocabulary.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The vocabulary spelling of `id`.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The wrapped `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    fn encode_adds_bos(&self) -> Result<bool, TokenizerError> {
        let Some(bos) = self.bos_token_id else {
            return Ok(false);
        };
        Ok(self.encode("", true)?.first() == Some(&bos))
    }

    fn collect_eos_ids(&self, eos: Option<u32>, generation: &[u32]) -> Vec<u32> {
        let mut ids: Vec<u32> = Vec::new();
        let template = self.chat_template.as_deref().unwrap_or_default();
        let turn_ends = END_OF_TURN_TOKENS
            .iter()
            .filter(|t| template.contains(**t))
            .filter_map(|t| self.token_to_id(t));
        for id in eos
            .into_iter()
            .chain(generation.iter().copied())
            .chain(turn_ends)
        {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
        ids
    }
}

fn read_text(path: &Path) -> Result<String, TokenizerError> {
    std::fs::read_to_string(path).map_err(|source| TokenizerError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// Reads `name` in `dir` as JSON; `None` when the file does not exist.
fn read_json_beside(dir: &Path, name: &str) -> Result<Option<(PathBuf, Value)>, TokenizerError> {
    let path = dir.join(name);
    if !path.is_file() {
        return Ok(None);
    }
    let text = read_text(&path)?;
    let value = serde_json::from_str(&text).map_err(|source| TokenizerError::Json {
        path: path.clone(),
        source,
    })?;
    Ok(Some((path, value)))
}

fn read_side_config(dir: &Path) -> Result<SideConfig, TokenizerError> {
    let mut side = SideConfig::default();
    if let Some((path, config)) = read_json_beside(dir, "tokenizer_config.json")? {
        side.bos_token = token_text(&path, &config, "bos_token")?;
        side.eos_token = token_text(&path, &config, "eos_token")?;
        for key in ["unk_token", "pad_token"] {
            side.other_special.extend(token_text(&path, &config, key)?);
        }
        for key in ["additional_special_tokens", "extra_special_tokens"] {
            side.other_special.extend(token_list(&path, &config, key)?);
        }
        side.chat_template = chat_template_of(&path, &config)?;
    }
    let jinja = dir.join("chat_template.jinja");
    if jinja.is_file() {
        side.chat_template = Some(read_text(&jinja)?);
    }
    if let Some((path, config)) = read_json_beside(dir, "generation_config.json")? {
        side.generation_eos_ids = id_list(&path, &config, "eos_token_id")?;
    }
    Ok(side)
}

fn config_error(path: &Path, key: &str, message: &str) -> TokenizerError {
    TokenizerError::Config {
        path: path.to_path_buf(),
        key: key.to_string(),
        message: message.to_string(),
    }
}

/// A token named by `key`: a string, an `AddedToken` object (`{"content": ...}`), or null.
fn token_text(path: &Path, config: &Value, key: &str) -> Result<Option<String>, TokenizerError> {
    token_value(path, config.get(key).unwrap_or(&Value::Null), key)
}

fn token_value(path: &Path, value: &Value, key: &str) -> Result<Option<String>, TokenizerError> {
    match value {
        Value::Null => Ok(None),
        Value::String(s) => Ok(Some(s.clone())),
        Value::Object(map) => match map.get("content") {
            Some(Value::String(s)) => Ok(Some(s.clone())),
            _ => Err(config_error(
                path,
                key,
                "is an object without a string `content`",
            )),
        },
        _ => Err(config_error(
            path,
            key,
            "must be a string, an object or null",
        )),
    }
}

/// A list of tokens (or, in transformers v5's `extra_special_tokens`, a name-to-token map).
fn token_list(path: &Path, config: &Value, key: &str) -> Result<Vec<String>, TokenizerError> {
    let values: Vec<&Value> = match config.get(key) {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(items)) => items.iter().collect(),
        Some(Value::Object(map)) => map.values().collect(),
        Some(_) => return Err(config_error(path, key, "must be a list or a map of tokens")),
    };
    let mut tokens = Vec::new();
    for value in values {
        tokens.extend(token_value(path, value, key)?);
    }
    Ok(tokens)
}

/// `chat_template`: a string, or a list of `{name, template}` of which `default` (else the
/// first) is taken.
fn chat_template_of(path: &Path, config: &Value) -> Result<Option<String>, TokenizerError> {
    let key = "chat_template";
    match config.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(items)) => {
            let named = |item: &&Value| item.get("name").and_then(Value::as_str) == Some("default");
            let chosen = items.iter().find(named).or(items.first());
            match chosen.map(|item| item.get("template")) {
                None => Ok(None),
                Some(Some(Value::String(s))) => Ok(Some(s.clone())),
                Some(_) => Err(config_error(
                    path,
                    key,
                    "has an entry without a string `template`",
                )),
            }
        }
        Some(_) => Err(config_error(
            path,
            key,
            "must be a string or a list of named templates",
        )),
    }
}

/// An id or a list of ids.
fn id_list(path: &Path, config: &Value, key: &str) -> Result<Vec<u32>, TokenizerError> {
    let as_id = |v: &Value| v.as_u64().and_then(|n| u32::try_from(n).ok());
    match config.get(key) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| {
                as_id(v).ok_or_else(|| config_error(path, key, "has an entry that is not an id"))
            })
            .collect(),
        Some(v) => as_id(v)
            .map(|id| vec![id])
            .ok_or_else(|| config_error(path, key, "must be an id or a list of ids")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) {
        std::fs::write(dir.join(name), text).unwrap();
    }

    /// A word-level tokenizer.json small enough to write by hand.
    const TINY_JSON: &str = r#"{
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [{"id": 0, "content": "<eos>", "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"<eos>": 0, "<bos>": 1, "<|im_end|>": 2,
            "hello": 3, "<unk>": 4}, "unk_token": "<unk>"}
    }"#;

    #[test]
    fn side_files_set_specials_template_and_eos() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "tokenizer.json", TINY_JSON);
        write(
            dir.path(),
            "tokenizer_config.json",
            r#"{"bos_token": {"content": "<bos>"}, "eos_token": "<eos>",
                "chat_template": [{"name": "tool_use", "template": "x"},
                                  {"name": "default", "template": "{{ '<|im_end|>' }}"}]}"#,
        );
        write(
            dir.path(),
            "generation_config.json",
            r#"{"eos_token_id": [0, 4]}"#,
        );
        let tok = Tokenizer::from_file(dir.path()).unwrap();
        assert_eq!(tok.bos_token_id(), Some(1));
        assert!(!tok.add_bos_token());
        assert_eq!(tok.eos_token_ids(), &[0, 4, 2]);
        assert_eq!(tok.chat_template(), Some("{{ '<|im_end|>' }}"));
        // `<bos>` was registered as special, so decoding can skip it.
        assert_eq!(tok.decode(&[1, 3], true).unwrap(), "hello");

        write(dir.path(), "chat_template.jinja", "from the jinja file");
        let tok = Tokenizer::from_file(dir.path().join("tokenizer.json")).unwrap();
        assert_eq!(tok.chat_template(), Some("from the jinja file"));
        assert_eq!(tok.eos_token_ids(), &[0, 4]);
    }

    #[test]
    fn shared_across_threads() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<Tokenizer>();
        send_sync::<DecodeStream>();
        send_sync::<crate::chat::ChatTemplate>();
    }

    #[test]
    fn bad_config_names_file_and_key() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "tokenizer.json", TINY_JSON);
        write(dir.path(), "tokenizer_config.json", r#"{"eos_token": 7}"#);
        let err = Tokenizer::from_file(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains("tokenizer_config.json") && err.contains("eos_token"),
            "{err}"
        );
    }

    #[test]
    fn missing_and_corrupt_files_name_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let err = Tokenizer::from_file(dir.path()).unwrap_err().to_string();
        assert!(err.contains("tokenizer.json"), "{err}");
        write(dir.path(), "tokenizer.json", "{\"model\": 3}");
        let err = Tokenizer::from_file(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains("tokenizer.json") && err.contains("not a tokenizer"),
            "{err}"
        );
    }
}
