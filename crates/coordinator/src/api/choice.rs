//! What a choice is once its tokens turn into text, shared by the JSON body
//! ([`super::respond`]) and the server-sent events ([`super::stream`]): a
//! [`ChoicePart`], the request's [`Meta`], the endpoint's [`Shape`], the [`Usage`]
//! counts, the head every body and chunk starts with, and the metrics of a request that
//! ran to its end. Both answers build on this module; neither imports the other's.

use std::sync::Arc;
use std::time::Instant;

use serde_json::{Map, Value, json};
use tessera_model::tokenizer::Tokenizer;

use crate::engine::TokenLogprobs;
use crate::metrics as names;

/// What one token (or the end) adds to a choice; also, accumulated, a whole choice.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct ChoicePart {
    pub index: u32,
    pub text: String,
    pub tokens: Vec<u32>,
    /// One per token when the request asked for logprobs.
    pub logprobs: Vec<TokenLogprobs>,
    /// Per token: the characters of the choice's text before it (completions'
    /// `text_offset`).
    pub offsets: Vec<usize>,
    /// OpenAI's `finish_reason`, on a choice's last part.
    pub finish: Option<&'static str>,
}

impl ChoicePart {
    /// Adds `part` of the same choice to what it holds.
    pub(crate) fn append(&mut self, part: ChoicePart) {
        self.text.push_str(&part.text);
        self.tokens.extend(part.tokens);
        self.logprobs.extend(part.logprobs);
        self.offsets.extend(part.offsets);
        self.finish = part.finish.or(self.finish);
    }
}

/// The request-level facts every chunk and body repeats.
#[derive(Clone, Debug)]
pub(crate) struct Meta {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub tokenizer: Option<Arc<Tokenizer>>,
    pub logprobs: bool,
    pub return_token_ids: bool,
    pub include_usage: bool,
    pub prompt: Vec<u32>,
    pub n: u32,
    /// Completion tokens the client already has: a resumed stream starts after them.
    pub resume_from: usize,
}

impl Meta {
    /// The text of one token, for logprobs (special tokens included: they were sampled).
    pub(crate) fn token_text(&self, token: u32) -> String {
        match &self.tokenizer {
            Some(t) => t.decode(&[token], false).unwrap_or_default(),
            None => String::new(),
        }
    }
}

/// The JSON of one endpoint's choices.
pub(crate) trait Shape: Send + Sync + 'static {
    /// `text_completion` / `chat.completion`.
    fn object(&self) -> &'static str;
    /// The object of a streamed chunk.
    fn chunk_object(&self) -> &'static str;
    /// A whole choice of a non-streaming body.
    fn choice(&self, meta: &Meta, choice: &ChoicePart) -> Value;
    /// One part of a choice in a streamed chunk.
    fn chunk_choice(&self, meta: &Meta, part: &ChoicePart) -> Value;
    /// A choice's first chunk, before any token (chat's `role`), if the endpoint has one.
    fn opening(&self, index: u32) -> Option<Value>;
}

/// Token counts of a finished request.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
}

impl Usage {
    pub(crate) fn json(self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        })
    }
}

/// `id`, `object`, `created`, `model`: the head of every body and chunk.
pub(crate) fn envelope(meta: &Meta, object: &'static str) -> Map<String, Value> {
    let mut map = Map::new();
    map.insert("id".into(), json!(meta.id));
    map.insert("object".into(), json!(object));
    map.insert("created".into(), json!(meta.created));
    map.insert("model".into(), json!(meta.model));
    map
}

/// Token counters and end-to-end latency of a request that ran to its end.
pub(crate) fn record_done(usage: Usage, start: Instant) {
    ::metrics::histogram!(names::API_REQUEST_DURATION_SECONDS)
        .record(start.elapsed().as_secs_f64());
    ::metrics::counter!(names::API_PROMPT_TOKENS).increment(usage.prompt_tokens as u64);
    ::metrics::counter!(names::API_GENERATED_TOKENS).increment(usage.completion_tokens as u64);
}
