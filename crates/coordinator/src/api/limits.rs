//! Overload shedding at the API: what one coordinator peer takes on before it refuses.
//!
//! - **In flight.** Inference requests (completions, chat, stream resumes) being served at
//!   once, in all and per key. A request counts from admission until its response body
//!   ends, stream included; past a limit it gets 429 at once. Requests the engine holds are
//!   bounded again by the scheduler's queue, in length and in waiting time.
//! - **Rate.** A token bucket per key: `rate_per_key` requests per second on average,
//!   `rate_burst` at once after a pause. Past it: 429 with the `Retry-After` at which the
//!   next request fits.
//! - **Body read time.** A request body must arrive within `body_timeout` (408), so a slow
//!   sender holds its connection and its slot for that long at most. Headers have their own
//!   timeout, and connections their limit, in [`super::listen`].
//! - **Stalled readers** are [`super::listen`]'s: a connection whose client stops reading
//!   is closed, which cancels its stream's sequences and frees their KV blocks.
//!
//! "Key" is the caller [`super::auth`] found; without keys, every caller is one tenant.
//! The state is a pure core ([`Gate`]: no clock of its own, no I/O) behind a mutex held
//! for a few map operations; the maps hold one entry per configured key at most.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::Method;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body::{Frame, SizeHint};

use super::auth::Caller;
use super::error::{ApiError, ApiErrorKind};
use crate::metrics as names;

/// The API's limits; zero turns a count or rate limit off.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ApiLimits {
    /// Inference requests served at once by this peer.
    pub max_in_flight: usize,
    /// The same, for each key.
    pub max_in_flight_per_key: usize,
    /// Requests each key may start per second, on average.
    pub rate_per_key: f64,
    /// Requests a key may start at once after a pause (at least 1).
    pub rate_burst: f64,
    /// The whole request body must arrive within this.
    pub body_timeout: Duration,
}

impl Default for ApiLimits {
    fn default() -> ApiLimits {
        ApiLimits {
            // Above what the scheduler runs (256 sequences per group) and queues: the
            // scheduler sheds first on a small cluster; this bounds the peer's memory.
            max_in_flight: 2048,
            max_in_flight_per_key: 0,
            rate_per_key: 0.0,
            rate_burst: 0.0,
            body_timeout: Duration::from_secs(30),
        }
    }
}

/// Why a request was shed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Shed {
    InFlight { limit: usize },
    KeyInFlight { limit: usize },
    Rate { rate: f64, retry_after: Duration },
}

impl From<Shed> for ApiError {
    fn from(shed: Shed) -> ApiError {
        let (message, retry_after) = match shed {
            Shed::InFlight { limit } => (
                format!(
                    "this coordinator is serving its limit of {limit} requests at once; \
                     retry later"
                ),
                None,
            ),
            Shed::KeyInFlight { limit } => (
                format!("this API key has its limit of {limit} requests in flight; retry later"),
                None,
            ),
            Shed::Rate { rate, retry_after } => (
                format!("this API key may start {rate} requests per second; retry later"),
                Some(retry_after),
            ),
        };
        let error = ApiError::new(ApiErrorKind::CapacityExhausted, message)
            .with_code("rate_limit_exceeded");
        match retry_after {
            Some(wait) => error.with_retry_after(wait.as_secs_f64().ceil() as u64),
            None => error,
        }
    }
}

/// The counts and buckets.
#[derive(Debug)]
pub(crate) struct Gate {
    limits: ApiLimits,
    state: Mutex<GateState>,
}

#[derive(Debug, Default)]
struct GateState {
    in_flight: usize,
    per_key: HashMap<Caller, usize>,
    buckets: HashMap<Caller, Bucket>,
}

/// A token bucket: `tokens` as of `at`.
#[derive(Clone, Copy, Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Gate {
    pub(crate) fn new(limits: ApiLimits) -> Arc<Gate> {
        Arc::new(Gate {
            limits,
            state: Mutex::default(),
        })
    }

    /// Admits a request of `caller` at `now`, or says why not; the ticket leaves when
    /// dropped.
    pub(crate) fn enter(self: &Arc<Gate>, caller: Caller, now: Instant) -> Result<Ticket, Shed> {
        let limits = &self.limits;
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if limits.max_in_flight > 0 && state.in_flight >= limits.max_in_flight {
            return Err(Shed::InFlight {
                limit: limits.max_in_flight,
            });
        }
        let held = state.per_key.get(&caller).copied().unwrap_or(0);
        if limits.max_in_flight_per_key > 0 && held >= limits.max_in_flight_per_key {
            return Err(Shed::KeyInFlight {
                limit: limits.max_in_flight_per_key,
            });
        }
        if limits.rate_per_key > 0.0 {
            let burst = limits.rate_burst.max(1.0);
            let bucket = state.buckets.entry(caller).or_insert(Bucket {
                tokens: burst,
                at: now,
            });
            let refilled = bucket.tokens
                + now.saturating_duration_since(bucket.at).as_secs_f64() * limits.rate_per_key;
            bucket.tokens = refilled.min(burst);
            bucket.at = now;
            if bucket.tokens < 1.0 {
                let retry_after =
                    Duration::from_secs_f64((1.0 - bucket.tokens) / limits.rate_per_key);
                return Err(Shed::Rate {
                    rate: limits.rate_per_key,
                    retry_after,
                });
            }
            bucket.tokens -= 1.0;
        }
        state.in_flight += 1;
        *state.per_key.entry(caller).or_insert(0) += 1;
        ::metrics::gauge!(names::API_IN_FLIGHT).set(state.in_flight as f64);
        Ok(Ticket {
            gate: Arc::clone(self),
            caller,
        })
    }

    /// Requests in flight, in all.
    #[cfg(test)]
    pub(crate) fn in_flight(&self) -> usize {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .in_flight
    }

    fn leave(&self, caller: Caller) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.in_flight = state.in_flight.saturating_sub(1);
        if let Some(held) = state.per_key.get_mut(&caller) {
            *held = held.saturating_sub(1);
            if *held == 0 {
                state.per_key.remove(&caller);
            }
        }
        ::metrics::gauge!(names::API_IN_FLIGHT).set(state.in_flight as f64);
    }
}

/// One admitted request's place; it leaves when dropped.
#[derive(Debug)]
pub(crate) struct Ticket {
    gate: Arc<Gate>,
    caller: Caller,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.gate.leave(self.caller);
    }
}

/// Whether a request of `method` to `path` counts against the limits (and a drain waits
/// for it).
pub(super) fn is_inference(method: &Method, path: &str) -> bool {
    (method == Method::POST && matches!(path, "/v1/completions" | "/v1/chat/completions"))
        || (method == Method::GET && path.starts_with("/v1/streams/"))
}

/// The middleware: sheds inference requests over the limits, reads their bodies within
/// the timeout, and holds their place until the response body ends.
pub(crate) async fn admit(State(gate): State<Arc<Gate>>, request: Request, next: Next) -> Response {
    if !is_inference(request.method(), request.uri().path()) {
        return next.run(request).await;
    }
    let caller = request
        .extensions()
        .get::<Caller>()
        .copied()
        .unwrap_or(Caller::Anyone);
    let ticket = match gate.enter(caller, Instant::now()) {
        Ok(ticket) => ticket,
        Err(shed) => {
            ::metrics::counter!(names::API_SHED, "reason" => shed.reason()).increment(1);
            return ApiError::from(shed).into_response();
        }
    };
    let request = match read_body(request, gate.limits.body_timeout).await {
        Ok(request) => request,
        Err(error) => return error.into_response(),
    };
    hold_until_end(next.run(request).await, ticket)
}

/// `response`, whose body keeps `guard` until it ends or is dropped (a stream included).
pub(super) fn hold_until_end<G: Send + Unpin + 'static>(response: Response, guard: G) -> Response {
    response.map(|body| {
        Body::new(Holding {
            body,
            _guard: guard,
        })
    })
}

/// The limits' series, at 0 until their first event, so that alerts and dashboards on
/// them evaluate from the start.
pub(super) fn register_metrics() {
    for reason in ["in_flight", "key_in_flight", "rate", "draining"] {
        ::metrics::counter!(names::API_SHED, "reason" => reason).increment(0);
    }
    ::metrics::gauge!(names::API_IN_FLIGHT).set(0.0);
    ::metrics::gauge!(names::API_DRAINING).set(0.0);
}

impl Shed {
    fn reason(&self) -> &'static str {
        match self {
            Shed::InFlight { .. } => "in_flight",
            Shed::KeyInFlight { .. } => "key_in_flight",
            Shed::Rate { .. } => "rate",
        }
    }
}

/// The request with its body read in full within `timeout`.
async fn read_body(request: Request, timeout: Duration) -> Result<Request, ApiError> {
    let (parts, body) = request.into_parts();
    let read = axum::body::to_bytes(body, super::MAX_BODY_BYTES);
    let bytes: Bytes = match tokio::time::timeout(timeout, read).await {
        Err(_) => {
            return Err(ApiError::new(
                ApiErrorKind::RequestTimeout,
                format!(
                    "the request body did not arrive within {} s",
                    timeout.as_secs_f64()
                ),
            ));
        }
        Ok(Err(error)) => return Err(body_error(&error)),
        Ok(Ok(bytes)) => bytes,
    };
    Ok(Request::from_parts(parts, Body::from(bytes)))
}

/// A body that failed to read: too large, or cut off.
fn body_error(error: &axum::Error) -> ApiError {
    let too_large = std::error::Error::source(error)
        .is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
    if too_large {
        return super::error::body_too_large();
    }
    ApiError::new(
        ApiErrorKind::InvalidRequest,
        format!("the request body could not be read: {error}"),
    )
}

/// A response body that keeps its request's place until it ends or is dropped.
struct Holding<G> {
    body: Body,
    _guard: G,
}

impl<G: Unpin> http_body::Body for Holding<G> {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        std::pin::Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests;
