//! `POST /v1/completions`: validation of a [`CompletionSpec`] against the served model into
//! a [`GenerateRequest`], one engine call, and the OpenAI `text_completion` response.
//!
//! Non-streaming only for now. Validation follows OpenAI's ranges and defaults, with
//! vLLM's extras (`stop_token_ids`, `ignore_eos`, `return_token_ids`, `top_k`, `min_p`,
//! `repetition_penalty`) under vLLM's names.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::extract::State;
use rand::TryRngCore;
use rand::rngs::OsRng;
use serde_json::{Map, Value};
use tessera_comm::proto::Sampling;
use tracing::Span;

use super::error::ApiError;
use super::types::{CompletionChoice, CompletionResponse, CompletionSpec, PromptSpec, Usage};
use super::{ApiJson, ApiState, ServedModel};
use crate::engine::{GenerateRequest, collect};

/// OpenAI's default `max_tokens` for completions.
const DEFAULT_MAX_TOKENS: u32 = 16;

/// OpenAI's default temperature is 1 (sampling from the model's distribution), not the
/// greedy 0 of [`Sampling::default`].
const DEFAULT_TEMPERATURE: f32 = 1.0;

pub(crate) async fn create_completion(
    State(state): State<Arc<ApiState>>,
    ApiJson(body): ApiJson<Map<String, Value>>,
) -> Result<Json<CompletionResponse>, ApiError> {
    let spec = CompletionSpec::from_json(body)?;
    let model = state
        .model(&spec.model)
        .ok_or_else(|| ApiError::model_not_found(&spec.model))?;
    let id = format!("cmpl-{}", random_hex()?);
    let span = Span::current();
    span.record("request_id", id.as_str());
    span.record("model", model.name.as_str());

    let ValidCompletion {
        request,
        return_token_ids,
    } = validate(model, spec).await?;
    let prompt_tokens = request.prompt.len();
    let prompt_token_ids = return_token_ids.then(|| request.prompt.clone());
    let output = collect(state.engine.generate(request).await?).await?;
    let text = match &model.tokenizer {
        Some(tokenizer) => tokenizer
            .decode(&output.tokens, true)
            .map_err(|e| ApiError::internal(e.to_string()))?,
        None => String::new(),
    };
    let completion_tokens = output.tokens.len();
    Ok(Json(CompletionResponse {
        id,
        object: "text_completion",
        created: unix_seconds(),
        model: model.name.clone(),
        choices: vec![CompletionChoice {
            index: 0,
            text,
            logprobs: None,
            finish_reason: output.finish.as_str(),
            token_ids: return_token_ids.then_some(output.tokens),
        }],
        usage: Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
        },
        prompt_token_ids,
    }))
}

/// Most stop ids one request may add: the sampling rank compares every token it samples
/// with the list, and real stop lists hold a handful of ids.
const MAX_STOP_TOKEN_IDS: usize = 256;

/// A request checked against its model and ready for the engine.
#[derive(Clone, Debug)]
struct ValidCompletion {
    request: GenerateRequest,
    return_token_ids: bool,
}

async fn validate(model: &ServedModel, spec: CompletionSpec) -> Result<ValidCompletion, ApiError> {
    if spec.stream {
        return Err(ApiError::invalid(
            "stream",
            "streaming is not supported yet",
        ));
    }
    if spec.n.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid(
            "n",
            "only `n` = 1 is supported for now: one choice per request",
        ));
    }
    let max_tokens = spec.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS);
    if max_tokens == 0 {
        return Err(ApiError::invalid(
            "max_tokens",
            "`max_tokens` must be at least 1",
        ));
    }
    let sampling = sampling(&spec)?;
    if spec.stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
        return Err(ApiError::invalid(
            "stop_token_ids",
            format!(
                "at most {MAX_STOP_TOKEN_IDS} `stop_token_ids` are supported; got {}",
                spec.stop_token_ids.len()
            ),
        ));
    }
    for &id in &spec.stop_token_ids {
        check_token_id(model, id, "stop_token_ids")?;
    }
    let prompt = prompt_ids(model, spec.prompt).await?;
    if prompt.is_empty() {
        return Err(ApiError::invalid("prompt", "the prompt has no tokens"));
    }
    check_context(model, prompt.len(), max_tokens)?;

    let eos = if spec.ignore_eos {
        &[][..]
    } else {
        &model.eos_token_ids[..]
    };
    let mut stop_token_ids: Vec<u32> = Vec::new();
    for &id in eos.iter().chain(&spec.stop_token_ids) {
        if !stop_token_ids.contains(&id) {
            stop_token_ids.push(id);
        }
    }
    Ok(ValidCompletion {
        request: GenerateRequest {
            model: model.name.clone(),
            prompt,
            max_tokens,
            sampling,
            stop_token_ids,
            priority: 0,
        },
        return_token_ids: spec.return_token_ids,
    })
}

fn sampling(spec: &CompletionSpec) -> Result<Sampling, ApiError> {
    let top_k = match spec.top_k {
        None | Some(-1 | 0) => 0,
        Some(k) if k > 0 => u32::try_from(k).unwrap_or(u32::MAX),
        Some(k) => {
            return Err(ApiError::invalid(
                "top_k",
                format!("`top_k` must be -1 or 0 (no limit) or positive; got {k}"),
            ));
        }
    };
    let seed = match spec.seed {
        Some(seed) => seed,
        // The engine always needs one, so that every rank and every retry samples alike.
        None => OsRng
            .try_next_u64()
            .map_err(|e| ApiError::internal(format!("cannot draw a random seed: {e}")))?,
    };
    Ok(Sampling {
        temperature: in_range(
            spec.temperature,
            "temperature",
            0.0,
            2.0,
            DEFAULT_TEMPERATURE,
        )?,
        top_k,
        top_p: in_range(spec.top_p, "top_p", 0.0, 1.0, 1.0).and_then(|p| positive(p, "top_p"))?,
        min_p: in_range(spec.min_p, "min_p", 0.0, 1.0, 0.0)?,
        repetition_penalty: in_range(spec.repetition_penalty, "repetition_penalty", 0.0, 2.0, 1.0)
            .and_then(|p| positive(p, "repetition_penalty"))?,
        presence_penalty: in_range(spec.presence_penalty, "presence_penalty", -2.0, 2.0, 0.0)?,
        frequency_penalty: in_range(spec.frequency_penalty, "frequency_penalty", -2.0, 2.0, 0.0)?,
        seed,
        logprobs: None,
    })
}

/// `value` (or `default` when absent) when it lies in `min..=max`.
fn in_range(
    value: Option<f64>,
    param: &'static str,
    min: f64,
    max: f64,
    default: f32,
) -> Result<f32, ApiError> {
    match value {
        None => Ok(default),
        Some(v) if (min..=max).contains(&v) => Ok(v as f32),
        Some(v) => Err(ApiError::invalid(
            param,
            format!("`{param}` must be from {min} to {max}; got {v}"),
        )),
    }
}

fn positive(value: f32, param: &'static str) -> Result<f32, ApiError> {
    if value > 0.0 {
        Ok(value)
    } else {
        Err(ApiError::invalid(
            param,
            format!("`{param}` must be greater than 0; got {value}"),
        ))
    }
}

fn check_token_id(model: &ServedModel, id: u32, param: &'static str) -> Result<(), ApiError> {
    if (id as usize) < model.vocab_size {
        return Ok(());
    }
    Err(ApiError::invalid(
        param,
        format!(
            "token id {id} is out of range: model `{}` has {} token ids (0 to {})",
            model.name,
            model.vocab_size,
            model.vocab_size.saturating_sub(1)
        ),
    ))
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
        PromptSpec::Text(text) => {
            let Some(tokenizer) = model.tokenizer.clone() else {
                return Err(ApiError::invalid(
                    "prompt",
                    format!(
                        "model `{}` has no tokenizer: send the prompt as token ids",
                        model.name
                    ),
                ));
            };
            // Encoding a long prompt takes milliseconds: off the async workers.
            tokio::task::spawn_blocking(move || tokenizer.encode(&text, true))
                .await
                .map_err(|e| ApiError::internal(format!("tokenizing the prompt failed: {e}")))?
                .map_err(|e| ApiError::internal(e.to_string()))
        }
    }
}

/// Like vLLM, one message with the model's limit and both parts of the request.
fn check_context(
    model: &ServedModel,
    prompt_tokens: usize,
    max_tokens: u32,
) -> Result<(), ApiError> {
    let requested = prompt_tokens as u64 + u64::from(max_tokens);
    if requested <= model.context_tokens as u64 {
        return Ok(());
    }
    let param = if prompt_tokens >= model.context_tokens {
        "prompt"
    } else {
        "max_tokens"
    };
    Err(ApiError::invalid(
        param,
        format!(
            "This model's maximum context length is {} tokens. However, you requested \
             {requested} tokens ({prompt_tokens} in the prompt, {max_tokens} for the \
             completion). Please reduce the length of the prompt or `max_tokens`.",
            model.context_tokens
        ),
    )
    .with_code("context_length_exceeded"))
}

fn unix_seconds() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// 128 random bits in hex, for response ids.
fn random_hex() -> Result<String, ApiError> {
    let mut bytes = [0u8; 16];
    OsRng
        .try_fill_bytes(&mut bytes)
        .map_err(|e| ApiError::internal(format!("cannot draw a random id: {e}")))?;
    let mut hex = String::with_capacity(32);
    for b in bytes {
        let _ = write!(hex, "{b:02x}");
    }
    Ok(hex)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_and_defaults() {
        assert_eq!(in_range(None, "t", 0.0, 2.0, 1.0).unwrap(), 1.0);
        assert_eq!(in_range(Some(2.0), "t", 0.0, 2.0, 1.0).unwrap(), 2.0);
        assert_eq!(
            in_range(Some(2.01), "t", 0.0, 2.0, 1.0).unwrap_err().param,
            Some("t")
        );
        assert!(positive(0.0, "top_p").is_err());
        assert_eq!(random_hex().unwrap().len(), 32);
    }
}
