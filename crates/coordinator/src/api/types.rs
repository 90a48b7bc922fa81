//! The JSON shapes of the API: request bodies as parsed (typed, not yet checked against a
//! model) and response bodies.
//!
//! Request bodies are read field by field from the JSON object rather than derived, so
//! that a field of the wrong type is a 400 naming that field (`param`), `null` counts as
//! absent (some clients send every optional field), and fields this server does not know
//! are ignored, as OpenAI clients send extras.

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use super::error::ApiError;

/// A JSON request body, with fields taken out one by one.
#[derive(Debug)]
pub(crate) struct Fields(Map<String, Value>);

impl Fields {
    pub(crate) fn new(body: Map<String, Value>) -> Fields {
        Fields(body)
    }

    /// The field `name` as a `T`; `None` when absent or `null`.
    pub(crate) fn take<T: DeserializeOwned>(
        &mut self,
        name: &'static str,
    ) -> Result<Option<T>, ApiError> {
        match self.0.remove(name) {
            None | Some(Value::Null) => Ok(None),
            Some(value) => T::deserialize(value)
                .map(Some)
                .map_err(|e| ApiError::invalid(name, format!("`{name}`: {e}"))),
        }
    }

    pub(crate) fn require<T: DeserializeOwned>(
        &mut self,
        name: &'static str,
    ) -> Result<T, ApiError> {
        self.take(name)?
            .ok_or_else(|| ApiError::invalid(name, format!("`{name}` is required")))
    }
}

/// The prompt of a completion request, as sent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum PromptSpec {
    Text(String),
    Tokens(Vec<u32>),
}

impl PromptSpec {
    /// Accepts a string, an array of token ids, or an array holding one of either.
    pub(crate) fn from_json(value: Value) -> Result<PromptSpec, ApiError> {
        const PARAM: &str = "prompt";
        let shape_error = || {
            ApiError::invalid(
                PARAM,
                "`prompt` must be a string, an array of token ids, \
                 or an array holding one of either",
            )
        };
        let mut items = match value {
            Value::String(text) => return Ok(PromptSpec::Text(text)),
            Value::Array(items) => items,
            _ => return Err(shape_error()),
        };
        if items.is_empty() {
            return Err(ApiError::invalid(PARAM, "`prompt` is empty"));
        }
        if items.iter().all(Value::is_number) {
            return token_ids(&items).map(PromptSpec::Tokens);
        }
        if !items.iter().all(|v| v.is_string() || v.is_array()) {
            return Err(shape_error());
        }
        if items.len() > 1 {
            return Err(ApiError::invalid(
                PARAM,
                format!(
                    "only one prompt per request is supported for now; got {}",
                    items.len()
                ),
            ));
        }
        match items.swap_remove(0) {
            Value::String(text) => Ok(PromptSpec::Text(text)),
            Value::Array(ids) if ids.is_empty() => {
                Err(ApiError::invalid(PARAM, "`prompt` is empty"))
            }
            Value::Array(ids) if ids.iter().all(Value::is_number) => {
                token_ids(&ids).map(PromptSpec::Tokens)
            }
            _ => Err(shape_error()),
        }
    }
}

fn token_ids(items: &[Value]) -> Result<Vec<u32>, ApiError> {
    items
        .iter()
        .map(|v| {
            v.as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .ok_or_else(|| {
                    ApiError::invalid(
                        "prompt",
                        format!("prompt token ids must be integers from 0 to 2^32-1; got {v}"),
                    )
                })
        })
        .collect()
}

/// The body of `POST /v1/completions`, typed but not yet checked against the model.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct CompletionSpec {
    pub model: String,
    pub prompt: PromptSpec,
    pub max_tokens: Option<u32>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    /// vLLM extra; -1 or 0: no limit.
    pub top_k: Option<i64>,
    /// vLLM extra.
    pub min_p: Option<f64>,
    /// vLLM extra.
    pub repetition_penalty: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub seed: Option<u64>,
    /// vLLM extra.
    pub stop_token_ids: Vec<u32>,
    /// vLLM extra: add the prompt's and the completion's token ids to the response.
    pub return_token_ids: bool,
    /// vLLM extra: the model's end-of-sequence ids do not stop generation.
    pub ignore_eos: bool,
    pub n: Option<u32>,
    pub stream: bool,
}

impl CompletionSpec {
    pub(crate) fn from_json(body: Map<String, Value>) -> Result<CompletionSpec, ApiError> {
        let mut f = Fields::new(body);
        let spec = CompletionSpec {
            model: f.require("model")?,
            prompt: PromptSpec::from_json(f.require("prompt")?)?,
            max_tokens: f.take("max_tokens")?,
            temperature: f.take("temperature")?,
            top_p: f.take("top_p")?,
            top_k: f.take("top_k")?,
            min_p: f.take("min_p")?,
            repetition_penalty: f.take("repetition_penalty")?,
            presence_penalty: f.take("presence_penalty")?,
            frequency_penalty: f.take("frequency_penalty")?,
            seed: f.take("seed")?,
            stop_token_ids: f.take("stop_token_ids")?.unwrap_or_default(),
            return_token_ids: f.take("return_token_ids")?.unwrap_or(false),
            ignore_eos: f.take("ignore_eos")?.unwrap_or(false),
            n: f.take("n")?,
            stream: f.take("stream")?.unwrap_or(false),
        };
        // Accepted and unused: OpenAI's end-user id.
        let _: Option<String> = f.take("user")?;
        reject_unsupported(&mut f)?;
        Ok(spec)
    }
}

/// OpenAI fields that would change the output if they were silently ignored: a request
/// that sets them is refused rather than answered differently from what it asked.
fn reject_unsupported(f: &mut Fields) -> Result<(), ApiError> {
    match f.take::<Value>("stop")? {
        None => {}
        Some(Value::String(s)) if s.is_empty() => {}
        Some(Value::Array(a)) if a.is_empty() => {}
        Some(_) => {
            return Err(ApiError::invalid(
                "stop",
                "`stop` strings are not supported yet; use `stop_token_ids`",
            ));
        }
    }
    if f.take::<bool>("echo")? == Some(true) {
        return Err(ApiError::unsupported("echo"));
    }
    if !matches!(
        f.take::<Value>("logprobs")?,
        None | Some(Value::Bool(false))
    ) {
        return Err(ApiError::unsupported("logprobs"));
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

/// OpenAI's `text_completion` object.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct CompletionResponse {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    pub usage: Usage,
    /// With `return_token_ids` (vLLM).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
}

#[derive(Clone, Debug, Serialize)]
pub(crate) struct CompletionChoice {
    pub index: u32,
    pub text: String,
    /// Always `null`: log probabilities are not supported yet.
    pub logprobs: Option<()>,
    pub finish_reason: &'static str,
    /// With `return_token_ids` (vLLM).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

#[derive(Clone, Copy, Debug, Serialize)]
pub(crate) struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

/// OpenAI's model list.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}

/// OpenAI's model object, with vLLM's `max_model_len`.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    /// Prompt plus completion tokens the model takes (vLLM's name).
    pub max_model_len: usize,
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn prompt(value: Value) -> Result<PromptSpec, ApiError> {
        PromptSpec::from_json(value)
    }

    #[test]
    fn prompt_shapes() {
        let text = PromptSpec::Text("hi".into());
        assert_eq!(prompt(json!("hi")).unwrap(), text);
        assert_eq!(prompt(json!(["hi"])).unwrap(), text);
        assert_eq!(
            prompt(json!([1, 2])).unwrap(),
            PromptSpec::Tokens(vec![1, 2])
        );
        assert_eq!(prompt(json!([[3]])).unwrap(), PromptSpec::Tokens(vec![3]));
        for bad in [
            json!([]),
            json!([[]]),
            json!(["a", "b"]),
            json!([[1], [2]]),
            json!([-1]),
            json!([1.5]),
            json!([4294967296u64]),
            json!([1, "a"]),
            json!([["a"]]),
            json!(7),
            json!({"a": 1}),
        ] {
            let err = prompt(bad.clone()).unwrap_err();
            assert_eq!(err.param, Some("prompt"), "{bad}");
        }
        assert!(
            prompt(json!(["a", "b"]))
                .unwrap_err()
                .message
                .contains("only one prompt")
        );
    }

    #[test]
    fn null_is_absent_and_wrong_types_name_the_field() {
        let body = json!({"model": "m", "prompt": "p", "max_tokens": null, "seed": 3});
        let Value::Object(map) = body else {
            unreachable!()
        };
        let spec = CompletionSpec::from_json(map).unwrap();
        assert_eq!(spec.max_tokens, None);
        assert_eq!(spec.seed, Some(3));

        let Value::Object(map) = json!({"model": "m", "prompt": "p", "top_p": "x"}) else {
            unreachable!()
        };
        let err = CompletionSpec::from_json(map).unwrap_err();
        assert_eq!(err.param, Some("top_p"));
    }
}
