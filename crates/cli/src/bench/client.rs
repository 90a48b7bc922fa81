//! One request against the server, timed: streamed (server-sent events, each read stamped
//! with `Instant::now()` as its bytes arrive) or whole.
//!
//! Token timing of a stream: the TTFT is the arrival of the first chunk with content; each
//! later content chunk adds the gap since the previous one as inter-token latencies. A
//! chunk carrying `k` tokens adds `k` latencies of `gap / k` (the tokens are spread evenly
//! over the gap); the extra tokens of the first chunk add none. A chunk's token count is
//! its `token_ids` when the server sends them; otherwise `usage.completion_tokens` is
//! spread over the content chunks as evenly as whole numbers allow (1 each when the server
//! sends one token per chunk, as vLLM, llama.cpp and Tessera do); without usage each chunk
//! counts as one token.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::args::{BenchConfig, Endpoint};
use super::stats::RequestTimings;
use super::workload::{Prompt, RequestSpec};
use crate::http::sse::{SseEvent, SseStream, StreamChunk, read_chunk};
use crate::http::{self, CONNECT_TIMEOUT, ClientOptions, PostError, error_message};

/// Longest error message kept from a body that is not an error envelope.
const ERROR_TEXT_CHARS: usize = 200;

/// A successful request.
#[derive(Debug, Clone, PartialEq)]
pub struct Finished {
    pub timings: RequestTimings,
    /// The server sent `usage` (otherwise token counts are the client's estimate).
    pub usage_reported: bool,
}

/// What one request gave: its timings, or why it failed (HTTP status and message,
/// transport error, or a malformed answer).
pub type Outcome = Result<Finished, String>;

/// Sends requests to one server; shared by every worker thread.
#[derive(Debug)]
pub struct Client {
    http: http::Client,
    model: String,
    endpoint: Endpoint,
    stream: bool,
    temperature: f64,
    ignore_eos: bool,
    extra_body: serde_json::Map<String, Value>,
}

/// The server-independent settings of a [`Client`].
#[derive(Debug, Clone)]
pub struct ClientSettings {
    pub base: String,
    pub api_key: Option<String>,
    pub endpoint: Endpoint,
    pub temperature: f64,
    pub ignore_eos: bool,
}

impl Client {
    /// A client for `settings.base`; `model` is filled in by [`Client::resolve_model`].
    pub fn new(settings: ClientSettings, config: &BenchConfig) -> Self {
        let options = ClientOptions {
            connect_timeout: Some(CONNECT_TIMEOUT),
            request_timeout: Some(config.request_timeout),
            // One kept-alive connection per worker, so no request pays for a new one.
            idle_connections: Some(config.mode.max_in_flight() + 1),
            ..ClientOptions::default()
        };
        Self {
            http: http::Client::new(&settings.base, settings.api_key, options),
            model: String::new(),
            endpoint: settings.endpoint,
            stream: config.stream,
            temperature: settings.temperature,
            ignore_eos: settings.ignore_eos,
            extra_body: config.extra_body.clone(),
        }
    }

    pub fn model(&self) -> &str {
        &self.model
    }

    /// Uses `model`, or the first model of `GET /v1/models`.
    pub fn resolve_model(&mut self, model: Option<String>) -> anyhow::Result<()> {
        self.model = match model {
            Some(model) => model,
            None => self.first_model()?,
        };
        Ok(())
    }

    fn first_model(&self) -> anyhow::Result<String> {
        let path = "/v1/models";
        let answer = self.http.get_json(path)?;
        answer["data"][0]["id"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| {
                let url = self.http.url(path);
                anyhow::anyhow!("GET {url} lists no model; pass --model NAME")
            })
    }

    /// The request body for `spec`.
    pub fn body(&self, spec: &RequestSpec) -> Value {
        let mut body = json!({
            "model": self.model,
            "max_tokens": spec.max_tokens,
            "temperature": self.temperature,
            "stream": self.stream,
        });
        match (self.endpoint, &spec.prompt) {
            (Endpoint::Completions, Prompt::Text(text)) => body["prompt"] = json!(text),
            (_, Prompt::Tokens(ids)) => {
                // Only with completions (checked with the flags). A model served without a
                // tokenizer has no text to stream: the ids make each chunk's content.
                body["prompt"] = json!(ids);
                body["return_token_ids"] = json!(true);
            }
            (Endpoint::Chat, Prompt::Text(text)) => {
                body["messages"] = json!([{"role": "user", "content": text}]);
            }
            // The workload only reads `messages` with the chat endpoint.
            (_, Prompt::Messages(messages)) => body["messages"] = messages.clone(),
        }
        if self.stream {
            body["stream_options"] = json!({"include_usage": true});
        }
        if self.ignore_eos {
            // `ignore_eos` for vLLM, Tessera and llama.cpp's own server; `min_tokens` for
            // llama-cpp-python's server, which has no `ignore_eos` but holds EOS back until
            // `min_tokens` (vLLM honours both).
            body["ignore_eos"] = json!(true);
            body["min_tokens"] = json!(spec.max_tokens);
        }
        if let Value::Object(map) = &mut body {
            map.extend(self.extra_body.clone());
        }
        body
    }

    /// Sends one request and times it. Never panics on what the server answers.
    pub fn send(&self, spec: &RequestSpec) -> Outcome {
        let path = self.endpoint.path();
        let body = self.body(spec);
        let started = Instant::now();
        let mut response = self.http.post(path, &body).map_err(|error| match error {
            PostError::Unreachable(e) => format!("POST {} failed: {e}", self.http.url(path)),
            PostError::Status { status, body } => format!("HTTP {status}: {}", error_text(&body)),
        })?;
        if !self.stream {
            let answer: Value = response
                .body_mut()
                .read_json()
                .map_err(|e| format!("the answer is not JSON: {e}"))?;
            return read_whole(&answer, started.elapsed(), spec.prompt_tokens_estimate);
        }
        let mut stream = SseStream::new(response.into_body().into_reader());
        let mut timeline = StreamTimeline::default();
        let e2e = loop {
            let read = stream
                .read()
                .map_err(|e| format!("reading the stream failed: {e}"))?;
            let at = read.at - started;
            for event in &read.events {
                timeline.event(event, at)?;
            }
            if read.ended {
                break at;
            }
            if timeline.done {
                // Read the body's end too, so the connection can serve the next request;
                // the request itself ended with `[DONE]`.
                stream.drain();
                break at;
            }
        };
        timeline.finish(e2e, spec.prompt_tokens_estimate)
    }
}

/// The message of an error answer: its OpenAI envelope's, or the start of its text.
fn error_text(text: &str) -> String {
    match serde_json::from_str::<Value>(text) {
        Ok(answer) if !answer["error"].is_null() || answer.is_object() => match &answer["error"] {
            Value::String(message) => message.clone(),
            _ => error_message(&answer),
        },
        _ if text.trim().is_empty() => "(empty body)".to_owned(),
        _ => text.trim().chars().take(ERROR_TEXT_CHARS).collect(),
    }
}

/// The timings of a whole (unstreamed) answer.
fn read_whole(answer: &Value, e2e: Duration, prompt_tokens_estimate: usize) -> Outcome {
    if !answer["error"].is_null() {
        return Err(error_text(&answer.to_string()));
    }
    let choice = &answer["choices"][0];
    if !choice.is_object() {
        return Err("the answer has no choices".to_owned());
    }
    let usage = &answer["usage"];
    let (prompt, completion) = (
        usage["prompt_tokens"].as_u64(),
        usage["completion_tokens"].as_u64(),
    );
    let completion_tokens = completion
        .map(|n| n as usize)
        .or_else(|| choice["token_ids"].as_array().map(Vec::len))
        .unwrap_or(0);
    Ok(Finished {
        timings: RequestTimings {
            ttft: None,
            itls: Vec::new(),
            e2e,
            prompt_tokens: prompt.map_or(prompt_tokens_estimate, |n| n as usize),
            completion_tokens,
        },
        usage_reported: prompt.is_some() && completion.is_some(),
    })
}

/// What a stream has said so far; times are since the request was sent.
#[derive(Debug, Default)]
struct StreamTimeline {
    /// Arrival of each chunk with content, and its `token_ids` count when given.
    chunks: Vec<(Duration, Option<usize>)>,
    usage: Option<(usize, usize)>,
    finished: bool,
    done: bool,
}

impl StreamTimeline {
    fn event(&mut self, event: &SseEvent, at: Duration) -> Result<(), String> {
        match read_chunk(event) {
            StreamChunk::Done => self.done = true,
            StreamChunk::Error(message) => return Err(format!("error in the stream: {message}")),
            StreamChunk::Delta {
                text,
                tokens,
                usage,
                finish_reason,
            } => {
                if !text.is_empty() || tokens.is_some_and(|k| k > 0) {
                    self.chunks.push((at, tokens));
                }
                if usage.is_some() {
                    self.usage = usage;
                }
                self.finished |= finish_reason.is_some();
            }
        }
        Ok(())
    }

    fn finish(self, e2e: Duration, prompt_tokens_estimate: usize) -> Outcome {
        if !self.done && !self.finished {
            return Err("the stream ended before its last chunk".to_owned());
        }
        let counts = chunk_token_counts(&self.chunks, self.usage.map(|(_, c)| c));
        let completion_tokens = match self.usage {
            Some((_, completion)) => completion,
            None => counts.iter().sum(),
        };
        Ok(Finished {
            timings: RequestTimings {
                ttft: self.chunks.first().map(|&(at, _)| at),
                itls: spread_itls(&self.chunks, &counts),
                e2e,
                prompt_tokens: self.usage.map_or(prompt_tokens_estimate, |(p, _)| p),
                completion_tokens,
            },
            usage_reported: self.usage.is_some(),
        })
    }
}

/// Tokens of each content chunk: their `token_ids` when every chunk has them, else
/// `usage_tokens` spread evenly (the remainder to the last chunks), else 1 each.
fn chunk_token_counts(
    chunks: &[(Duration, Option<usize>)],
    usage_tokens: Option<usize>,
) -> Vec<usize> {
    if let Some(counts) = chunks
        .iter()
        .map(|&(_, k)| k)
        .collect::<Option<Vec<usize>>>()
    {
        return counts;
    }
    let n = chunks.len();
    match usage_tokens {
        Some(total) if n > 0 && total > n => {
            let (base, extra) = (total / n, total % n);
            (0..n).map(|i| base + usize::from(i >= n - extra)).collect()
        }
        _ => vec![1; n],
    }
}

/// Inter-token latencies: the gap before each chunk after the first, split evenly over its
/// tokens.
fn spread_itls(chunks: &[(Duration, Option<usize>)], counts: &[usize]) -> Vec<Duration> {
    let mut itls = Vec::with_capacity(counts.iter().sum());
    for (pair, &count) in chunks.windows(2).zip(counts.iter().skip(1)) {
        let gap = pair[1].0.saturating_sub(pair[0].0);
        let count = count.max(1);
        let each = gap / u32::try_from(count).unwrap_or(u32::MAX);
        itls.extend(std::iter::repeat_n(each, count));
    }
    itls
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn event(data: &str) -> SseEvent {
        SseEvent {
            name: None,
            data: data.to_owned(),
        }
    }

    #[test]
    fn chunks_of_several_tokens_spread_their_gap() {
        let chunks = [(ms(100), Some(1)), (ms(130), Some(3)), (ms(150), Some(1))];
        let counts = chunk_token_counts(&chunks, Some(5));
        assert_eq!(counts, [1, 3, 1]);
        assert_eq!(
            spread_itls(&chunks, &counts),
            [ms(10), ms(10), ms(10), ms(20)]
        );
        // No token ids: usage spread with the remainder last; no usage: one per chunk.
        let bare = [(ms(0), None), (ms(10), None), (ms(20), None)];
        assert_eq!(chunk_token_counts(&bare, Some(7)), [2, 2, 3]);
        assert_eq!(chunk_token_counts(&bare, Some(2)), [1, 1, 1]);
        assert_eq!(chunk_token_counts(&bare, None), [1, 1, 1]);
        assert!(spread_itls(&[], &[]).is_empty());
    }

    #[test]
    fn a_stream_gives_ttft_itls_and_usage() {
        let mut t = StreamTimeline::default();
        t.event(
            &event(r#"{"choices":[{"delta":{"role":"assistant"}}]}"#),
            ms(5),
        )
        .expect("ok");
        t.event(&event(r#"{"choices":[{"text":"a"}]}"#), ms(50))
            .expect("ok");
        t.event(&event(r#"{"choices":[{"text":"b"}]}"#), ms(70))
            .expect("ok");
        t.event(
            &event(r#"{"choices":[{"text":"c","finish_reason":"length"}]}"#),
            ms(100),
        )
        .expect("ok");
        t.event(
            &event(r#"{"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":3}}"#),
            ms(101),
        )
        .expect("ok");
        t.event(&event("[DONE]"), ms(102)).expect("ok");
        let f = t.finish(ms(103), 4).expect("finished");
        assert!(f.usage_reported);
        assert_eq!(f.timings.ttft, Some(ms(50)));
        assert_eq!(f.timings.itls, [ms(20), ms(30)]);
        assert_eq!(
            (f.timings.prompt_tokens, f.timings.completion_tokens),
            (9, 3)
        );
        assert_eq!(f.timings.e2e, ms(103));
    }

    #[test]
    fn streams_without_usage_count_chunks_and_bad_streams_fail() {
        let mut t = StreamTimeline::default();
        t.event(&event(r#"{"choices":[{"text":"a"}]}"#), ms(10))
            .expect("ok");
        t.event(&event(r#"{"choices":[{"text":"b"}]}"#), ms(20))
            .expect("ok");
        t.event(&event("[DONE]"), ms(21)).expect("ok");
        let f = t.finish(ms(22), 16).expect("finished");
        assert!(!f.usage_reported);
        assert_eq!(
            (f.timings.prompt_tokens, f.timings.completion_tokens),
            (16, 2)
        );

        let mut t = StreamTimeline::default();
        t.event(&event(r#"{"choices":[{"text":"a"}]}"#), ms(10))
            .expect("ok");
        assert!(
            t.finish(ms(11), 1)
                .expect_err("cut")
                .contains("ended before")
        );

        let mut t = StreamTimeline::default();
        let error = t
            .event(&event(r#"{"error":{"message":"boom"}}"#), ms(1))
            .expect_err("error");
        assert_eq!(error, "error in the stream: boom");
    }

    #[test]
    fn token_id_prompts_are_sent_as_ids_and_ask_for_ids_back() {
        let config = BenchConfig {
            mode: super::super::args::LoadMode::Closed { concurrency: 1 },
            stop: super::super::args::StopRule {
                requests: Some(1),
                duration: None,
            },
            warmup: 0,
            seed: 0,
            stream: true,
            request_timeout: Duration::from_secs(1),
            extra_body: serde_json::Map::new(),
        };
        let settings = ClientSettings {
            base: "http://127.0.0.1:9".to_owned(),
            api_key: None,
            endpoint: Endpoint::Completions,
            temperature: 0.0,
            ignore_eos: true,
        };
        let mut client = Client::new(settings, &config);
        client.resolve_model(Some("m".to_owned())).expect("given");
        let spec = |prompt| RequestSpec {
            prompt,
            prompt_tokens_estimate: 2,
            max_tokens: 3,
        };
        let body = client.body(&spec(Prompt::Tokens(vec![5, 7])));
        assert_eq!(body["prompt"], json!([5, 7]));
        assert_eq!(body["return_token_ids"], json!(true));
        assert_eq!(body["stream_options"], json!({"include_usage": true}));
        assert_eq!(
            (body["max_tokens"].clone(), body["min_tokens"].clone()),
            (json!(3), json!(3))
        );
        let body = client.body(&spec(Prompt::Text("a b".to_owned())));
        assert_eq!(body["prompt"], json!("a b"));
        assert!(body.get("return_token_ids").is_none(), "{body}");
    }

    #[test]
    fn whole_answers_and_error_bodies_are_read() {
        let answer = json!({"choices": [{"text": "x y"}],
                            "usage": {"prompt_tokens": 5, "completion_tokens": 2}});
        let f = read_whole(&answer, ms(40), 3).expect("finished");
        assert_eq!(
            (f.timings.prompt_tokens, f.timings.completion_tokens),
            (5, 2)
        );
        assert_eq!((f.timings.ttft, f.timings.e2e), (None, ms(40)));
        assert!(read_whole(&json!({"choices": []}), ms(1), 1).is_err());
        assert!(read_whole(&json!({"error": {"message": "m"}}), ms(1), 1).is_err());

        assert_eq!(
            error_text(r#"{"error":{"message":"no model `x`"}}"#),
            "no model `x`"
        );
        assert_eq!(error_text(r#"{"error":"overloaded"}"#), "overloaded");
        assert_eq!(
            error_text("Internal Server Error\n"),
            "Internal Server Error"
        );
        assert_eq!(error_text(""), "(empty body)");
    }
}
