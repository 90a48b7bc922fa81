//! `POST /v1/chat/completions`: messages rendered by the model's chat template
//! ([`ChatTemplate`], with `add_generation_prompt`, default true) and tokenized without
//! added special tokens (the template writes them, as transformers' `apply_chat_template`
//! does), then the shared parameters and runner. Answers are OpenAI `chat.completion`
//! objects, or `chat.completion.chunk`s over SSE whose first chunk per choice carries the
//! `role`.
//!
//! A message's `content` is a string or a list of text parts (`{"type": "text", "text"}`);
//! other part types are refused. A model without a chat template answers 400.

use std::sync::Arc;

use axum::Extension;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use serde_json::{Map, Value, json};
use tessera_model::chat::{ChatMessage, ChatTemplateError};

use super::auth::Caller;
use super::choice::{ChoicePart, Meta, Shape};
use super::error::ApiError;
use super::idempotency;
use super::params::{Endpoint, ParamsSpec, encode};
use super::respond::respond;
use super::types::Fields;
use super::{ApiJson, ApiState, ServedModel};

pub(crate) async fn create_chat_completion(
    State(state): State<Arc<ApiState>>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    ApiJson(body): ApiJson<Map<String, Value>>,
) -> Result<Response, ApiError> {
    let mut f = Fields::new(body);
    let model_name: String = f.require("model")?;
    let messages = messages(f.require("messages")?)?;
    let add_generation_prompt = f.take("add_generation_prompt")?.unwrap_or(true);
    let spec = ParamsSpec::take(&mut f, Endpoint::Chat)?;
    reject_unsupported(&mut f)?;
    let model = &state.model(&model_name)?;
    let params = spec.validate(model)?;
    caller.check_priority(params.priority)?;
    let id = idempotency::response_id(&headers, "chatcmpl")?;
    state.engine.admission(&model.name)?;
    let text = render(model, &messages, add_generation_prompt)?;
    let prompt = encode(model, text, false, "messages").await?;
    respond(&state, model, &params, prompt, None, id, ChatShape).await
}

/// Fields that would change the answer if ignored.
fn reject_unsupported(f: &mut Fields) -> Result<(), ApiError> {
    let _: Option<String> = f.take("user")?;
    if f.take::<Vec<Value>>("tools")?
        .is_some_and(|t| !t.is_empty())
    {
        return Err(ApiError::unsupported("tools"));
    }
    if f.take::<Value>("response_format")?
        .is_some_and(|v| v.get("type").and_then(Value::as_str) != Some("text"))
    {
        return Err(ApiError::unsupported("response_format"));
    }
    if f.take::<Map<String, Value>>("logit_bias")?
        .is_some_and(|m| !m.is_empty())
    {
        return Err(ApiError::unsupported("logit_bias"));
    }
    Ok(())
}

/// The conversation, each message's content flattened to its text.
fn messages(value: Value) -> Result<Vec<ChatMessage>, ApiError> {
    let Value::Array(items) = value else {
        return Err(ApiError::invalid("messages", "`messages` must be a list"));
    };
    if items.is_empty() {
        return Err(ApiError::invalid("messages", "`messages` is empty"));
    }
    items.into_iter().map(message).collect()
}

fn message(value: Value) -> Result<ChatMessage, ApiError> {
    let bad = |why: &str| ApiError::invalid("messages", format!("a message {why}"));
    let Value::Object(mut fields) = value else {
        return Err(bad("must be an object with `role` and `content`"));
    };
    let role = match fields.remove("role") {
        Some(Value::String(role)) if !role.is_empty() => role,
        _ => return Err(bad("needs a `role` string")),
    };
    let content = match fields.remove("content") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(text)) => text,
        Some(Value::Array(parts)) => text_parts(parts)?,
        Some(_) => return Err(bad("`content` must be a string or a list of text parts")),
    };
    Ok(ChatMessage { role, content })
}

/// `[{"type": "text", "text": "..."}, ...]` joined (OpenAI concatenates text parts).
fn text_parts(parts: Vec<Value>) -> Result<String, ApiError> {
    let mut text = String::new();
    for part in parts {
        match (part.get("type").and_then(Value::as_str), part.get("text")) {
            (Some("text"), Some(Value::String(t))) => text.push_str(t),
            (Some("text"), _) => {
                return Err(ApiError::invalid(
                    "messages",
                    "a text part needs a `text` string",
                ));
            }
            (kind, _) => {
                return Err(ApiError::invalid(
                    "messages",
                    format!(
                        "content parts of type `{}` are not supported; only `text`",
                        kind.unwrap_or("(none)")
                    ),
                ));
            }
        }
    }
    Ok(text)
}

fn render(
    model: &ServedModel,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
) -> Result<String, ApiError> {
    let Some(template) = &model.chat_template else {
        return Err(ApiError::invalid(
            "model",
            format!(
                "model `{}` has no chat template: use /v1/completions",
                model.name
            ),
        ));
    };
    template
        .render(messages, add_generation_prompt)
        .map_err(|e| match e {
            // The template refused the conversation (roles out of order, ...).
            ChatTemplateError::Raised { message } => ApiError::invalid("messages", message),
            other => ApiError::internal(other.to_string()),
        })
}

/// The `chat.completion` choice.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ChatShape;

impl Shape for ChatShape {
    fn object(&self) -> &'static str {
        "chat.completion"
    }

    fn chunk_object(&self) -> &'static str {
        "chat.completion.chunk"
    }

    fn choice(&self, meta: &Meta, choice: &ChoicePart) -> Value {
        let mut value = json!({
            "index": choice.index,
            "message": {"role": "assistant", "content": choice.text},
            "logprobs": logprobs(meta, choice),
            "finish_reason": choice.finish,
        });
        if meta.return_token_ids {
            value["token_ids"] = json!(choice.tokens);
        }
        value
    }

    fn chunk_choice(&self, meta: &Meta, part: &ChoicePart) -> Value {
        let delta = if part.text.is_empty() {
            json!({})
        } else {
            json!({"content": part.text})
        };
        let mut value = json!({
            "index": part.index,
            "delta": delta,
            "logprobs": logprobs(meta, part),
            "finish_reason": part.finish,
        });
        if meta.return_token_ids {
            value["token_ids"] = json!(part.tokens);
        }
        value
    }

    fn opening(&self, index: u32) -> Option<Value> {
        Some(json!({
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": null,
            "finish_reason": null,
        }))
    }
}

/// OpenAI's chat logprobs: one entry per token with its bytes and alternatives.
fn logprobs(meta: &Meta, choice: &ChoicePart) -> Value {
    if !meta.logprobs {
        return Value::Null;
    }
    let entry = |token: u32, logprob: f32| {
        let text = meta.token_text(token);
        json!({"token": text, "logprob": logprob, "bytes": text.as_bytes()})
    };
    let content: Vec<Value> = choice
        .logprobs
        .iter()
        .zip(&choice.tokens)
        .map(|(lp, &token)| {
            let mut value = entry(token, lp.logprob);
            value["top_logprobs"] = lp.top.iter().map(|&(id, p)| entry(id, p)).collect();
            value
        })
        .collect();
    json!({"content": content})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_shapes() {
        let m = message(json!({"role": "user", "content": "hi"})).unwrap();
        assert_eq!(m, ChatMessage::new("user", "hi"));
        let m = message(json!({"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "text", "text": "b"}
        ]}))
        .unwrap();
        assert_eq!(m.content, "ab");
        let m = message(json!({"role": "assistant", "content": null})).unwrap();
        assert_eq!(m.content, "");
        for bad in [
            json!("hi"),
            json!({"content": "x"}),
            json!({"role": "user", "content": 3}),
            json!({"role": "user", "content": [{"type": "image_url"}]}),
            json!({"role": "user", "content": [{"type": "text"}]}),
        ] {
            assert_eq!(message(bad).unwrap_err().param, Some("messages"));
        }
        assert!(messages(json!([])).is_err());
        assert!(messages(json!({})).is_err());
    }
}
