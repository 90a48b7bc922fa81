//! Tokenizers rebuilt from GGUF metadata.
//!
//! A GGUF file carries no `tokenizer.json`: it stores the vocabulary as `tokenizer.ggml.*` keys
//! in llama.cpp's layout. [`GgufVocab`] is those keys as a plain struct (so this module does not
//! depend on how the file is read), and [`build`] turns it into the `tokenizers::Tokenizer` that
//! HuggingFace transformers builds for the same file (its `integrations/gguf` tokenizer
//! conversion, which is the reference our golden tests compare against):
//!
//! - `model = "gpt2"`: byte-level BPE from `tokens` + `merges`. Tokens spelled outside the
//!   byte-level alphabet are respelled byte by byte. The split regex comes from
//!   `tokenizer.ggml.pre` (Llama-3, Qwen2, ...; GPT-2's otherwise). Control tokens (type 3)
//!   become special added tokens, user-defined tokens (type 4) plain added tokens, so neither is
//!   ever cut into pieces. Byte-level decoder.
//! - `model = "llama"`: SentencePiece-style BPE with byte fallback (`<0xNN>` tokens). When the
//!   file has no merges they are recovered from the scores the way transformers'
//!   `generate_merges` does (same order, so the same ties win). `▁` stands for a space; a `▁` is
//!   prepended to the text when `add_space_prefix` (default true) and stripped again on decode.
//!
//! Where this deliberately differs from transformers:
//! - `pre = "smollm"` (and the other llama.cpp pre-tokenizers that split digits one by one:
//!   `starcoder`, `refact`, `command-r`, `codeshell`, `exaone`, `minerva`) splits single digits
//!   before the byte-level step, as the model's own `tokenizer.json` and llama.cpp do;
//!   transformers skips that split. Both give the same ids for such vocabularies (no merge can
//!   join a digit to anything, since the vocabulary was learned with that split), which the
//!   SmolLM2 golden test checks on digit runs.
//! - A named special token (bos/eos/unk/pad) spelled outside the byte-level alphabet is not added
//!   a second time under a new id; its GGUF id is kept.

use std::cmp::Ordering;
use std::collections::{HashMap, HashSet};

use tokenizers::decoders::DecoderWrapper;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{BPE, Merges, Vocab};
use tokenizers::normalizers::replace::Replace;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
use tokenizers::pre_tokenizers::sequence::Sequence as PreSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use super::TokenizerError;
use crate::gguf::GgufFile;

/// llama.cpp token types (`tokenizer.ggml.token_type`).
const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// SentencePiece's stand-in for a space.
const SPM_SPACE: char = '\u{2581}';

/// Llama-3 split (`llama-bpe`, `llama3`, ...): needs look-ahead, hence fancy-regex.
const LLAMA3_SPLIT: &str = concat!(
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);

/// Qwen2 split: like Llama-3 but single digits.
const QWEN2_SPLIT: &str = concat!(
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);

/// Tekken (Mistral NeMo and later).
const TEKKEN_SPLIT: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*",
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);

/// GPT-4o / Llama-4 split.
const GPT4O_SPLIT: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);

/// The `tokenizer.ggml.*` and `tokenizer.chat_template` metadata of a GGUF file.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GgufVocab {
    /// `tokenizer.ggml.model`: `"gpt2"` (byte-level BPE) or `"llama"` (SentencePiece BPE).
    pub model: String,
    /// `tokenizer.ggml.pre`: llama.cpp's name for the pre-tokenizer (split regex).
    pub pre: Option<String>,
    /// `tokenizer.ggml.tokens`: the token text by id.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.scores`: SentencePiece scores by id.
    pub scores: Option<Vec<f32>>,
    /// `tokenizer.ggml.token_type`: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
    pub token_types: Option<Vec<i32>>,
    /// `tokenizer.ggml.merges`: `"left right"` pairs, best first.
    pub merges: Option<Vec<String>>,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    pub unknown_token_id: Option<u32>,
    pub padding_token_id: Option<u32>,
    pub add_bos_token: Option<bool>,
    pub add_eos_token: Option<bool>,
    pub add_space_prefix: Option<bool>,
    /// `tokenizer.chat_template`.
    pub chat_template: Option<String>,
}

impl GgufVocab {
    /// Reads the `tokenizer.ggml.*` and `tokenizer.chat_template` keys of `file`; `None` when the
    /// file has no tokenizer (no `tokenizer.ggml.model`).
    pub fn from_gguf(file: &GgufFile) -> Result<Option<GgufVocab>, TokenizerError> {
        let read = |e| TokenizerError::GgufRead { source: e };
        let Some(model) = file.get_str("tokenizer.ggml.model").map_err(read)? else {
            return Ok(None);
        };
        let strings = |key: &str| -> Result<Option<Vec<String>>, TokenizerError> {
            let items = file.get_str_array(key).map_err(read)?;
            Ok(items.map(|items| items.into_iter().map(str::to_string).collect()))
        };
        let Some(tokens) = strings("tokenizer.ggml.tokens")? else {
            return Err(TokenizerError::GgufKey {
                path: file.path().to_path_buf(),
                key: "tokenizer.ggml.tokens".to_string(),
                message: format!("is missing, though tokenizer.ggml.model is {model:?}"),
            });
        };
        let u32_key = |key: &str| file.get_u32(key).map_err(read);
        let bool_key = |key: &str| file.get_bool(key).map_err(read);
        Ok(Some(GgufVocab {
            model: model.to_string(),
            pre: file
                .get_str("tokenizer.ggml.pre")
                .map_err(read)?
                .map(str::to_string),
            tokens,
            scores: file.get_f32_array("tokenizer.ggml.scores").map_err(read)?,
            token_types: file
                .get_i32_array("tokenizer.ggml.token_type")
                .map_err(read)?,
            merges: strings("tokenizer.ggml.merges")?,
            bos_token_id: u32_key("tokenizer.ggml.bos_token_id")?,
            eos_token_id: u32_key("tokenizer.ggml.eos_token_id")?,
            unknown_token_id: u32_key("tokenizer.ggml.unknown_token_id")?,
            padding_token_id: u32_key("tokenizer.ggml.padding_token_id")?,
            add_bos_token: bool_key("tokenizer.ggml.add_bos_token")?,
            add_eos_token: bool_key("tokenizer.ggml.add_eos_token")?,
            add_space_prefix: bool_key("tokenizer.ggml.add_space_prefix")?,
            chat_template: file
                .get_str("tokenizer.chat_template")
                .map_err(read)?
                .map(str::to_string),
        }))
    }

    /// The token text of `id`, checked against the vocabulary; `key` names the metadata key the
    /// id came from.
    pub(crate) fn token(&self, id: Option<u32>, key: &str) -> Result<Option<&str>, TokenizerError> {
        let Some(id) = id else { return Ok(None) };
        match self.tokens.get(id as usize) {
            Some(token) => Ok(Some(token.as_str())),
            None => Err(TokenizerError::Vocab {
                key: key.to_string(),
                message: format!(
                    "token id {id} is out of range for a vocabulary of {} tokens",
                    self.tokens.len()
                ),
            }),
        }
    }

    /// Whether `encode(.., add_special_tokens = true)` prepends BOS. llama.cpp (and transformers)
    /// add it to a SentencePiece vocabulary that does not say otherwise.
    pub(crate) fn adds_bos(&self) -> bool {
        self.add_bos_token.unwrap_or(self.model == "llama")
    }

    fn token_types(&self) -> Result<&[i32], TokenizerError> {
        match &self.token_types {
            None => Ok(&[]),
            Some(types) if types.len() == self.tokens.len() => Ok(types),
            Some(types) => Err(TokenizerError::Vocab {
                key: "tokenizer.ggml.token_type".to_string(),
                message: format!(
                    "has {} entries but tokenizer.ggml.tokens has {}",
                    types.len(),
                    self.tokens.len()
                ),
            }),
        }
    }
}

/// Builds the tokenizer `vocab` describes.
pub(crate) fn build(vocab: &GgufVocab) -> Result<tokenizers::Tokenizer, TokenizerError> {
    if vocab.tokens.is_empty() {
        return Err(TokenizerError::Vocab {
            key: "tokenizer.ggml.tokens".to_string(),
            message: "is empty".to_string(),
        });
    }
    let mut tokenizer = match vocab.model.as_str() {
        "gpt2" => byte_level_tokenizer(vocab)?,
        "llama" => sentencepiece_tokenizer(vocab)?,
        other => {
            return Err(TokenizerError::UnsupportedModel {
                model: other.to_string(),
            });
        }
    };
    add_special_tokens(&mut tokenizer, vocab)?;
    tokenizer.with_post_processor(Some(post_processor(vocab)?));
    Ok(tokenizer)
}

fn build_error(key: &str, source: tokenizers::Error) -> TokenizerError {
    TokenizerError::Vocab {
        key: key.to_string(),
        message: source.to_string(),
    }
}

fn byte_level_tokenizer(vocab: &GgufVocab) -> Result<tokenizers::Tokenizer, TokenizerError> {
    let spelling = bytes_to_unicode();
    let alphabet: HashSet<char> = spelling.iter().copied().collect();
    let mut ids = Vocab::default();
    for (id, token) in vocab.tokens.iter().enumerate() {
        let key = if token.chars().all(|c| alphabet.contains(&c)) {
            token.clone()
        } else {
            token.bytes().map(|b| spelling[usize::from(b)]).collect()
        };
        ids.insert(key, id as u32);
    }
    let merges = parse_merges(vocab.merges.as_deref().unwrap_or_default())?;
    let model = BPE::builder()
        .vocab_and_merges(ids, merges)
        .continuing_subword_prefix(String::new())
        .end_of_word_suffix(String::new())
        .fuse_unk(false)
        .byte_fallback(false)
        .build()
        .map_err(|e| build_error("tokenizer.ggml.merges", e))?;
    let mut tokenizer = tokenizers::Tokenizer::new(model);
    tokenizer.with_pre_tokenizer(Some(byte_level_pre_tokenizer(vocab.pre.as_deref())?));
    tokenizer.with_decoder(Some(ByteLevel::new(true, true, true)));
    Ok(tokenizer)
}

/// The pre-tokenizer for llama.cpp's pre-tokenizer name `pre`.
fn byte_level_pre_tokenizer(pre: Option<&str>) -> Result<PreTokenizerWrapper, TokenizerError> {
    let split = match pre.unwrap_or("default") {
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" | "jina-v5-nano" | "dbrx" | "smaug-bpe" => Some(LLAMA3_SPLIT),
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" => Some(QWEN2_SPLIT),
        "tekken" => Some(TEKKEN_SPLIT),
        "gpt-4o" | "llama4" | "kanana2" | "minimax-m2" => Some(GPT4O_SPLIT),
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva" => {
            return Ok(PreSequence::new(vec![
                Digits::new(true).into(),
                ByteLevel::new(false, true, true).into(),
            ])
            .into());
        }
        other => {
            if !matches!(other, "default" | "gpt2" | "gpt-2") {
                tracing::debug!(
                    pre = other,
                    "unknown GGUF pre-tokenizer, using GPT-2's split"
                );
            }
            None
        }
    };
    Ok(match split {
        None => ByteLevel::new(false, true, true).into(),
        Some(pattern) => {
            let split = Split::new(
                SplitPattern::Regex(pattern.to_string()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|e| build_error("tokenizer.ggml.pre", e))?;
            PreSequence::new(vec![
                split.into(),
                ByteLevel::new(false, true, false).into(),
            ])
            .into()
        }
    })
}

fn sentencepiece_tokenizer(vocab: &GgufVocab) -> Result<tokenizers::Tokenizer, TokenizerError> {
    let mut ids = Vocab::default();
    for (id, token) in vocab.tokens.iter().enumerate() {
        ids.insert(token.clone(), id as u32);
    }
    let merges = match (&vocab.merges, &vocab.scores) {
        (Some(merges), _) => parse_merges(merges)?,
        (None, Some(scores)) if scores.len() == vocab.tokens.len() => {
            merges_from_scores(&vocab.tokens, scores)
        }
        (None, Some(scores)) => {
            return Err(TokenizerError::Vocab {
                key: "tokenizer.ggml.scores".to_string(),
                message: format!(
                    "has {} entries but tokenizer.ggml.tokens has {}",
                    scores.len(),
                    vocab.tokens.len()
                ),
            });
        }
        (None, None) => {
            return Err(TokenizerError::Vocab {
                key: "tokenizer.ggml.scores".to_string(),
                message: "is missing, and without merges a llama vocabulary needs it".to_string(),
            });
        }
    };
    let model = BPE::builder()
        .vocab_and_merges(ids, merges)
        .fuse_unk(true)
        .byte_fallback(true)
        .build()
        .map_err(|e| build_error("tokenizer.ggml.merges", e))?;
    let add_space_prefix = vocab.add_space_prefix.unwrap_or(true);
    let scheme = if add_space_prefix {
        PrependScheme::First
    } else {
        PrependScheme::Never
    };
    let space = Replace::new(SPM_SPACE.to_string(), " ")
        .map_err(|e| build_error("tokenizer.ggml.model", e))?;
    let mut decoders: Vec<DecoderWrapper> =
        vec![space.into(), ByteFallback::new().into(), Fuse::new().into()];
    if add_space_prefix {
        decoders.push(Strip::new(' ', 1, 0).into());
    }
    let mut tokenizer = tokenizers::Tokenizer::new(model);
    tokenizer.with_pre_tokenizer(Some(Metaspace::new(SPM_SPACE, scheme, false)));
    tokenizer.with_decoder(Some(DecoderSequence::new(decoders)));
    Ok(tokenizer)
}

/// `"left right"` strings into pairs.
fn parse_merges(merges: &[String]) -> Result<Merges, TokenizerError> {
    merges
        .iter()
        .enumerate()
        .map(|(index, merge)| {
            let mut parts = merge.split(' ');
            match (parts.next(), parts.next(), parts.next()) {
                (Some(left), Some(right), None) => Ok((left.to_string(), right.to_string())),
                _ => Err(TokenizerError::Vocab {
                    key: "tokenizer.ggml.merges".to_string(),
                    message: format!(
                        "entry {index} ({merge:?}) is not two tokens split by a space"
                    ),
                }),
            }
        })
        .collect()
}

/// Recovers BPE merges from a SentencePiece vocabulary, in the order transformers'
/// `generate_merges` gives them: every split of every token into two tokens of the vocabulary,
/// grouped by token in vocabulary order (within a token by the ids of the halves), then sorted
/// by the token's score, then by the halves' lengths in characters, all best first, with ties
/// kept in that order (a stable sort).
pub(crate) fn merges_from_scores(tokens: &[String], scores: &[f32]) -> Merges {
    // A repeated token: its last id counts, its first position, and its last score.
    let mut last_id: HashMap<&str, usize> = HashMap::with_capacity(tokens.len());
    for (id, token) in tokens.iter().enumerate() {
        last_id.insert(token.as_str(), id);
    }
    let mut order: Vec<&str> = Vec::with_capacity(tokens.len());
    let mut score_of: HashMap<&str, f32> = HashMap::with_capacity(tokens.len());
    for (token, score) in tokens.iter().zip(scores) {
        if score_of.insert(token.as_str(), *score).is_none() {
            order.push(token.as_str());
        }
    }
    let mut merges: Vec<(&str, &str, f32)> = Vec::new();
    for token in order {
        let score = score_of.get(token).copied().unwrap_or_default();
        let start = merges.len();
        for (at, _) in token.char_indices().skip(1) {
            let (left, right) = token.split_at(at);
            if last_id.contains_key(left) && last_id.contains_key(right) {
                merges.push((left, right, score));
            }
        }
        merges[start..].sort_by_key(|(left, right, _)| (last_id[left], last_id[right]));
    }
    let key = |m: &(&str, &str, f32)| (m.2, m.0.chars().count(), m.1.chars().count());
    merges.sort_by(|a, b| {
        let (a, b) = (key(a), key(b));
        b.0.partial_cmp(&a.0)
            .unwrap_or(Ordering::Equal)
            .then(b.1.cmp(&a.1))
            .then(b.2.cmp(&a.2))
    });
    merges
        .into_iter()
        .map(|(left, right, _)| (left.to_string(), right.to_string()))
        .collect()
}

/// GPT-2's byte-to-character table: printable bytes stand for themselves, the others are moved
/// to U+0100 and up, in byte order.
fn bytes_to_unicode() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for (byte, slot) in table.iter_mut().enumerate() {
        let b = byte as u32;
        let printable =
            (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
        let code = if printable {
            b
        } else {
            next += 1;
            next - 1
        };
        *slot = char::from_u32(code).unwrap_or('\0');
    }
    table
}

/// Control tokens as special added tokens, user-defined tokens as plain added tokens, and the
/// named bos/eos/unk/pad tokens as special, as transformers registers them.
fn add_special_tokens(
    tokenizer: &mut tokenizers::Tokenizer,
    vocab: &GgufVocab,
) -> Result<(), TokenizerError> {
    let types = vocab.token_types()?;
    let byte_level = vocab.model == "gpt2";
    let alphabet: HashSet<char> = bytes_to_unicode().into_iter().collect();
    let spelled = |token: &str| !byte_level || token.chars().all(|c| alphabet.contains(&c));
    let control: Vec<AddedToken> = vocab
        .tokens
        .iter()
        .zip(types)
        .filter(|(token, ty)| **ty == TOKEN_TYPE_CONTROL && spelled(token))
        .map(|(token, _)| AddedToken::from(token.clone(), true).normalized(false))
        .collect();
    let user: Vec<AddedToken> = vocab
        .tokens
        .iter()
        .zip(types)
        .filter(|(token, ty)| **ty == TOKEN_TYPE_USER_DEFINED && spelled(token))
        .map(|(token, _)| AddedToken::from(token.clone(), false).normalized(false))
        .collect();
    let add_error = |e| build_error("tokenizer.ggml.token_type", e);
    tokenizer.add_special_tokens(control).map_err(add_error)?;
    tokenizer.add_tokens(user).map_err(add_error)?;
    let named = [
        ("tokenizer.ggml.bos_token_id", vocab.bos_token_id),
        ("tokenizer.ggml.eos_token_id", vocab.eos_token_id),
        ("tokenizer.ggml.unknown_token_id", vocab.unknown_token_id),
        ("tokenizer.ggml.padding_token_id", vocab.padding_token_id),
    ];
    for (key, id) in named {
        let Some(token) = vocab.token(id, key)? else {
            continue;
        };
        let added = tokenizer.get_added_vocabulary().get_vocab();
        if spelled(token) && !added.contains_key(token) {
            let special = AddedToken::from(token.to_string(), true).normalized(false);
            tokenizer.add_special_tokens([special]).map_err(add_error)?;
        }
    }
    Ok(())
}

/// BOS and/or EOS around each sequence, as `add_bos_token` / `add_eos_token` ask.
fn post_processor(vocab: &GgufVocab) -> Result<TemplateProcessing, TokenizerError> {
    let bos_key = "tokenizer.ggml.bos_token_id";
    let eos_key = "tokenizer.ggml.eos_token_id";
    let bos = vocab.token(vocab.bos_token_id, bos_key)?;
    let eos = vocab.token(vocab.eos_token_id, eos_key)?;
    let bos = bos.filter(|_| vocab.adds_bos()).zip(vocab.bos_token_id);
    let eos = eos
        .filter(|_| vocab.add_eos_token == Some(true))
        .zip(vocab.eos_token_id);
    let piece =
        |token: Option<(&str, u32)>, type_id: u32| token.map(|(t, _)| format!("{t}:{type_id}"));
    let mut single = Vec::new();
    single.extend(piece(bos, 0));
    single.push("$A:0".to_string());
    single.extend(piece(eos, 0));
    let mut pair = single.clone();
    pair.extend(piece(bos, 1));
    pair.push("$B:1".to_string());
    pair.extend(piece(eos, 1));
    let mut specials: Vec<(String, u32)> = Vec::new();
    specials.extend(bos.map(|(t, id)| (t.to_string(), id)));
    specials.extend(eos.map(|(t, id)| (t.to_string(), id)));
    let template_error = |message: String| TokenizerError::Vocab {
        key: bos_key.to_string(),
        message: format!("cannot build the BOS/EOS template: {message}"),
    };
    TemplateProcessing::builder()
        .try_single(single.join(" "))
        .map_err(template_error)?
        .try_pair(pair.join(" "))
        .map_err(template_error)?
        .special_tokens(specials)
        .build()
        .map_err(|e| template_error(e.to_string()))
}

#[cfg(test)]
mod tests;
