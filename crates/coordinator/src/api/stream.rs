//! Server-sent events for `"stream": true`: `data: {chunk}` events, then `data: [DONE]`.
//!
//! Every event carries an `id: {response_id}:{k}`, where `k` counts the completion tokens
//! sent up to and including that event, so that a client whose connection dropped can
//! resume the stream where it stopped: `GET /v1/streams/{response_id}` with that id as
//! `Last-Event-ID` (see [`super::resume`]; for requests of one choice). Keep-alive
//! comments carry no id.
//!
//! One task per response reads the choices' parts and writes the events into a small
//! channel that the response body drains. When the client goes away, hyper drops the body
//! and with it the channel's receiver; the task sees the channel closed, returns, and
//! drops the token streams, which cancels the sequences. An engine error after the first
//! event cannot change the status any more: it is sent as an event holding the OpenAI
//! error envelope, followed by `[DONE]`.

use std::convert::Infallible;
use std::time::Instant;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, BoxStream, StreamExt};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tracing::{Instrument, Span};

use super::choice::{ChoicePart, Meta, Shape, Usage, envelope, record_done};
use super::error::ApiError;

/// Events buffered between the task and the body: enough to smooth a burst of tokens,
/// small enough that a stalled client stops the task (and so its sequences) from racing
/// ahead in memory.
const BUFFERED_EVENTS: usize = 64;

/// The last event of every stream, as OpenAI sends it.
const DONE: &str = "[DONE]";

/// The SSE response of a request whose sequences have started.
pub(crate) fn sse(
    meta: Meta,
    parts: BoxStream<'static, Result<ChoicePart, ApiError>>,
    shape: impl Shape,
    start: Instant,
) -> Response {
    let (tx, rx) = mpsc::channel::<(usize, String)>(BUFFERED_EVENTS);
    let id = meta.id.clone();
    tokio::spawn(write_events(meta, parts, shape, start, tx).instrument(Span::current()));
    let events = stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|event| (event, rx))
    })
    .map(move |(k, data)| Ok::<_, Infallible>(Event::default().id(event_id(&id, k)).data(data)));
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// The SSE id of the event after which `tokens` completion tokens were sent.
pub(crate) fn event_id(response_id: &str, tokens: usize) -> String {
    format!("{response_id}:{tokens}")
}

/// The token offset of a `Last-Event-ID` of response `response_id`, if it is one of its ids.
pub(crate) fn parse_event_id(response_id: &str, last: &str) -> Option<usize> {
    last.strip_prefix(response_id)?
        .strip_prefix(':')?
        .parse()
        .ok()
}

/// Why the task stopped early: the client is gone.
struct Gone;

/// Writes every event of one response; returns early when the client is gone.
async fn write_events(
    meta: Meta,
    mut parts: BoxStream<'static, Result<ChoicePart, ApiError>>,
    shape: impl Shape,
    start: Instant,
    tx: mpsc::Sender<(usize, String)>,
) {
    let mut writer = Writer {
        meta: &meta,
        shape: &shape,
        tx: &tx,
        // A resumed stream repeats neither the opening nor the prompt's ids.
        sent_chunks: usize::from(meta.resume_from > 0),
        tokens: meta.resume_from,
    };
    let _ = writer.run(&mut parts, start).await;
}

struct Writer<'a, S> {
    meta: &'a Meta,
    shape: &'a S,
    tx: &'a mpsc::Sender<(usize, String)>,
    sent_chunks: usize,
    /// Completion tokens sent so far (from the resume point on a resumed stream).
    tokens: usize,
}

impl<S: Shape> Writer<'_, S> {
    async fn run(
        &mut self,
        parts: &mut BoxStream<'static, Result<ChoicePart, ApiError>>,
        start: Instant,
    ) -> Result<(), Gone> {
        if self.meta.resume_from == 0 {
            for index in 0..self.meta.n {
                if let Some(choice) = self.shape.opening(index) {
                    self.chunk(vec![choice]).await?;
                }
            }
        }
        loop {
            let next = tokio::select! {
                part = parts.next() => part,
                () = self.tx.closed() => return Err(Gone),
            };
            match next {
                None => break,
                Some(Ok(part)) => {
                    self.tokens += part.tokens.len();
                    if self.worth_sending(&part) {
                        let choice = self.shape.chunk_choice(self.meta, &part);
                        self.chunk(vec![choice]).await?;
                    }
                }
                Some(Err(error)) => {
                    self.send(error.to_json().to_string()).await?;
                    return self.send(DONE.to_string()).await;
                }
            }
        }
        let usage = Usage {
            prompt_tokens: self.meta.prompt.len(),
            completion_tokens: self.tokens,
        };
        record_done(usage, start);
        if self.meta.include_usage {
            let mut body = envelope(self.meta, self.shape.chunk_object());
            body.insert("choices".into(), json!([]));
            body.insert("usage".into(), usage.json());
            self.send(Value::Object(body).to_string()).await?;
        }
        self.send(DONE.to_string()).await
    }

    /// Text, a finish, or something the client asked to see for every token.
    fn worth_sending(&self, part: &ChoicePart) -> bool {
        !part.text.is_empty()
            || part.finish.is_some()
            || self.meta.logprobs
            || self.meta.return_token_ids
    }

    async fn chunk(&mut self, choices: Vec<Value>) -> Result<(), Gone> {
        let mut body = envelope(self.meta, self.shape.chunk_object());
        body.insert("choices".into(), Value::Array(choices));
        if self.meta.include_usage {
            body.insert("usage".into(), Value::Null);
        }
        if self.sent_chunks == 0 && self.meta.return_token_ids {
            body.insert("prompt_token_ids".into(), json!(self.meta.prompt));
        }
        self.sent_chunks += 1;
        self.send(Value::Object(body).to_string()).await
    }

    async fn send(&self, data: String) -> Result<(), Gone> {
        self.tx.send((self.tokens, data)).await.map_err(|_| Gone)
    }
}
