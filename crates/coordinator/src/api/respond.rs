//! What completions and chat share once a prompt is tokenized: one engine sequence per
//! choice, each choice's tokens turned into text parts ([`ChoicePart`], from
//! [`super::choice`]) by a [`TextStream`], and the answer — one JSON body, or server-sent
//! events ([`sse`]).
//!
//! The endpoints differ only in the JSON of a choice, which they give as a [`Shape`].
//!
//! Cancellation: every [`TokenStream`] lives inside the choice's stream. A choice that
//! finishes (or matches a stop string) drops its stream at once; a client that goes away
//! drops the handler's future (non-streaming) or the SSE body (streaming), and with it
//! every stream, which cancels the sequences and frees their blocks.

use std::sync::Arc;
use std::time::Instant;

use axum::Json;
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, BoxStream, StreamExt};
use serde_json::{Value, json};
use tessera_model::tokenizer::Tokenizer;
use tracing::Span;

use super::choice::{ChoicePart, Meta, Shape, Usage, envelope, record_done};
use super::detok::{TextStep, TextStream};
use super::error::ApiError;
use super::idempotency::{self, ResponseId};
use super::params::Params;
use super::stream as sse;
use super::{ApiState, ServedModel, detach, ids, resume};
use crate::engine::{GenerateRequest, TokenLogprobs, TokenStream};
use crate::metrics as names;

/// Starts one sequence per choice and answers with `shape`: SSE when the request streams.
pub(crate) async fn respond(
    state: &ApiState,
    model: &ServedModel,
    params: &Params,
    prompt: Vec<u32>,
    default_max_tokens: Option<u32>,
    id: ResponseId,
    shape: impl Shape,
) -> Result<Response, ApiError> {
    let start = Instant::now();
    let ResponseId {
        id,
        keyed,
        detached,
    } = id;
    // A stream's id comes before its first event already.
    let detached = detached && !params.stream;
    if params.n > 1 && (keyed || detached) {
        let what = if keyed {
            "an Idempotency-Key"
        } else {
            "`Prefer: respond-async`"
        };
        return Err(ApiError::invalid(
            "n",
            format!("{what} is for requests of one choice (n = 1)"),
        ));
    }
    let span = Span::current();
    span.record("request_id", id.as_str());
    span.record("model", model.name.as_str());
    if keyed {
        let request = params.request(model, prompt.clone(), default_max_tokens, 0)?;
        let answer = Answer {
            stream: params.stream,
            detached,
        };
        if let Some(response) = replay_journaled(state, &id, &request, answer, start).await? {
            return Ok(response);
        }
    }
    let mut streams = Vec::with_capacity(params.n as usize);
    for index in 0..params.n {
        let request = params.request(model, prompt.clone(), default_max_tokens, index)?;
        let key = match index {
            0 => id.clone(),
            i => format!("{id}/{i}"),
        };
        match state.engine.generate(key, request.clone()).await {
            Ok(stream) => streams.push(stream),
            // A retry that raced the first submission: that one is journaled now.
            Err(error) if keyed => {
                let answer = Answer {
                    stream: params.stream,
                    detached,
                };
                let replayed = replay_journaled(state, &id, &request, answer, start).await?;
                return replayed.ok_or_else(|| error.into());
            }
            Err(error) => return Err(error.into()),
        }
    }
    // The version of the first choice (choices of one request may meet different
    // versions while a canary runs).
    let version = streams.first().and_then(|s| s.version);
    if detached && let Some(tokens) = streams.pop() {
        return Ok(versioned(
            named(detach::accepted(&id, tokens), &id),
            version,
        ));
    }
    let meta = Meta {
        id,
        created: ids::unix_seconds(),
        model: model.name.clone(),
        tokenizer: model.tokenizer.clone(),
        logprobs: params.logprobs().is_some(),
        return_token_ids: params.return_token_ids,
        include_usage: params.include_usage,
        prompt,
        n: params.n,
        resume_from: 0,
    };
    let parts = choice_parts(&meta.id, streams, model.tokenizer.clone(), params, start);
    let id = meta.id.clone();
    // Once a sequence has started, every answer names the request, an error too: an
    // interrupted request goes on in the cluster, to be fetched by its id.
    let response = if params.stream {
        sse::sse(meta, parts, shape, start)
    } else {
        match collect(&meta, parts, &shape, start).await {
            Ok(body) => Json(body).into_response(),
            Err(error) => error.into_response(),
        }
    };
    Ok(versioned(named(response, &id), version))
}

/// `response`, with the header naming the model version that served it, when known.
fn versioned(mut response: Response, version: Option<u32>) -> Response {
    if let Some(v) = version {
        response
            .headers_mut()
            .insert(MODEL_VERSION, axum::http::HeaderValue::from(v));
    }
    response
}

/// The response header naming the model version that served the request (a rollout's:
/// `tessera model status`).
pub(crate) const MODEL_VERSION: &str = "x-tessera-model-version";

/// How the client asked to be answered.
#[derive(Clone, Copy, Debug)]
struct Answer {
    stream: bool,
    /// `Prefer: respond-async` on a request that does not stream.
    detached: bool,
}

/// The answer to a retried submission whose request `id` the journal holds (`None` when it
/// does not): the same request again, from its first token.
async fn replay_journaled(
    state: &ApiState,
    id: &str,
    request: &GenerateRequest,
    answer: Answer,
    start: Instant,
) -> Result<Option<Response>, ApiError> {
    let Some(resumed) = state.engine.resume(id.to_string()).await? else {
        return Ok(None);
    };
    idempotency::check_same(&resumed.request, request)?;
    if answer.detached {
        return Ok(Some(named(detach::accepted(id, resumed.tokens), id)));
    }
    let response = resume::replay(state, id.to_string(), resumed, 0, answer.stream, start).await?;
    Ok(Some(named(response, id)))
}

/// `response`, with the header naming its request `id`.
fn named(mut response: Response, id: &str) -> Response {
    if let Ok(value) = axum::http::HeaderValue::from_str(id) {
        response.headers_mut().insert(REQUEST_ID, value);
    }
    response
}

/// The response header naming the request (its journal id, which `GET /v1/streams/{id}`
/// takes): for a stream it comes before the first event, so a client whose stream breaks
/// at once can still resume it.
pub(crate) const REQUEST_ID: &str = "x-request-id";

/// Every choice's parts, merged in the order they come.
fn choice_parts(
    id: &str,
    streams: Vec<TokenStream>,
    tokenizer: Option<Arc<Tokenizer>>,
    params: &Params,
    start: Instant,
) -> BoxStream<'static, Result<ChoicePart, ApiError>> {
    let choices = streams.into_iter().zip(0u32..).map(|(tokens, index)| {
        let text = TextStream::new(tokenizer.clone(), Arc::clone(&params.stop));
        let key = match index {
            0 => id.to_string(),
            i => format!("{id}/{i}"),
        };
        choice(index, key, tokens, text, start).boxed()
    });
    stream::select_all(choices).boxed()
}

/// The sequence of one choice, and what it has told so far.
struct Choice {
    index: u32,
    /// Its request's id in the journal (`…/N` for choice N > 0).
    key: String,
    tokens: TokenStream,
    text: TextStream,
    last: Option<Instant>,
    /// Characters of text sent so far.
    sent_chars: usize,
}

/// The parts of one choice. Its token stream is dropped (the sequence cancelled) as soon
/// as a stop string matches, and after the last part. A stream that ends without a finish
/// was interrupted ([`ApiError::interrupted`]).
fn choice(
    index: u32,
    key: String,
    tokens: TokenStream,
    text: TextStream,
    start: Instant,
) -> impl futures_util::Stream<Item = Result<ChoicePart, ApiError>> + Send + 'static {
    let first = Choice {
        index,
        key,
        tokens,
        text,
        last: None,
        sent_chars: 0,
    };
    stream::unfold(Some(first), move |state| async move {
        let mut choice = state?;
        let event = match choice.tokens.recv().await {
            Some(Ok(event)) => event,
            Some(Err(error)) => return Some((Err(ApiError::from(error)), None)),
            None => return Some((Err(ApiError::interrupted(&choice.key)), None)),
        };
        choice.record_timing(start);
        let part = match choice.part(event.token, event.logprobs, event.finish) {
            Ok(part) => part,
            Err(error) => return Some((Err(error), None)),
        };
        let next = part.finish.is_none().then_some(choice);
        Some((Ok(part), next))
    })
}

impl Choice {
    fn record_timing(&mut self, start: Instant) {
        let now = Instant::now();
        match self.last {
            None => ::metrics::histogram!(names::API_TIME_TO_FIRST_TOKEN_SECONDS)
                .record(now.duration_since(start).as_secs_f64()),
            Some(last) => ::metrics::histogram!(names::API_INTER_TOKEN_LATENCY_SECONDS)
                .record(now.duration_since(last).as_secs_f64()),
        }
        self.last = Some(now);
    }

    fn part(
        &mut self,
        token: u32,
        logprobs: Option<TokenLogprobs>,
        finish: Option<tessera_comm::proto::FinishReason>,
    ) -> Result<ChoicePart, ApiError> {
        let detok = |e: tessera_model::tokenizer::TokenizerError| ApiError::internal(e.to_string());
        let (text, finish) = match self.text.push(token).map_err(detok)? {
            TextStep::Stopped(text) => (text, Some("stop")),
            TextStep::Text(text) => match finish {
                None => (text, None),
                Some(reason) => match self.text.finish().map_err(detok)? {
                    TextStep::Text(rest) => (text + &rest, Some(reason.as_str())),
                    TextStep::Stopped(rest) => (text + &rest, Some("stop")),
                },
            },
        };
        let offset = self.sent_chars;
        self.sent_chars += text.chars().count();
        Ok(ChoicePart {
            index: self.index,
            text,
            tokens: vec![token],
            logprobs: logprobs.into_iter().collect(),
            offsets: vec![offset],
            finish,
        })
    }
}

/// The parts of a resumed request's one choice from its first token on, the first
/// `skip` (which the client has) left out. Its `stop` strings apply as they did: the
/// journal holds the tokens as generated, which may run past the match that ended the
/// original stream.
pub(crate) fn resumed_parts(
    id: String,
    tokens: TokenStream,
    tokenizer: Option<Arc<Tokenizer>>,
    stop: Arc<[String]>,
    skip: usize,
    start: Instant,
) -> BoxStream<'static, Result<ChoicePart, ApiError>> {
    let text = TextStream::new(tokenizer, stop);
    choice(0, id, tokens, text, start).skip(skip).boxed()
}

/// Reads every choice to its end into one body.
pub(crate) async fn collect(
    meta: &Meta,
    mut parts: BoxStream<'static, Result<ChoicePart, ApiError>>,
    shape: &impl Shape,
    start: Instant,
) -> Result<Value, ApiError> {
    let mut choices: Vec<ChoicePart> = (0..meta.n)
        .map(|index| ChoicePart {
            index,
            ..ChoicePart::default()
        })
        .collect();
    while let Some(part) = parts.next().await {
        let part = part?;
        if let Some(choice) = choices.get_mut(part.index as usize) {
            choice.append(part);
        }
    }
    let usage = Usage {
        prompt_tokens: meta.prompt.len(),
        completion_tokens: choices.iter().map(|c| c.tokens.len()).sum(),
    };
    record_done(usage, start);
    let mut body = envelope(meta, shape.object());
    body.insert(
        "choices".into(),
        choices.iter().map(|c| shape.choice(meta, c)).collect(),
    );
    body.insert("usage".into(), usage.json());
    if meta.return_token_ids {
        body.insert("prompt_token_ids".into(), json!(meta.prompt));
    }
    Ok(Value::Object(body))
}
