//! `tessera generate --url URL`: the same request as the local path, sent to a running
//! server — `POST /v1/completions` for `--prompt` and `--prompt-tokens`,
//! `POST /v1/chat/completions` for `--chat` (the server applies the model's template) —
//! streamed (server-sent events) and printed as the local path prints it. OpenAI's API with
//! vLLM's `return_token_ids`, `ignore_eos` and `top_k`; the key from `--api-key`,
//! `TESSERA_API_KEY` or `OPENAI_API_KEY`.
//!
//! The timings are the client's: time to the first token, and generated tokens per second
//! after it.

use std::io::Write;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};
use serde::Serialize;
use serde_json::{Value, json};

use crate::generate::{DEFAULT_MAX_TOKENS, GenerateArgs};
use crate::http::sse::{SseStream, choice_text};
use crate::http::{self, CONNECT_TIMEOUT, Client, ClientOptions, PostError, error_message};

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
    ttft_s: f64,
    elapsed_s: f64,
    decode_tokens_per_s: f64,
}

/// A model the server lists.
#[derive(Debug)]
struct ServedModel {
    id: String,
    /// Prompt plus completion tokens, when the server says.
    max_model_len: Option<usize>,
}

/// The completion, as its chunks build it up.
#[derive(Debug, Default)]
struct Completion {
    prompt_token_ids: Vec<u32>,
    prompt_tokens: Option<usize>,
    tokens: Vec<u32>,
    text: String,
    finish_reason: Option<String>,
    done: bool,
}

impl Completion {
    /// Adds one event's data; returns the text it adds.
    fn add(&mut self, data: &str) -> anyhow::Result<String> {
        let data = data.trim();
        if data == "[DONE]" {
            self.done = true;
            return Ok(String::new());
        }
        let chunk: Value = serde_json::from_str(data)
            .map_err(|e| anyhow!("a stream event is not JSON ({e}): {data}"))?;
        if !chunk["error"].is_null() {
            bail!("the server failed mid-stream: {}", error_message(&chunk));
        }
        if let Some(ids) = ids(&chunk["prompt_token_ids"]) {
            self.prompt_token_ids = ids;
        }
        if let Some(n) = chunk["usage"]["prompt_tokens"].as_u64() {
            self.prompt_tokens = Some(n as usize);
        }
        let choice = &chunk["choices"][0];
        if choice.is_null() {
            return Ok(String::new());
        }
        self.tokens
            .extend(ids(&choice["token_ids"]).unwrap_or_default());
        if let Some(reason) = choice["finish_reason"].as_str() {
            self.finish_reason = Some(reason.to_owned());
        }
        let text = choice_text(choice);
        self.text.push_str(text);
        Ok(text.to_owned())
    }
}

/// A finished stream: the completion and the client's timings, in seconds since the
/// request was sent.
#[derive(Debug)]
struct Streamed {
    completion: Completion,
    ttft_s: f64,
    elapsed_s: f64,
}

impl Streamed {
    /// Generated tokens per second after the first.
    fn decode_tokens_per_s(&self) -> f64 {
        let tokens = self.completion.tokens.len();
        if tokens > 1 && self.elapsed_s > self.ttft_s {
            (tokens - 1) as f64 / (self.elapsed_s - self.ttft_s)
        } else {
            0.0
        }
    }
}

/// Runs the generation on the server at `url`.
pub fn generate(url: &str, args: &GenerateArgs) -> anyhow::Result<ExitCode> {
    // No limit on the request itself: a long generation is slow, not stuck.
    let options = ClientOptions {
        connect_timeout: Some(CONNECT_TIMEOUT),
        ..ClientOptions::default()
    };
    let client = Client::new(url, http::api_key(args.api_key.as_deref()), options);
    let (model, context) = choose_model(&client, args)?;
    let (path, body) = request_body(args, &model, context)?;
    let streamed = stream(&client, path, &body, !args.json)?;
    if args.json {
        print_json(streamed, model, client.base())?;
    } else {
        print_summary(&streamed, client.base())?;
    }
    Ok(ExitCode::SUCCESS)
}

/// The model to ask for and its context length (prompt plus completion tokens) when the
/// server lists it: `--model`, else the first model the server lists.
fn choose_model(client: &Client, args: &GenerateArgs) -> anyhow::Result<(String, Option<usize>)> {
    let listed = models(client);
    Ok(match (&args.model, listed) {
        (Some(name), listed) => {
            let name = name.to_string_lossy().into_owned();
            let context = listed
                .ok()
                .and_then(|l| l.into_iter().find(|m| m.id == name))
                .and_then(|m| m.max_model_len);
            (name, context)
        }
        (None, Ok(listed)) => {
            let first = listed.into_iter().next().ok_or_else(|| {
                anyhow!(
                    "{}/v1/models lists no model; pass --model NAME",
                    client.base()
                )
            })?;
            (first.id, first.max_model_len)
        }
        (None, Err(error)) => return Err(error),
    })
}

/// The endpoint and streamed body of the request `args` describe, for `model` with
/// `context` tokens: `--max-tokens`, else the local path's default cut to what the
/// context leaves after a prompt of known length.
fn request_body(
    args: &GenerateArgs,
    model: &str,
    context: Option<usize>,
) -> anyhow::Result<(&'static str, Value)> {
    let (path, mut body, known_prompt) = match (&args.prompt_tokens, &args.prompt, &args.chat) {
        (Some(ids), _, _) if ids.is_empty() => {
            bail!("--prompt-tokens needs at least one token id")
        }
        (Some(ids), _, _) => ("/v1/completions", json!({"prompt": ids}), ids.len()),
        (None, Some(text), _) => ("/v1/completions", json!({"prompt": text}), 0),
        (None, None, Some(message)) => (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": message}]}),
            0,
        ),
        (None, None, None) => bail!("give --prompt, --chat or --prompt-tokens"),
    };
    let max_tokens = args.max_tokens.unwrap_or_else(|| {
        context.map_or(DEFAULT_MAX_TOKENS, |c| {
            DEFAULT_MAX_TOKENS
                .min(c.saturating_sub(known_prompt))
                .max(1)
        })
    });
    body["model"] = json!(model);
    body["max_tokens"] = json!(max_tokens);
    body["temperature"] = json!(args.temperature);
    body["top_p"] = json!(args.top_p);
    body["ignore_eos"] = json!(args.ignore_eos);
    body["return_token_ids"] = json!(true);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    if args.top_k > 0 {
        body["top_k"] = json!(args.top_k);
    }
    if let Some(seed) = args.seed {
        body["seed"] = json!(seed);
    }
    Ok((path, body))
}

/// Sends `body` to `path` and reads the streamed completion, printing its text to stdout
/// as it arrives when `echo`.
fn stream(client: &Client, path: &str, body: &Value, echo: bool) -> anyhow::Result<Streamed> {
    let url = client.url(path);
    let started = Instant::now();
    let response = client.post(path, body).map_err(|error| match error {
        PostError::Unreachable(e) => anyhow!("cannot reach the server (POST {url}): {e}"),
        PostError::Status { status, body } => {
            let message = serde_json::from_str(&body).map_or(body, |v| error_message(&v));
            anyhow!("the server answered {status}: {message}")
        }
    })?;
    let mut stdout = std::io::stdout().lock();
    let mut completion = Completion::default();
    let mut first_token: Option<Duration> = None;
    let mut stream = SseStream::new(response.into_body().into_reader());
    while !completion.done {
        let read = stream
            .read()
            .with_context(|| format!("reading the stream of POST {url}"))?;
        for event in read.events {
            let had = completion.tokens.len();
            let text = completion.add(&event.data)?;
            if completion.tokens.len() > had && first_token.is_none() {
                first_token = Some(started.elapsed());
            }
            if echo {
                write!(stdout, "{text}")?;
                stdout.flush()?;
            }
        }
        if read.ended && !completion.done {
            bail!("the stream of POST {url} ended before its last event");
        }
    }
    let elapsed_s = started.elapsed().as_secs_f64();
    Ok(Streamed {
        completion,
        ttft_s: first_token.map_or(elapsed_s, |t| t.as_secs_f64()),
        elapsed_s,
    })
}

/// `--json`: one line with the local path's keys and the client's timings.
fn print_json(streamed: Streamed, model: String, base: &str) -> anyhow::Result<()> {
    let decode_tokens_per_s = streamed.decode_tokens_per_s();
    let Streamed {
        completion,
        ttft_s,
        elapsed_s,
    } = streamed;
    let text = (!completion.text.is_empty() || completion.tokens.is_empty())
        .then(|| completion.text.clone());
    let out = JsonOutput {
        model,
        url: base.to_owned(),
        prompt_tokens: completion
            .prompt_tokens
            .unwrap_or(completion.prompt_token_ids.len()),
        prompt_token_ids: completion.prompt_token_ids,
        tokens: completion.tokens,
        text,
        finish_reason: completion
            .finish_reason
            .unwrap_or_else(|| "unknown".to_owned()),
        ttft_s,
        elapsed_s,
        decode_tokens_per_s,
    };
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{}", serde_json::to_string(&out)?)?;
    Ok(())
}

/// After the streamed text: the ids when there was no text, then the counts and timings
/// on stderr.
fn print_summary(streamed: &Streamed, base: &str) -> anyhow::Result<()> {
    let completion = &streamed.completion;
    let mut stdout = std::io::stdout().lock();
    if completion.text.is_empty() && !completion.tokens.is_empty() {
        // A model served without a tokenizer: the ids, as the local path prints them.
        let ids: Vec<String> = completion.tokens.iter().map(u32::to_string).collect();
        write!(stdout, "{}", ids.join(","))?;
    }
    writeln!(stdout)?;
    stdout.flush()?;
    let prompt_tokens = completion
        .prompt_tokens
        .unwrap_or(completion.prompt_token_ids.len());
    let finish_reason = completion.finish_reason.as_deref().unwrap_or("unknown");
    eprintln!(
        "[{prompt_tokens} prompt tokens, {} generated ({finish_reason}); first token after {:.0} ms, {:.1} tok/s after it, {base}]",
        completion.tokens.len(),
        streamed.ttft_s * 1e3,
        streamed.decode_tokens_per_s(),
    );
    Ok(())
}

/// `GET /v1/models`.
fn models(client: &Client) -> anyhow::Result<Vec<ServedModel>> {
    let path = "/v1/models";
    let answer = client.get_json(path)?;
    let data = answer["data"]
        .as_array()
        .ok_or_else(|| anyhow!("GET {}: no `data` list in the answer", client.url(path)))?;
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

fn ids(value: &Value) -> Option<Vec<u32>> {
    value
        .as_array()?
        .iter()
        .map(|v| v.as_u64().and_then(|id| u32::try_from(id).ok()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completion_and_chat_chunks_build_the_completion() {
        let mut c = Completion::default();
        let first = json!({"choices": [{"index": 0, "text": " Par", "token_ids": [7],
                           "finish_reason": null}], "prompt_token_ids": [1, 2, 3]});
        assert_eq!(c.add(&first.to_string()).unwrap(), " Par");
        let chat = json!({"choices": [{"index": 0, "delta": {"content": "is"},
                          "token_ids": [8], "finish_reason": "length"}]});
        assert_eq!(c.add(&chat.to_string()).unwrap(), "is");
        let usage = json!({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}});
        assert_eq!(c.add(&usage.to_string()).unwrap(), "");
        assert!(!c.done);
        c.add(" [DONE]").unwrap();
        assert!(c.done);
        assert_eq!(c.tokens, [7, 8]);
        assert_eq!(c.prompt_token_ids, [1, 2, 3]);
        assert_eq!(c.prompt_tokens, Some(3));
        assert_eq!(c.text, " Paris");
        assert_eq!(c.finish_reason.as_deref(), Some("length"));
    }

    #[test]
    fn error_events_and_garbage_fail_the_stream() {
        let mut c = Completion::default();
        let error = json!({"error": {"message": "shard 1 died", "type": "server_error"}});
        let message = c.add(&error.to_string()).unwrap_err().to_string();
        assert!(message.contains("shard 1 died"), "{message}");
        assert!(c.add("{not json").is_err());
    }
}
