//! `tessera generate --url URL`: the same request as the local path, sent to a running
//! server as `POST /v1/completions` (OpenAI's API with vLLM's `return_token_ids`,
//! `ignore_eos` and `top_k`), printed as the local path prints it.
//!
//! Differences from the local path: the answer comes whole (no streaming yet), so the
//! timings are the client's — `elapsed_s` for the whole request and `tokens_per_s` of
//! generated tokens over it — and `--chat` needs the server's chat endpoint, which the
//! coordinator does not serve yet.

use std::io::Write;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};
use serde::Serialize;
use serde_json::{Value, json};

use crate::generate::{DEFAULT_MAX_TOKENS, GenerateArgs};

/// How long connecting may take; the request itself has no limit (a long generation is
/// slow, not stuck).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The `--json` output: the local path's keys where the server gives the values, and the
/// client's timings.
#[derive(Debug, Serialize)]
struct JsonOutput {
    model: String,
    url: String,
    prompt_tokens: usize,
    prompt_token_ids: Vec<u32>,
    tokens: Vec<u32>,
    text: Option<String>,
    finish_reason: String,
    elapsed_s: f64,
    tokens_per_s: f64,
}

/// A model the server lists.
#[derive(Debug)]
struct ServedModel {
    id: String,
    /// Prompt plus completion tokens, when the server says.
    max_model_len: Option<usize>,
}

/// What the completion answered.
#[derive(Debug)]
struct Completion {
    prompt_token_ids: Vec<u32>,
    prompt_tokens: usize,
    tokens: Vec<u32>,
    text: String,
    finish_reason: String,
}

/// Runs the generation on the server at `url`.
pub fn generate(url: &str, args: &GenerateArgs) -> anyhow::Result<ExitCode> {
    if args.chat.is_some() {
        bail!(
            "--chat with --url needs the server's chat endpoint (/v1/chat/completions), which \
             comes with the serving work; use --prompt (with the chat template applied by \
             hand) or --prompt-tokens for now"
        );
    }
    let base = base_url(url);
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_connect(Some(CONNECT_TIMEOUT))
        .build()
        .into();
    let listed = models(&agent, &base);
    let (model, context) = match (&args.model, listed) {
        (Some(name), listed) => {
            let name = name.to_string_lossy().into_owned();
            let context = listed
                .ok()
                .and_then(|l| l.into_iter().find(|m| m.id == name))
                .and_then(|m| m.max_model_len);
            (name, context)
        }
        (None, Ok(listed)) => {
            let first = listed
                .into_iter()
                .next()
                .ok_or_else(|| anyhow!("{base}/v1/models lists no model; pass --model NAME"))?;
            (first.id, first.max_model_len)
        }
        (None, Err(error)) => return Err(error),
    };

    let prompt = match (&args.prompt_tokens, &args.prompt) {
        (Some(ids), _) if ids.is_empty() => bail!("--prompt-tokens needs at least one token id"),
        (Some(ids), _) => json!(ids),
        (None, Some(text)) => json!(text),
        (None, None) => bail!("give --prompt or --prompt-tokens"),
    };
    let known_prompt = args.prompt_tokens.as_ref().map_or(0, Vec::len);
    let max_tokens = args.max_tokens.unwrap_or_else(|| {
        context.map_or(DEFAULT_MAX_TOKENS, |c| {
            DEFAULT_MAX_TOKENS
                .min(c.saturating_sub(known_prompt))
                .max(1)
        })
    });
    let mut body = json!({
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "ignore_eos": args.ignore_eos,
        "return_token_ids": true,
    });
    if args.top_k > 0 {
        body["top_k"] = json!(args.top_k);
    }
    if let Some(seed) = args.seed {
        body["seed"] = json!(seed);
    }

    let started = Instant::now();
    let answer = post(&agent, &format!("{base}/v1/completions"), &body)?;
    let elapsed = started.elapsed().as_secs_f64();
    let completion = parse_completion(&answer)
        .with_context(|| format!("{base}/v1/completions answered an unexpected body"))?;
    let tokens_per_s = if elapsed > 0.0 {
        completion.tokens.len() as f64 / elapsed
    } else {
        0.0
    };
    let mut stdout = std::io::stdout().lock();
    if args.json {
        let text = (!completion.text.is_empty() || completion.tokens.is_empty())
            .then(|| completion.text.clone());
        let out = JsonOutput {
            model,
            url: base,
            prompt_tokens: completion.prompt_tokens,
            prompt_token_ids: completion.prompt_token_ids,
            tokens: completion.tokens,
            text,
            finish_reason: completion.finish_reason,
            elapsed_s: elapsed,
            tokens_per_s,
        };
        writeln!(stdout, "{}", serde_json::to_string(&out)?)?;
    } else {
        if completion.text.is_empty() && !completion.tokens.is_empty() {
            // A model served without a tokenizer: the ids, as the local path prints them.
            let ids: Vec<String> = completion.tokens.iter().map(u32::to_string).collect();
            write!(stdout, "{}", ids.join(","))?;
        } else {
            write!(stdout, "{}", completion.text)?;
        }
        writeln!(stdout)?;
        stdout.flush()?;
        eprintln!(
            "[{} prompt tokens, {} generated ({}); {elapsed:.2} s, {tokens_per_s:.1} tok/s end to end, {base}]",
            completion.prompt_tokens,
            completion.tokens.len(),
            completion.finish_reason,
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `url` without a trailing `/`, with `http://` when it names no scheme.
pub(crate) fn base_url(url: &str) -> String {
    let url = url.trim().trim_end_matches('/');
    if url.contains("://") {
        url.to_owned()
    } else {
        format!("http://{url}")
    }
}

/// `GET /v1/models`.
fn models(agent: &ureq::Agent, base: &str) -> anyhow::Result<Vec<ServedModel>> {
    let url = format!("{base}/v1/models");
    let mut response = agent
        .get(&url)
        .call()
        .map_err(|e| anyhow!("cannot reach the server at {base} (GET {url}): {e}"))?;
    let status = response.status().as_u16();
    let answer: Value = response
        .body_mut()
        .read_json()
        .map_err(|e| anyhow!("GET {url} answered {status} with a body that is not JSON: {e}"))?;
    if status != 200 {
        bail!("GET {url} answered {status}: {}", error_message(&answer));
    }
    let data = answer["data"]
        .as_array()
        .ok_or_else(|| anyhow!("GET {url}: no `data` list in the answer"))?;
    Ok(data
        .iter()
        .filter_map(|m| {
            Some(ServedModel {
                id: m["id"].as_str()?.to_owned(),
                max_model_len: m["max_model_len"].as_u64().map(|n| n as usize),
            })
        })
        .collect())
}

/// `POST url` with `body`: the JSON answer of a 200, or the server's error message.
fn post(agent: &ureq::Agent, url: &str, body: &Value) -> anyhow::Result<Value> {
    let mut response = agent
        .post(url)
        .send_json(body)
        .map_err(|e| anyhow!("cannot reach the server (POST {url}): {e}"))?;
    let status = response.status().as_u16();
    let answer: Value = response
        .body_mut()
        .read_json()
        .map_err(|e| anyhow!("POST {url} answered {status} with a body that is not JSON: {e}"))?;
    if status != 200 {
        bail!("the server answered {status}: {}", error_message(&answer));
    }
    Ok(answer)
}

/// The message of an OpenAI error envelope, or the whole answer.
pub(crate) fn error_message(answer: &Value) -> String {
    match answer["error"]["message"].as_str() {
        Some(message) => message.to_owned(),
        None => answer.to_string(),
    }
}

fn ids(value: &Value) -> Option<Vec<u32>> {
    value
        .as_array()?
        .iter()
        .map(|v| v.as_u64().and_then(|id| u32::try_from(id).ok()))
        .collect()
}

fn parse_completion(answer: &Value) -> anyhow::Result<Completion> {
    let choice = &answer["choices"][0];
    if choice.is_null() {
        bail!("no choices");
    }
    let tokens = ids(&choice["token_ids"]).ok_or_else(|| anyhow!("no choices[0].token_ids"))?;
    let prompt_token_ids = ids(&answer["prompt_token_ids"]).unwrap_or_default();
    let prompt_tokens = answer["usage"]["prompt_tokens"]
        .as_u64()
        .map_or(prompt_token_ids.len(), |n| n as usize);
    Ok(Completion {
        prompt_token_ids,
        prompt_tokens,
        tokens,
        text: choice["text"].as_str().unwrap_or_default().to_owned(),
        finish_reason: choice["finish_reason"]
            .as_str()
            .unwrap_or("unknown")
            .to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_get_a_scheme_and_lose_the_trailing_slash() {
        assert_eq!(base_url("127.0.0.1:8000/"), "http://127.0.0.1:8000");
        assert_eq!(base_url("https://h:1"), "https://h:1");
    }

    #[test]
    fn a_completion_is_read_with_its_token_ids() {
        let answer = json!({
            "choices": [{"index": 0, "text": " Paris", "finish_reason": "length",
                         "token_ids": [7, 8]}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
            "prompt_token_ids": [1, 2, 3],
        });
        let c = parse_completion(&answer).expect("parses");
        assert_eq!(c.tokens, [7, 8]);
        assert_eq!(c.prompt_token_ids, [1, 2, 3]);
        assert_eq!(c.prompt_tokens, 3);
        assert_eq!(c.text, " Paris");
        assert_eq!(c.finish_reason, "length");
        assert!(parse_completion(&json!({"choices": []})).is_err());
    }

    #[test]
    fn error_envelopes_give_their_message() {
        let envelope =
            json!({"error": {"message": "no model `x`", "type": "invalid_request_error"}});
        assert_eq!(error_message(&envelope), "no model `x`");
        assert_eq!(error_message(&json!({"detail": 1})), r#"{"detail":1}"#);
    }
}
