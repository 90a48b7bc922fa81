//! A coordinator peer's graceful drain, before it stops (SIGTERM, or `POST
//! /v1/admin/drain` with an admin key):
//!
//! - `/ready` answers 503 (`"status": "draining"`), so load balancers take the peer out;
//! - new inference requests (completions, chat, stream resumes) get 503 with `code:
//!   draining` and `Retry-After: 2`, those forwarded to it by other peers included;
//! - both refusals carry `Connection: close`, so a client does not send its retry down a
//!   kept-alive connection to this peer, which it closes when it stops (the request would
//!   meet a closed connection, unanswered, instead of a refused one);
//! - the requests in flight run to their end, streams included.
//!
//! [`Drain`] is the state: the flag and the count of requests in flight, kept by
//! [`admit`], the middleware in front of everything else (forwarding included). What the
//! peer does next (wait for the count to reach zero, hand leadership over, exit) is
//! [`crate::lifecycle`]'s.

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use tokio::sync::watch;

use super::ApiState;
use super::error::{ApiError, ApiErrorKind};
use super::limits::{hold_until_end, is_inference};
use crate::metrics as names;

/// Seconds a refused client should wait: another peer, or this one's successor, takes
/// it by then.
pub const DRAIN_RETRY_AFTER_SECONDS: u64 = 2;

/// Whether the peer drains, and how many requests it still serves.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct DrainState {
    pub draining: bool,
    pub in_flight: usize,
}

/// One peer's drain: set once, never cleared (the peer stops after it).
#[derive(Debug)]
pub struct Drain {
    timeout: Duration,
    state: watch::Sender<DrainState>,
}

impl Drain {
    /// A peer that serves; a drain waits `timeout` at most for its requests.
    pub fn new(timeout: Duration) -> Arc<Drain> {
        Arc::new(Drain {
            timeout,
            state: watch::Sender::new(DrainState::default()),
        })
    }

    /// How long a drain waits for the requests in flight.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Starts draining; `false` when it had started already.
    pub fn start(&self) -> bool {
        let started = self
            .state
            .send_if_modified(|s| !std::mem::replace(&mut s.draining, true));
        if started {
            ::metrics::gauge!(names::API_DRAINING).set(1.0);
        }
        started
    }

    pub fn state(&self) -> DrainState {
        *self.state.borrow()
    }

    /// The state, updated as it changes.
    pub fn watch(&self) -> watch::Receiver<DrainState> {
        self.state.subscribe()
    }

    /// A place for one request, unless the peer drains; it leaves when dropped.
    fn enter(self: &Arc<Drain>) -> Option<InFlight> {
        let mut admitted = false;
        self.state.send_if_modified(|s| {
            admitted = !s.draining;
            s.in_flight += usize::from(admitted);
            admitted
        });
        admitted.then(|| InFlight(Arc::clone(self)))
    }
}

/// A request being served; the count drops with it.
#[derive(Debug)]
struct InFlight(Arc<Drain>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0
            .state
            .send_modify(|s| s.in_flight = s.in_flight.saturating_sub(1));
    }
}

/// The 503 of a request that arrives while the peer drains.
fn refusal() -> ApiError {
    ApiError::new(
        ApiErrorKind::Unavailable,
        "this coordinator peer is draining before it stops and takes no new requests; \
         retry on another peer, or here after Retry-After",
    )
    .with_code("draining")
    .with_retry_after(DRAIN_RETRY_AFTER_SECONDS)
}

/// The middleware, outside forwarding: answers `/ready` with 503 while draining, refuses
/// new inference requests then, and counts those it admits until their bodies end.
pub async fn admit(State(drain): State<Arc<Drain>>, request: Request, next: Next) -> Response {
    let path = request.uri().path();
    let state = drain.state();
    if path == "/ready" && state.draining {
        let body = serde_json::json!({"status": "draining", "in_flight": state.in_flight});
        return closing((StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response());
    }
    if !is_inference(request.method(), path) {
        return next.run(request).await;
    }
    let Some(in_flight) = drain.enter() else {
        ::metrics::counter!(names::API_SHED, "reason" => "draining").increment(1);
        return closing(refusal().into_response());
    };
    hold_until_end(next.run(request).await, in_flight)
}

/// `response`, after which the connection closes.
fn closing(mut response: Response) -> Response {
    response
        .headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

/// What `GET` and `POST /v1/admin/drain` answer.
#[derive(Debug, Serialize)]
struct DrainReport {
    #[serde(flatten)]
    state: DrainState,
    timeout_s: f64,
}

fn report(drain: &Drain) -> DrainReport {
    DrainReport {
        state: drain.state(),
        timeout_s: drain.timeout.as_secs_f64(),
    }
}

/// `POST /v1/admin/drain`: starts this peer's drain (as SIGTERM does); 202 with its state.
pub(crate) async fn start(State(state): State<Arc<ApiState>>) -> Response {
    if state.drain.start() {
        tracing::info!("drain requested through the API");
    }
    (StatusCode::ACCEPTED, Json(report(&state.drain))).into_response()
}

/// `GET /v1/admin/drain`: this peer's drain state.
pub(crate) async fn status(State(state): State<Arc<ApiState>>) -> Response {
    Json(report(&state.drain)).into_response()
}
