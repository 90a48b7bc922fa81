//! What the API test files share: a mock engine that records requests and answers as told,
//! two served models (one with the tiny-spm tokenizer and its chat template, one with
//! token ids only), and small HTTP helpers over the router (in process, no socket).

// Each test file uses a different part of these helpers.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use http_body_util::BodyExt;
use serde_json::{Value, json};
use tessera_comm::proto::{Epoch, ErrorClass, FinishReason, WireError};
use tessera_coordinator::api::drain::Drain;
use tessera_coordinator::api::{self, ApiKeys, ApiLimits, ApiState, ServedModel, ServedModels};
use tessera_coordinator::engine::{
    BoxFuture, ClusterStatus, Engine, GenerateRequest, GroupStatus, Resumed, ShardStatus,
    TokenEvent, TokenLogprobs, TokenStream,
};
use tessera_model::chat::ChatTemplate;
use tessera_model::tokenizer::Tokenizer;
use tokio::sync::Notify;

pub const TEXT_MODEL: &str = "tiny-spm";
pub const IDS_MODEL: &str = "ids-only";
pub const IDS_VOCAB: usize = 100;
pub const IDS_EOS: u32 = 2;
pub const CONTEXT_TOKENS: usize = 64;

/// What the mock answers.
#[derive(Clone, Debug)]
pub enum Reply {
    /// The first `k` prompt tokens, finishing by length.
    EchoPrompt(usize),
    /// These tokens; then the finish, or with `None` nothing more until the stream is
    /// dropped (counted in [`MockEngine::cancelled`]).
    Script(Vec<u32>, Option<FinishReason>),
    /// These tokens, then this error.
    FailAfter(Vec<u32>, WireError),
    /// These tokens, then the stream ends without a finish, as a leader's does when it
    /// stops leading.
    Interrupt(Vec<u32>),
    Fail(WireError),
}

/// Records every request and answers as told.
#[derive(Debug)]
pub struct MockEngine {
    pub reply: Reply,
    pub ready: bool,
    /// `Some`: the engine has stopped, for this reason.
    pub stopped: Option<String>,
    /// `Some`: admission refuses with this error.
    pub admission: Option<WireError>,
    pub requests: Mutex<Vec<GenerateRequest>>,
    /// Streams of `Script(_, None)` dropped by the API.
    pub cancelled: Arc<AtomicUsize>,
    pub cancel_notify: Arc<Notify>,
    /// Requests by id, as a journal holds them: an id is started once, then resumed.
    pub journal: Mutex<HashMap<String, GenerateRequest>>,
}

impl MockEngine {
    pub fn new(reply: Reply) -> Arc<MockEngine> {
        Arc::new(MockEngine::with(reply))
    }

    pub fn with(reply: Reply) -> MockEngine {
        MockEngine {
            reply,
            ready: true,
            stopped: None,
            admission: None,
            requests: Mutex::new(Vec::new()),
            cancelled: Arc::new(AtomicUsize::new(0)),
            cancel_notify: Arc::new(Notify::new()),
            journal: Mutex::new(HashMap::new()),
        }
    }

    pub fn requests(&self) -> Vec<GenerateRequest> {
        self.requests.lock().unwrap().clone()
    }

    pub fn last(&self) -> GenerateRequest {
        self.requests().pop().expect("the engine got no request")
    }

    /// Waits until `count` streams have been dropped by the API.
    pub async fn wait_cancelled(&self, count: usize) {
        let wait = async {
            while self.cancelled.load(Ordering::SeqCst) < count {
                let notified = self.cancel_notify.notified();
                if self.cancelled.load(Ordering::SeqCst) >= count {
                    break;
                }
                notified.await;
            }
        };
        tokio::time::timeout(Duration::from_secs(5), wait)
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "only {} of {count} streams were dropped",
                    self.cancelled.load(Ordering::SeqCst)
                )
            });
    }

    /// The reply to `request`, as told.
    fn answer(&self, request: GenerateRequest) -> BoxFuture<'_, Result<TokenStream, WireError>> {
        let reply = self.reply.clone();
        let cancelled = Arc::clone(&self.cancelled);
        let notify = Arc::clone(&self.cancel_notify);
        Box::pin(async move {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            match reply {
                Reply::EchoPrompt(k) => {
                    let tokens: Vec<u32> = request.prompt.iter().copied().take(k).collect();
                    Self::send_tokens(&tx, &request, &tokens, Some(FinishReason::Length));
                }
                Reply::Script(tokens, Some(finish)) => {
                    Self::send_tokens(&tx, &request, &tokens, Some(finish));
                }
                Reply::Script(tokens, None) => {
                    Self::send_tokens(&tx, &request, &tokens, None);
                    tokio::spawn(async move {
                        tx.closed().await;
                        cancelled.fetch_add(1, Ordering::SeqCst);
                        notify.notify_waiters();
                    });
                }
                Reply::FailAfter(tokens, error) => {
                    Self::send_tokens(&tx, &request, &tokens, None);
                    let _ = tx.send(Err(error));
                }
                Reply::Interrupt(tokens) => {
                    Self::send_tokens(&tx, &request, &tokens, None);
                    drop(tx);
                }
                Reply::Fail(error) => return Err(error),
            }
            Ok(TokenStream::new(rx))
        })
    }

    /// Journals `id`; an error when it was journaled already.
    fn journal_once(&self, id: String, request: &GenerateRequest) -> Option<WireError> {
        let mut journal = self.journal.lock().unwrap();
        if journal.contains_key(&id) {
            return Some(WireError {
                class: ErrorClass::InvalidRequest,
                message: format!("request {id} is journaled already"),
                rank: None,
            });
        }
        journal.insert(id, request.clone());
        None
    }

    fn send_tokens(
        tx: &tokio::sync::mpsc::UnboundedSender<Result<TokenEvent, WireError>>,
        request: &GenerateRequest,
        tokens: &[u32],
        finish: Option<FinishReason>,
    ) {
        let last = tokens.len().saturating_sub(1);
        for (i, &token) in tokens.iter().enumerate() {
            let logprobs = request.sampling.logprobs.map(|k| TokenLogprobs {
                logprob: -0.25,
                top: (0..u32::from(k))
                    .map(|t| (t + 3, -1.0 - t as f32))
                    .collect(),
            });
            let finish = if i == last { finish } else { None };
            let _ = tx.send(Ok(TokenEvent {
                token,
                logprobs,
                finish,
            }));
        }
    }
}

impl Engine for MockEngine {
    fn generate(
        &self,
        id: String,
        request: GenerateRequest,
    ) -> BoxFuture<'_, Result<TokenStream, WireError>> {
        self.requests.lock().unwrap().push(request.clone());
        if let Some(error) = self.journal_once(id, &request) {
            return Box::pin(std::future::ready(Err(error)));
        }
        self.answer(request)
    }

    fn resume(&self, id: String) -> BoxFuture<'_, Result<Option<Resumed>, WireError>> {
        let journaled = self.journal.lock().unwrap().get(&id).cloned();
        Box::pin(async move {
            let Some(request) = journaled else {
                return Ok(None);
            };
            let tokens = self.answer(request.clone()).await?;
            Ok(Some(Resumed {
                request,
                accepted_ms: 1_700_000_000_000,
                tokens,
            }))
        })
    }

    fn admission(&self, _model: &str) -> Result<(), WireError> {
        match &self.admission {
            Some(error) => Err(error.clone()),
            None => Ok(()),
        }
    }

    fn ready(&self, _model: &str) -> bool {
        self.ready
    }

    fn live(&self) -> Result<(), String> {
        self.stopped.clone().map_or(Ok(()), Err)
    }

    fn status(&self) -> ClusterStatus {
        ClusterStatus {
            peers: Vec::new(),
            models: Vec::new(),
            groups: vec![GroupStatus {
                name: "g0".into(),
                model: TEXT_MODEL.into(),
                tp: 1,
                state: "serving",
                drained: false,
                switching: false,
                version: 1,
                epoch: Epoch(3),
                running: 1,
                waiting: 2,
                kv_blocks: 100,
                kv_blocks_used: 25,
                block_size: 16,
                tokens_per_second: 12.5,
                prefix_cache_hit_tokens: 7,
                shards: vec![ShardStatus {
                    rank: 0,
                    host: "local".into(),
                    state: "ready",
                    pid: Some(42),
                    device: Some("cpu".into()),
                    weight_bytes: 1 << 20,
                    kv_blocks_free: 75,
                }],
            }],
        }
    }
}

pub fn tokenizer() -> Arc<Tokenizer> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/tokenizers/tiny-spm/tokenizer.json");
    Arc::new(Tokenizer::from_file(path).expect("the tiny-spm fixture loads"))
}

pub fn models() -> Vec<ServedModel> {
    let tok = tokenizer();
    let template = ChatTemplate::from_tokenizer(&tok)
        .expect("the fixture's template compiles")
        .map(Arc::new);
    assert!(
        template.is_some(),
        "the tiny-spm fixture has a chat template"
    );
    vec![
        ServedModel {
            name: TEXT_MODEL.to_string(),
            eos_token_ids: tok.eos_token_ids().to_vec(),
            vocab_size: tok.vocab_size(),
            tokenizer: Some(tok),
            chat_template: template,
            context_tokens: CONTEXT_TOKENS,
            created: 1_700_000_000,
        },
        ServedModel {
            name: IDS_MODEL.to_string(),
            tokenizer: None,
            chat_template: None,
            eos_token_ids: vec![IDS_EOS],
            context_tokens: CONTEXT_TOKENS,
            vocab_size: IDS_VOCAB,
            created: 1_700_000_001,
        },
    ]
}

pub fn app(engine: Arc<MockEngine>) -> Router {
    app_with_keys(engine, ApiKeys::default())
}

pub fn app_with_keys(engine: Arc<MockEngine>, api_keys: ApiKeys) -> Router {
    app_with_limits(engine, api_keys, ApiLimits::default())
}

pub fn app_with_limits(engine: Arc<MockEngine>, api_keys: ApiKeys, limits: ApiLimits) -> Router {
    api::router(ApiState {
        models: Arc::new(ServedModels::new(models())),
        engine,
        api_keys,
        limits,
        drain: Drain::new(Duration::from_secs(30)),
    })
}

pub struct Answer {
    pub status: StatusCode,
    pub headers: axum::http::HeaderMap,
    pub body: Value,
}

/// The raw answer: status, headers, body text.
pub async fn send_text(
    app: Router,
    request: Request<Body>,
) -> (StatusCode, axum::http::HeaderMap, String) {
    use tower::ServiceExt;
    let response = app
        .oneshot(request)
        .await
        .expect("the router is infallible");
    let status = response.status();
    let headers = response.headers().clone();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        headers,
        String::from_utf8(bytes.to_vec()).expect("bodies are UTF-8"),
    )
}

pub async fn send(app: Router, request: Request<Body>) -> Answer {
    let (status, headers, text) = send_text(app, request).await;
    let body = serde_json::from_str(&text).unwrap_or_else(|e| {
        panic!("status {status}: body is not JSON ({e}): {text:?}");
    });
    Answer {
        status,
        headers,
        body,
    }
}

pub async fn get(app: Router, path: &str) -> Answer {
    send(app, Request::get(path).body(Body::empty()).unwrap()).await
}

pub async fn post_raw_to(
    app: Router,
    path: &str,
    content_type: Option<&str>,
    body: impl Into<Body>,
) -> Answer {
    let mut builder = Request::post(path);
    if let Some(ct) = content_type {
        builder = builder.header(header::CONTENT_TYPE, ct);
    }
    send(app, builder.body(body.into()).unwrap()).await
}

pub async fn post_raw(app: Router, content_type: Option<&str>, body: impl Into<Body>) -> Answer {
    post_raw_to(app, "/v1/completions", content_type, body).await
}

pub async fn complete(app: Router, body: Value) -> Answer {
    post_raw(app, Some("application/json"), body.to_string()).await
}

pub async fn chat(app: Router, body: Value) -> Answer {
    post_raw_to(
        app,
        "/v1/chat/completions",
        Some("application/json"),
        body.to_string(),
    )
    .await
}

/// One server-sent event.
#[derive(Clone, Debug, PartialEq)]
pub struct SseEvent {
    pub id: Option<String>,
    pub data: String,
}

impl SseEvent {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.data)
            .unwrap_or_else(|e| panic!("event data is not JSON ({e}): {:?}", self.data))
    }
}

/// Posts `body` to `path` and reads the whole event stream.
pub async fn stream(app: Router, path: &str, body: Value) -> (StatusCode, Vec<SseEvent>) {
    let request = Request::post(path)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_string()))
        .unwrap();
    let (status, headers, text) = send_text(app, request).await;
    if status != StatusCode::OK {
        panic!("status {status}: {text}");
    }
    assert_eq!(
        headers.get(header::CONTENT_TYPE).unwrap(),
        "text/event-stream"
    );
    (status, parse_sse(&text))
}

pub fn parse_sse(text: &str) -> Vec<SseEvent> {
    text.split("\n\n")
        .filter(|block| !block.trim().is_empty())
        .filter_map(|block| {
            let mut id = None;
            let mut data = Vec::new();
            for line in block.lines() {
                if let Some(v) = line.strip_prefix("id:") {
                    id = Some(v.trim_start().to_string());
                } else if let Some(v) = line.strip_prefix("data:") {
                    data.push(v.strip_prefix(' ').unwrap_or(v).to_string());
                }
            }
            (!data.is_empty()).then(|| SseEvent {
                id,
                data: data.join("\n"),
            })
        })
        .collect()
}

/// Asserts the OpenAI error envelope with this status, type and param.
#[track_caller]
pub fn assert_error(reply: &Answer, status: u16, error_type: &str, param: Option<&str>) -> String {
    assert_eq!(reply.status.as_u16(), status, "{}", reply.body);
    let error = &reply.body["error"];
    assert_eq!(error["type"], error_type, "{}", reply.body);
    assert_eq!(error["param"].as_str(), param, "{}", reply.body);
    assert!(error.get("code").is_some(), "{}", reply.body);
    error["message"]
        .as_str()
        .expect("the message is a string")
        .to_string()
}

/// A JSON POST of `body` to `path`, with these headers besides its content type.
pub fn post_json(path: &str, headers: &[(&str, &str)], body: &Value) -> Request<Body> {
    let mut request = Request::post(path).header(header::CONTENT_TYPE, "application/json");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request.body(Body::from(body.to_string())).unwrap()
}

/// A completion of three tokens of the ids-only model, streamed or not.
pub fn short_completion(stream: bool) -> Value {
    json!({"model": IDS_MODEL, "prompt": [5, 6, 7], "max_tokens": 3, "stream": stream})
}
