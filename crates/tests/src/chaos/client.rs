//! The chaos run's clients: completions streamed or not, greedy or sampled, on short and
//! long prompts, each with an `Idempotency-Key`, and some clients that go away in the middle
//! of a stream. A client whose connection breaks retries the same key on another peer
//! (answered from the request journal), and a stream resumes with `GET /v1/streams/{id}`
//! and `Last-Event-ID`, until the request ends or its deadline passes.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::schedule::Rng;
use crate::{SseEvent, TEST_API_KEY, read_sse};

/// The served model's name in the chaos topology.
pub const MODEL: &str = "demo";
/// How long a request may take, faults included, before it counts as lost.
pub const DEADLINE: Duration = Duration::from_secs(150);

/// A prompt of the run and the tokens to generate for it.
#[derive(Clone, Debug)]
pub struct Prompt {
    pub tokens: Vec<u32>,
    pub max_tokens: usize,
}

/// Six short prompts (4 to 12 tokens, 24 to 40 new tokens) and six long ones (150 to 250
/// tokens, 8 to 16 new), the same for a seed.
pub fn prompts(seed: u64) -> Vec<Prompt> {
    let mut rng = Rng::new(seed ^ 0x70_726f_6d70_7473);
    (0..12)
        .map(|i| {
            let long = i >= 6;
            let len = if long {
                150 + rng.below(100)
            } else {
                4 + rng.below(8)
            };
            let max_tokens = if long {
                8 + rng.below(8)
            } else {
                24 + rng.below(16)
            };
            Prompt {
                tokens: (0..len).map(|_| 10 + rng.below(8000) as u32).collect(),
                max_tokens: max_tokens as usize,
            }
        })
        .collect()
}

/// How a request is sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Plain,
    Stream,
    /// A stream the client drops after two events.
    LeaveEarly,
}

/// One request of the load.
#[derive(Clone, Debug)]
pub struct Spec {
    pub prompt: usize,
    pub greedy: bool,
    pub mode: Mode,
    pub key: String,
}

impl Spec {
    /// Request `n` of client `client`: 45 % plain, 45 % streamed, 10 % left early; 70 %
    /// greedy.
    pub fn draw(rng: &mut Rng, prompts: usize, key: String) -> Spec {
        let mode = match rng.below(20) {
            0..=8 => Mode::Plain,
            9..=17 => Mode::Stream,
            _ => Mode::LeaveEarly,
        };
        Spec {
            prompt: rng.below(prompts as u64) as usize,
            greedy: rng.chance(0.7),
            mode,
            key,
        }
    }

    pub fn body(&self, prompt: &Prompt) -> Value {
        let mut body = json!({
            "model": MODEL, "prompt": prompt.tokens, "max_tokens": prompt.max_tokens,
            "ignore_eos": true, "return_token_ids": true,
            "stream": self.mode != Mode::Plain,
        });
        if self.greedy {
            body["temperature"] = json!(0);
        } else {
            body["temperature"] = json!(0.9);
            body["top_p"] = json!(0.95);
        }
        body
    }
}

/// How a request ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum End {
    /// Every token arrived; `retried` when that took another connection (a retry of the
    /// key, or a resumed stream).
    Completed { tokens: Vec<u32>, retried: bool },
    /// Accepted (a response id or a 200), then told of an error: `status code: message`.
    Failed(String),
    /// Refused before it was accepted: `status code: message`.
    Refused(String),
    /// The client went away in the middle of the stream, as planned.
    Left,
    /// Accepted, but it neither finished nor was told of an error by the deadline.
    Lost(String),
    /// Never accepted and never answered by the deadline.
    Unanswered(String),
}

/// A request, how it ended, and after how many connections.
#[derive(Clone, Debug)]
pub struct Outcome {
    pub spec: Spec,
    pub end: End,
    pub connections: usize,
    pub took: Duration,
}

/// The client side of one request against the peers `urls`, starting with `first`.
/// `resilient` false makes a client that gives up when its connection breaks (to see the
/// harness fail).
pub fn run(
    urls: &[String],
    first: usize,
    spec: &Spec,
    prompt: &Prompt,
    resilient: bool,
) -> Outcome {
    let start = Instant::now();
    let mut client = Client {
        urls,
        peer: first,
        connections: 0,
        accepted: false,
        tokens: Vec::new(),
        last_event: None,
    };
    let end = client.request(spec, &spec.body(prompt), start + DEADLINE, resilient);
    Outcome {
        spec: spec.clone(),
        end,
        connections: client.connections,
        took: start.elapsed(),
    }
}

struct Client<'a> {
    urls: &'a [String],
    peer: usize,
    connections: usize,
    accepted: bool,
    tokens: Vec<u32>,
    last_event: Option<String>,
}

/// What one connection of a stream gave.
enum Read {
    Done,
    Broken,
    Error(String),
    Left,
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_connect(Some(Duration::from_secs(3)))
        .timeout_recv_response(Some(Duration::from_secs(60)))
        .timeout_per_read(Some(Duration::from_secs(30)))
        .build()
        .into()
}

/// `status code: message` of an error answer; the ledger counts by `status code`.
fn reason(status: u16, answer: &Value) -> String {
    let error = &answer["error"];
    let code = error["code"]
        .as_str()
        .or_else(|| error["type"].as_str())
        .unwrap_or("no_code");
    let message = error["message"].as_str().unwrap_or_default();
    format!("{status} {code}: {message}")
}

impl Client<'_> {
    fn url(&self) -> &str {
        &self.urls[self.peer % self.urls.len()]
    }

    fn next_peer(&mut self) {
        self.peer += 1;
        std::thread::sleep(Duration::from_millis(200));
    }

    fn give_up(&self, why: String) -> End {
        if self.accepted {
            End::Lost(why)
        } else {
            End::Unanswered(why)
        }
    }

    fn request(&mut self, spec: &Spec, body: &Value, deadline: Instant, resilient: bool) -> End {
        let mut last = String::from("no attempt");
        let mut refusals = 0;
        // Send (and, after a broken connection, send again with the same key) until the
        // request is accepted and answered.
        let id = loop {
            if Instant::now() > deadline || (!resilient && self.connections > 0) {
                return self.give_up(format!("no answer: {last}"));
            }
            self.connections += 1;
            let url = format!("{}/v1/completions", self.url());
            let response = agent()
                .post(&url)
                .header("Authorization", &format!("Bearer {TEST_API_KEY}"))
                .header("Idempotency-Key", &spec.key)
                .send_json(body);
            let mut response = match response {
                Ok(r) => r,
                Err(error) => {
                    last = format!("POST {url}: {error}");
                    self.next_peer();
                    continue;
                }
            };
            let status = response.status().as_u16();
            let id = response
                .headers()
                .get("x-request-id")
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            self.accepted |= status == 200 || id.is_some();
            if status != 200 {
                let answer: Value = response.body_mut().read_json().unwrap_or(Value::Null);
                let why = reason(status, &answer);
                // Shed or no leader yet: come back (after `Retry-After: 1`), a few times.
                if matches!(status, 429 | 503) && refusals < 5 && resilient {
                    refusals += 1;
                    last = why;
                    std::thread::sleep(Duration::from_millis(800));
                    self.next_peer();
                    continue;
                }
                return if self.accepted {
                    End::Failed(why)
                } else {
                    End::Refused(why)
                };
            }
            if spec.mode == Mode::Plain {
                match response.body_mut().read_json::<Value>() {
                    Ok(answer) => return self.answered(&answer),
                    Err(error) => {
                        last = format!("POST {url}: the body broke: {error}");
                        self.next_peer();
                        continue;
                    }
                }
            }
            let Some(id) = id else {
                return End::Failed("200 stream without x-request-id".into());
            };
            let reader = std::io::BufReader::new(response.into_body().into_reader());
            match self.read(reader, spec.mode == Mode::LeaveEarly) {
                Read::Done => return self.completed(),
                Read::Error(why) => return End::Failed(why),
                Read::Left => return End::Left,
                Read::Broken => break id,
            }
        };
        // The stream broke: resume it on the peers in turn.
        loop {
            if Instant::now() > deadline || !resilient {
                return End::Lost(format!(
                    "stream {id} broke after {} tokens and did not resume",
                    self.tokens.len()
                ));
            }
            self.next_peer();
            self.connections += 1;
            let url = format!("{}/v1/streams/{id}", self.url());
            let mut request = agent()
                .get(&url)
                .header("Authorization", &format!("Bearer {TEST_API_KEY}"));
            if let Some(last) = &self.last_event {
                request = request.header("Last-Event-ID", last);
            }
            let Ok(response) = request.call() else {
                continue;
            };
            if response.status() != 200 {
                continue;
            }
            let reader = std::io::BufReader::new(response.into_body().into_reader());
            match self.read(reader, false) {
                Read::Done => return self.completed(),
                Read::Error(why) => return End::Failed(why),
                Read::Left | Read::Broken => {}
            }
        }
    }

    /// A non-streamed 200: its tokens, or the error it carries.
    fn answered(&mut self, answer: &Value) -> End {
        match crate::token_ids(answer) {
            Ok(tokens) => {
                self.tokens = tokens;
                self.completed()
            }
            Err(error) => End::Failed(format!("200 without tokens: {error}")),
        }
    }

    fn completed(&mut self) -> End {
        End::Completed {
            tokens: std::mem::take(&mut self.tokens),
            retried: self.connections > 1,
        }
    }

    /// Reads one connection's events into the request's tokens.
    fn read(&mut self, reader: impl std::io::BufRead, leave_early: bool) -> Read {
        let mut seen = 0;
        let (events, done) = read_sse(reader, |_| {
            seen += 1;
            !(leave_early && seen >= 2)
        });
        for SseEvent { id, data } in &events {
            if data != "[DONE]" {
                let Ok(chunk) = serde_json::from_str::<Value>(data) else {
                    return Read::Error(format!("an event that is not JSON: {data}"));
                };
                if chunk.get("error").is_some() {
                    // The leader running it stopped leading: the next one runs it on.
                    if chunk["error"]["code"] == "request_interrupted" {
                        return Read::Broken;
                    }
                    return Read::Error(format!("stream {}", reason(200, &chunk)));
                }
                if let Some(ids) = chunk["choices"][0]["token_ids"].as_array() {
                    self.tokens
                        .extend(ids.iter().filter_map(Value::as_u64).map(|t| t as u32));
                }
            }
            if id.is_some() {
                self.last_event.clone_from(id);
            }
        }
        match (done, leave_early) {
            (true, _) => Read::Done,
            (false, true) => Read::Left,
            (false, false) => Read::Broken,
        }
    }
}
