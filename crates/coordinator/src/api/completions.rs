//! `POST /v1/completions`: a prompt (text or token ids) and the shared parameters
//! ([`super::params`]) in, OpenAI `text_completion` objects out — one body, or
//! `text_completion` chunks over SSE.
//!
//! Order of checks: the body's shape, the model (404), the parameters, admission (429,
//! before any tokenizing work), then the prompt against the context.

use std::sync::Arc;

use axum::Extension;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use serde_json::{Map, Value, json};

use super::auth::Caller;
use super::choice::{ChoicePart, Meta, Shape};
use super::error::ApiError;
use super::idempotency;
use super::params::{Endpoint, ParamsSpec, check_token_id, encode};
use super::respond::respond;
use super::types::{Fields, PromptSpec};
use super::{ApiJson, ApiState, ServedModel};

/// OpenAI's default `max_tokens` for completions.
const DEFAULT_MAX_TOKENS: u32 = 16;

pub(crate) async fn create_completion(
    State(state): State<Arc<ApiState>>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    ApiJson(body): ApiJson<Map<String, Value>>,
) -> Result<Response, ApiError> {
    let mut f = Fields::new(body);
    let model_name: String = f.require("model")?;
    let prompt = PromptSpec::from_json(f.require("prompt")?)?;
    let spec = ParamsSpec::take(&mut f, Endpoint::Completions)?;
    reject_unsupported(&mut f)?;
    let model = &state.model(&model_name)?;
    let params = spec.validate(model)?;
    caller.check_priority(params.priority)?;
    let id = idempotency::response_id(&headers, "cmpl")?;
    state.engine.admission(&model.name)?;
    let prompt = prompt_ids(model, prompt).await?;
    respond(
        &state,
        model,
        &params,
        prompt,
        Some(DEFAULT_MAX_TOKENS),
        id,
        CompletionShape,
    )
    .await
}

/// OpenAI fields that would change the output if they were silently ignored: a request
/// that sets them is refused rather than answered differently from what it asked.
fn reject_unsupported(f: &mut Fields) -> Result<(), ApiError> {
    // Accepted and unused: OpenAI's end-user id.
    let _: Option<String> = f.take("user")?;
    if f.take::<bool>("echo")? == Some(true) {
        return Err(ApiError::unsupported("echo"));
    }
    if f.take::<u32>("best_of")?.is_some_and(|b| b > 1) {
        return Err(ApiError::unsupported("best_of"));
    }
    if f.take::<String>("suffix")?.is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::unsupported("suffix"));
    }
    if f.take::<Map<String, Value>>("logit_bias")?
        .is_some_and(|m| !m.is_empty())
    {
        return Err(ApiError::unsupported("logit_bias"));
    }
    Ok(())
}

/// The prompt's token ids: given ones checked against the vocabulary, text encoded with
/// the special tokens the tokenizer adds (BOS when its `add_bos_token` says so).
async fn prompt_ids(model: &ServedModel, prompt: PromptSpec) -> Result<Vec<u32>, ApiError> {
    match prompt {
        PromptSpec::Tokens(ids) => {
            for &id in &ids {
                check_token_id(model, id, "prompt")?;
            }
            Ok(ids)
        }
        PromptSpec::Text(text) => encode(model, text, true, "prompt").await,
    }
}

/// The `text_completion` choice.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CompletionShape;

impl Shape for CompletionShape {
    fn object(&self) -> &'static str {
        "text_completion"
    }

    fn chunk_object(&self) -> &'static str {
        "text_completion"
    }

    fn choice(&self, meta: &Meta, choice: &ChoicePart) -> Value {
        let mut value = json!({
            "index": choice.index,
            "text": choice.text,
            "logprobs": logprobs(meta, choice),
            "finish_reason": choice.finish,
        });
        if meta.return_token_ids {
            value["token_ids"] = json!(choice.tokens);
        }
        value
    }

    fn chunk_choice(&self, meta: &Meta, part: &ChoicePart) -> Value {
        self.choice(meta, part)
    }

    fn opening(&self, _index: u32) -> Option<Value> {
        None
    }
}

/// OpenAI's legacy logprobs object: parallel lists per token.
fn logprobs(meta: &Meta, choice: &ChoicePart) -> Value {
    if !meta.logprobs {
        return Value::Null;
    }
    let tokens: Vec<String> = choice.tokens.iter().map(|&t| meta.token_text(t)).collect();
    let top: Vec<Map<String, Value>> = choice
        .logprobs
        .iter()
        .zip(&choice.tokens)
        .map(|(lp, &token)| {
            let mut top: Map<String, Value> = lp
                .top
                .iter()
                .map(|&(id, p)| (meta.token_text(id), json!(p)))
                .collect();
            // OpenAI lists the sampled token too, even when it is not among the most likely.
            top.entry(meta.token_text(token))
                .or_insert_with(|| json!(lp.logprob));
            top
        })
        .collect();
    json!({
        "tokens": tokens,
        "token_logprobs": choice.logprobs.iter().map(|lp| lp.logprob).collect::<Vec<_>>(),
        "top_logprobs": top,
        "text_offset": choice.offsets,
    })
}
