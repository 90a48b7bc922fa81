//! The generation parameters that completions and chat share: read from the body
//! ([`ParamsSpec::take`]), checked against OpenAI's ranges and the served model
//! ([`ParamsSpec::validate`] into [`Params`]), and turned into one [`GenerateRequest`] per
//! choice once the prompt is tokenized ([`Params::request`]).
//!
//! Ranges follow OpenAI (and vLLM for its extras: `top_k`, `min_p`, `repetition_penalty`,
//! `stop_token_ids`, `ignore_eos`, `return_token_ids`, `priority`). Integers are read as
//! `i64` so that a negative or zero value gets a message about the range, not about the
//! JSON type.

use std::sync::Arc;

use rand::TryRngCore;
use rand::rngs::OsRng;
use serde_json::Value;
use tessera_comm::proto::Sampling;

use super::ServedModel;
use super::error::ApiError;
use super::types::Fields;
use crate::engine::GenerateRequest;

/// Most choices one request may ask for: each is a sequence with its own KV blocks.
pub const MAX_CHOICES: i64 = 16;
/// OpenAI's limits on stop strings.
pub const MAX_STOP_STRINGS: usize = 4;
pub const MAX_STOP_STRING_BYTES: usize = 256;
/// Most stop ids one request may add: the sampling rank compares every token it samples
/// with the list, and real stop lists hold a handful of ids.
pub const MAX_STOP_TOKEN_IDS: usize = 256;
/// OpenAI's limits on log probabilities: alternatives per token.
const MAX_COMPLETION_LOGPROBS: i64 = 5;
const MAX_CHAT_TOP_LOGPROBS: i64 = 20;

/// OpenAI's default temperature is 1 (sampling from the model's distribution), not the
/// greedy 0 of [`Sampling::default`].
const DEFAULT_TEMPERATURE: f32 = 1.0;

/// Which endpoint's conventions apply where they differ.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Endpoint {
    /// `max_tokens` defaults to 16; `logprobs` is an integer.
    Completions,
    /// `max_completion_tokens` (or `max_tokens`) defaults to the rest of the context;
    /// `logprobs` is a bool with `top_logprobs`.
    Chat,
}

/// The shared fields as sent.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct ParamsSpec {
    max_tokens: Option<(i64, &'static str)>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
    min_p: Option<f64>,
    repetition_penalty: Option<f64>,
    presence_penalty: Option<f64>,
    frequency_penalty: Option<f64>,
    seed: Option<u64>,
    stop: Vec<String>,
    stop_token_ids: Vec<u32>,
    ignore_eos: bool,
    return_token_ids: bool,
    n: Option<i64>,
    priority: Option<i64>,
    /// Alternatives per token, with the field that asked for it.
    logprobs: Option<(i64, &'static str)>,
    pub(crate) stream: bool,
    include_usage: bool,
    /// The fields a context overflow blames: the prompt's and the completion length's.
    names: FieldNames,
}

/// The names the endpoint gives to the prompt and to the completion's length.
#[derive(Clone, Copy, Debug, PartialEq)]
struct FieldNames {
    prompt: &'static str,
    max_tokens: &'static str,
}

impl Default for FieldNames {
    fn default() -> Self {
        FieldNames {
            prompt: "prompt",
            max_tokens: "max_tokens",
        }
    }
}

/// The shared fields, checked.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Params {
    /// `None`: the rest of the context (chat's default).
    max_tokens: Option<u32>,
    sampling: Sampling,
    pub(crate) stop: Arc<[String]>,
    stop_token_ids: Vec<u32>,
    ignore_eos: bool,
    pub(crate) return_token_ids: bool,
    pub(crate) n: u32,
    pub(crate) priority: i32,
    pub(crate) stream: bool,
    pub(crate) include_usage: bool,
    names: FieldNames,
}

impl ParamsSpec {
    pub(crate) fn take(f: &mut Fields, endpoint: Endpoint) -> Result<ParamsSpec, ApiError> {
        let max_tokens = match endpoint {
            Endpoint::Chat => match f.take("max_completion_tokens")? {
                Some(v) => Some((v, "max_completion_tokens")),
                None => f.take("max_tokens")?.map(|v| (v, "max_tokens")),
            },
            Endpoint::Completions => f.take("max_tokens")?.map(|v| (v, "max_tokens")),
        };
        let names = FieldNames {
            prompt: match endpoint {
                Endpoint::Completions => "prompt",
                Endpoint::Chat => "messages",
            },
            max_tokens: max_tokens.map_or(
                match endpoint {
                    Endpoint::Completions => "max_tokens",
                    Endpoint::Chat => "max_completion_tokens",
                },
                |(_, param)| param,
            ),
        };
        let logprobs = match endpoint {
            Endpoint::Completions => f.take("logprobs")?.map(|v| (v, "logprobs")),
            Endpoint::Chat => chat_logprobs(f)?,
        };
        let stream = f.take("stream")?.unwrap_or(false);
        let include_usage = match f.take::<Value>("stream_options")? {
            None => false,
            Some(options) => options
                .get("include_usage")
                .map(|v| v.as_bool().unwrap_or(false))
                .unwrap_or(false),
        };
        Ok(ParamsSpec {
            max_tokens,
            temperature: f.take("temperature")?,
            top_p: f.take("top_p")?,
            top_k: f.take("top_k")?,
            min_p: f.take("min_p")?,
            repetition_penalty: f.take("repetition_penalty")?,
            presence_penalty: f.take("presence_penalty")?,
            frequency_penalty: f.take("frequency_penalty")?,
            seed: f.take("seed")?,
            stop: stop_strings(f.take("stop")?)?,
            stop_token_ids: f.take("stop_token_ids")?.unwrap_or_default(),
            ignore_eos: f.take("ignore_eos")?.unwrap_or(false),
            return_token_ids: f.take("return_token_ids")?.unwrap_or(false),
            n: f.take("n")?,
            priority: f.take("priority")?,
            logprobs,
            stream,
            include_usage,
            names,
        })
    }

    /// Checks every field that does not depend on the prompt.
    pub(crate) fn validate(self, model: &ServedModel) -> Result<Params, ApiError> {
        let max_tokens = match self.max_tokens {
            None => None,
            Some((v, param)) => Some(max_tokens(v, param, model)?),
        };
        let n = match self.n {
            None => 1,
            Some(n @ 1..=MAX_CHOICES) => n as u32,
            Some(n) => {
                return Err(ApiError::invalid(
                    "n",
                    format!("`n` must be from 1 to {MAX_CHOICES}; got {n}"),
                ));
            }
        };
        let priority = match self.priority {
            None => 0,
            Some(p) => i32::try_from(p).map_err(|_| {
                ApiError::invalid("priority", format!("`priority` {p} is out of range"))
            })?,
        };
        check_stop_token_ids(model, &self.stop_token_ids)?;
        Ok(Params {
            max_tokens,
            sampling: self.sampling()?,
            stop: self.stop.into(),
            stop_token_ids: self.stop_token_ids,
            ignore_eos: self.ignore_eos,
            return_token_ids: self.return_token_ids,
            n,
            priority,
            stream: self.stream,
            include_usage: self.include_usage,
            names: self.names,
        })
    }

    fn sampling(&self) -> Result<Sampling, ApiError> {
        let top_k = match self.top_k {
            None | Some(-1 | 0) => 0,
            Some(k) if k > 0 => u32::try_from(k).unwrap_or(u32::MAX),
            Some(k) => {
                return Err(ApiError::invalid(
                    "top_k",
                    format!("`top_k` must be -1 or 0 (no limit) or positive; got {k}"),
                ));
            }
        };
        let seed = match self.seed {
            Some(seed) => seed,
            // The engine always needs one, so that every rank and every retry samples alike.
            None => OsRng
                .try_next_u64()
                .map_err(|e| ApiError::internal(format!("cannot draw a random seed: {e}")))?,
        };
        let logprobs = match self.logprobs {
            None => None,
            Some((k, param)) => Some(logprobs(k, param)?),
        };
        Ok(Sampling {
            temperature: in_range(
                self.temperature,
                "temperature",
                0.0,
                2.0,
                DEFAULT_TEMPERATURE,
            )?,
            top_k,
            top_p: in_range(self.top_p, "top_p", 0.0, 1.0, 1.0)
                .and_then(|p| positive(p, "top_p"))?,
            min_p: in_range(self.min_p, "min_p", 0.0, 1.0, 0.0)?,
            repetition_penalty: in_range(
                self.repetition_penalty,
                "repetition_penalty",
                0.0,
                2.0,
                1.0,
            )
            .and_then(|p| positive(p, "repetition_penalty"))?,
            presence_penalty: in_range(self.presence_penalty, "presence_penalty", -2.0, 2.0, 0.0)?,
            frequency_penalty: in_range(
                self.frequency_penalty,
                "frequency_penalty",
                -2.0,
                2.0,
                0.0,
            )?,
            seed,
            logprobs,
        })
    }
}

impl Params {
    /// Alternatives per token the engine reports, if the request asked for logprobs.
    pub(crate) fn logprobs(&self) -> Option<u8> {
        self.sampling.logprobs
    }

    /// The engine request of choice `index` for `prompt`: choices differ by their seed
    /// (`seed + index`), so they sample differently and stay reproducible.
    pub(crate) fn request(
        &self,
        model: &ServedModel,
        prompt: Vec<u32>,
        default_max_tokens: Option<u32>,
        index: u32,
    ) -> Result<GenerateRequest, ApiError> {
        if prompt.is_empty() {
            return Err(ApiError::invalid("prompt", "the prompt has no tokens"));
        }
        let rest = model.context_tokens.saturating_sub(prompt.len());
        let max_tokens = self
            .max_tokens
            .or(default_max_tokens)
            .unwrap_or(u32::try_from(rest).unwrap_or(u32::MAX).max(1));
        check_context(model, prompt.len(), max_tokens, self.names)?;
        let eos = if self.ignore_eos {
            &[][..]
        } else {
            &model.eos_token_ids[..]
        };
        let mut stop_token_ids: Vec<u32> = Vec::new();
        for &id in eos.iter().chain(&self.stop_token_ids) {
            if !stop_token_ids.contains(&id) {
                stop_token_ids.push(id);
            }
        }
        let mut sampling = self.sampling.clone();
        sampling.seed = sampling.seed.wrapping_add(u64::from(index));
        Ok(GenerateRequest {
            model: model.name.clone(),
            prompt,
            max_tokens,
            sampling,
            stop_token_ids,
            stop: self.stop.to_vec(),
            priority: self.priority,
        })
    }
}

/// The token ids of `text`, on a blocking thread: encoding a long prompt takes
/// milliseconds. `param` is the field blamed when the model has no tokenizer.
pub(crate) async fn encode(
    model: &ServedModel,
    text: String,
    add_special_tokens: bool,
    param: &'static str,
) -> Result<Vec<u32>, ApiError> {
    let Some(tokenizer) = model.tokenizer.clone() else {
        return Err(ApiError::invalid(
            param,
            format!(
                "model `{}` has no tokenizer: send the prompt as token ids",
                model.name
            ),
        ));
    };
    tokio::task::spawn_blocking(move || tokenizer.encode(&text, add_special_tokens))
        .await
        .map_err(|e| ApiError::internal(format!("tokenizing the prompt failed: {e}")))?
        .map_err(|e| ApiError::internal(e.to_string()))
}

/// Chat's `logprobs` (bool) and `top_logprobs` (integer, needs `logprobs`).
fn chat_logprobs(f: &mut Fields) -> Result<Option<(i64, &'static str)>, ApiError> {
    let wanted = f.take::<bool>("logprobs")?.unwrap_or(false);
    let top = f.take::<i64>("top_logprobs")?;
    match (wanted, top) {
        (false, None) => Ok(None),
        (false, Some(_)) => Err(ApiError::invalid(
            "top_logprobs",
            "`top_logprobs` needs `logprobs` set to true",
        )),
        (true, None) => Ok(Some((0, "top_logprobs"))),
        (true, Some(k)) if (0..=MAX_CHAT_TOP_LOGPROBS).contains(&k) => {
            Ok(Some((k, "top_logprobs")))
        }
        (true, Some(k)) => Err(ApiError::invalid(
            "top_logprobs",
            format!("`top_logprobs` must be from 0 to {MAX_CHAT_TOP_LOGPROBS}; got {k}"),
        )),
    }
}

fn logprobs(k: i64, param: &'static str) -> Result<u8, ApiError> {
    let max = match param {
        "logprobs" => MAX_COMPLETION_LOGPROBS,
        _ => MAX_CHAT_TOP_LOGPROBS,
    };
    if (0..=max).contains(&k) {
        // In range of u8 by the check above.
        return Ok(k as u8);
    }
    Err(ApiError::invalid(
        param,
        format!("`{param}` must be from 0 to {max}; got {k}"),
    ))
}

/// `stop` as a string or a list of strings; empty strings match nothing and are dropped.
fn stop_strings(value: Option<Value>) -> Result<Vec<String>, ApiError> {
    const PARAM: &str = "stop";
    let items = match value {
        None => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s],
        Some(Value::Array(items)) => items
            .into_iter()
            .map(|v| match v {
                Value::String(s) => Ok(s),
                _ => Err(ApiError::invalid(
                    PARAM,
                    "`stop` must be a string or a list of strings",
                )),
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(ApiError::invalid(
                PARAM,
                "`stop` must be a string or a list of strings",
            ));
        }
    };
    if items.len() > MAX_STOP_STRINGS {
        return Err(ApiError::invalid(
            PARAM,
            format!(
                "at most {MAX_STOP_STRINGS} stop strings are supported; got {}",
                items.len()
            ),
        ));
    }
    if let Some(long) = items.iter().find(|s| s.len() > MAX_STOP_STRING_BYTES) {
        return Err(ApiError::invalid(
            PARAM,
            format!(
                "stop strings may be at most {MAX_STOP_STRING_BYTES} bytes long; got one of {}",
                long.len()
            ),
        ));
    }
    Ok(items.into_iter().filter(|s| !s.is_empty()).collect())
}

fn max_tokens(value: i64, param: &'static str, model: &ServedModel) -> Result<u32, ApiError> {
    if value < 1 {
        return Err(ApiError::invalid(
            param,
            format!("`{param}` must be at least 1; got {value}"),
        ));
    }
    if value as u64 > model.context_tokens as u64 {
        return Err(ApiError::invalid(
            param,
            format!(
                "`{param}` is {value}, more than the {} tokens of model `{}`'s context",
                model.context_tokens, model.name
            ),
        )
        .with_code("context_length_exceeded"));
    }
    Ok(u32::try_from(value).unwrap_or(u32::MAX))
}

fn check_stop_token_ids(model: &ServedModel, ids: &[u32]) -> Result<(), ApiError> {
    if ids.len() > MAX_STOP_TOKEN_IDS {
        return Err(ApiError::invalid(
            "stop_token_ids",
            format!(
                "at most {MAX_STOP_TOKEN_IDS} `stop_token_ids` are supported; got {}",
                ids.len()
            ),
        ));
    }
    ids.iter()
        .try_for_each(|&id| check_token_id(model, id, "stop_token_ids"))
}

pub(crate) fn check_token_id(
    model: &ServedModel,
    id: u32,
    param: &'static str,
) -> Result<(), ApiError> {
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

/// `value` (or `default` when absent) when it lies in `min..=max`; NaN and infinities never
/// do.
fn in_range(
    value: Option<f64>,
    param: &'static str,
    min: f64,
    max: f64,
    default: f32,
) -> Result<f32, ApiError> {
    match value {
        None => Ok(default),
        Some(v) if v.is_finite() && (min..=max).contains(&v) => Ok(v as f32),
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

/// Like vLLM, one message with the model's limit and both parts of the request.
fn check_context(
    model: &ServedModel,
    prompt_tokens: usize,
    max_tokens: u32,
    names: FieldNames,
) -> Result<(), ApiError> {
    let requested = prompt_tokens as u64 + u64::from(max_tokens);
    if requested <= model.context_tokens as u64 {
        return Ok(());
    }
    let param = if prompt_tokens >= model.context_tokens {
        names.prompt
    } else {
        names.max_tokens
    };
    Err(ApiError::invalid(
        param,
        format!(
            "This model's maximum context length is {} tokens. However, you requested \
             {requested} tokens ({prompt_tokens} in the prompt, {max_tokens} for the \
             completion). Please reduce the length of the {} or `{}`.",
            model.context_tokens, names.prompt, names.max_tokens
        ),
    )
    .with_code("context_length_exceeded"))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn ranges_and_defaults() {
        assert_eq!(in_range(None, "t", 0.0, 2.0, 1.0).unwrap(), 1.0);
        assert_eq!(in_range(Some(2.0), "t", 0.0, 2.0, 1.0).unwrap(), 2.0);
        assert_eq!(
            in_range(Some(2.01), "t", 0.0, 2.0, 1.0).unwrap_err().param,
            Some("t")
        );
        assert!(in_range(Some(f64::NAN), "t", 0.0, 2.0, 1.0).is_err());
        assert!(in_range(Some(f64::INFINITY), "t", 0.0, 2.0, 1.0).is_err());
        assert!(positive(0.0, "top_p").is_err());
    }

    #[test]
    fn stop_shapes_and_limits() {
        assert_eq!(stop_strings(None).unwrap(), Vec::<String>::new());
        assert_eq!(stop_strings(Some(json!("x"))).unwrap(), vec!["x"]);
        assert_eq!(stop_strings(Some(json!(["a", ""]))).unwrap(), vec!["a"]);
        assert!(stop_strings(Some(json!(["a", "b", "c", "d", "e"]))).is_err());
        assert!(stop_strings(Some(json!("x".repeat(257)))).is_err());
        assert!(stop_strings(Some(json!([1]))).is_err());
        assert!(stop_strings(Some(json!(1))).is_err());
    }

    #[test]
    fn logprob_limits() {
        assert_eq!(logprobs(5, "logprobs").unwrap(), 5);
        assert!(logprobs(6, "logprobs").is_err());
        assert_eq!(logprobs(20, "top_logprobs").unwrap(), 20);
        assert!(logprobs(-1, "top_logprobs").is_err());
    }
}
