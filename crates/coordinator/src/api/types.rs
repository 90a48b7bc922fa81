//! The JSON shapes of the API: request fields as parsed (typed, not yet checked against a
//! model) and the model objects.
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
        let Value::Object(map) = json!({"max_tokens": null, "seed": 3, "top_p": "x"}) else {
            unreachable!()
        };
        let mut f = Fields::new(map);
        assert_eq!(f.take::<u32>("max_tokens").unwrap(), None);
        assert_eq!(f.take::<u64>("seed").unwrap(), Some(3));
        assert_eq!(f.take::<f64>("top_p").unwrap_err().param, Some("top_p"));
        assert_eq!(
            f.require::<String>("model").unwrap_err().param,
            Some("model")
        );
    }
}
