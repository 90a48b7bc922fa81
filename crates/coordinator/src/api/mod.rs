//! The OpenAI-compatible HTTP API, an axum [`Router`] over any [`Engine`].
//!
//! [`router`] takes an [`ApiState`]: the [`ServedModel`]s (name, tokenizer, limits) and the
//! engine that runs validated requests. The API validates and tokenizes; nothing it hands
//! the engine is raw input. Routes:
//!
//! - `GET /health`: the process is alive and its engine works (`{"status": "ok"}`); 503
//!   with `{"status": "failed", "reason"}` once the engine has stopped (a peer's Raft).
//! - `GET /ready`: 200 when every served model has a group ready to step, else 503; the body
//!   lists each model.
//! - `GET /v1/models`, `GET /v1/models/{model}`: OpenAI model objects, with vLLM's
//!   `max_model_len`.
//! - `POST /v1/completions` ([`completions`]) and `POST /v1/chat/completions` ([`chat`]):
//!   both read the shared parameters of [`params`] and answer through [`respond`], as one
//!   body or as server-sent events ([`stream`]), both built on [`choice`]; text comes
//!   from [`detok`].
//! - `GET /v1/streams/{id}`: a journaled request again, resumable from any token
//!   ([`resume`]).
//! - `GET /v1/cluster` and the status page at `/` ([`status`]); membership of the
//!   coordinator peers: `POST /v1/cluster/peers`, `DELETE /v1/cluster/peers/{id}`
//!   ([`peers`]);
//!   a group's maintenance drain: `POST /v1/cluster/groups/{group}/drain` and `/resume`
//!   ([`groups`]); model versions under `/v1/cluster/models/` ([`rollout`]); the topology
//!   in force, `GET` and `POST /v1/cluster/topology` ([`topology`]).
//! - `POST /v1/admin/drain` starts this peer's drain, `GET` says how far it is
//!   ([`drain`]; admin keys only).
//!
//! Every route but `/health`, `/ready`, `/metrics` and `/` needs an API key when keys are
//! configured ([`auth`]). Inference requests are shed past the limits of [`limits`] (429);
//! [`listen`] serves the router under a connection limit and a header read timeout. Every error, including malformed JSON, a body over
//! [`MAX_BODY_BYTES`], an unknown route or method, is answered in the OpenAI envelope by
//! [`ApiError`]. Each request runs in a `tracing` span with its method, route, model and
//! response id; request text is never logged. A client that disconnects drops its handler
//! (or its event stream), and with it every token stream: the sequences are cancelled.

mod auth;
mod chat;
mod choice;
mod completions;
mod detach;
mod detok;
pub mod drain;
mod error;
mod groups;
mod idempotency;
mod ids;
mod limits;
pub mod listen;
pub mod models;
mod params;
mod peers;
mod respond;
mod resume;
mod rollout;
mod status;
mod stream;
mod topology;
mod types;

use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use axum::extract::rejection::{JsonRejection, PathRejection};
use axum::extract::{DefaultBodyLimit, FromRequest, MatchedPath, Path, Request, State};
use axum::http::{Method, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::json;
use tracing::{Instrument, debug, field, info_span};

use crate::engine::Engine;
use types::{ModelCard, ModelList};

pub use auth::{ApiKeys, ExposureError, check_exposure};
pub use error::{ApiError, ApiErrorKind};
pub use limits::ApiLimits;
pub use models::{ServedModel, ServedModels};
pub use params::{MAX_CHOICES, MAX_STOP_STRING_BYTES, MAX_STOP_STRINGS};

/// Largest request body accepted: a prompt of a full 128k-token context as text is about
/// 0.5 MiB, as a JSON array of ids about 1 MiB; 4 MiB leaves room without letting one
/// request hold much memory.
pub const MAX_BODY_BYTES: usize = 4 << 20;

/// What the API's handlers share.
pub struct ApiState {
    /// As the topology in force names them ([`models::follow`]).
    pub models: Arc<ServedModels>,
    pub engine: Arc<dyn Engine>,
    /// Bearer keys; empty: no key needed.
    pub api_keys: ApiKeys,
    /// What this peer takes on before it sheds load.
    pub limits: ApiLimits,
    /// This peer's drain, which `POST /v1/admin/drain` starts; its middleware,
    /// [`drain::admit`], goes in front of forwarding.
    pub drain: Arc<drain::Drain>,
}

impl fmt::Debug for ApiState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ApiState")
            .field("models", &self.models)
            .field("api_keys", &self.api_keys)
            .field("limits", &self.limits)
            .field("drain", &self.drain.state())
            .finish_non_exhaustive()
    }
}

impl ApiState {
    /// The served model `name`, or OpenAI's 404.
    fn model(&self, name: &str) -> Result<ServedModel, ApiError> {
        self.models
            .get(name)
            .ok_or_else(|| ApiError::model_not_found(name))
    }
}

/// The API's routes over `state`.
pub fn router(state: ApiState) -> Router {
    let keys = state.api_keys.clone();
    let gate = limits::Gate::new(state.limits);
    limits::register_metrics();
    Router::new()
        .route("/", get(status::page))
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/v1/models", get(list_models))
        .route("/v1/models/{*model}", get(retrieve_model))
        .route("/v1/completions", post(completions::create_completion))
        .route("/v1/chat/completions", post(chat::create_chat_completion))
        .route("/v1/cluster", get(status::cluster))
        .route("/v1/streams/{*id}", get(resume::resume))
        .route("/v1/cluster/peers", post(peers::add))
        .route("/v1/cluster/peers/{id}", delete(peers::remove))
        .route("/v1/cluster/groups/{group}/drain", post(groups::drain))
        .route("/v1/cluster/groups/{group}/resume", post(groups::resume))
        .route("/v1/cluster/models/{model}", get(rollout::status))
        .route("/v1/cluster/models/{model}/deploy", post(rollout::deploy))
        .route("/v1/cluster/models/{model}/promote", post(rollout::promote))
        .route(
            "/v1/cluster/models/{model}/rollback",
            post(rollout::rollback),
        )
        .route(
            "/v1/cluster/topology",
            get(topology::show).post(topology::apply),
        )
        .route("/v1/admin/drain", get(drain::status).post(drain::start))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(middleware::from_fn_with_state(gate, limits::admit))
        .layer(middleware::from_fn_with_state(keys, auth::require_key))
        .layer(middleware::from_fn(trace_request))
        .with_state(Arc::new(state))
}

/// A JSON body whose rejections (wrong content type, bad syntax, wrong shape, too large)
/// are [`ApiError`]s in the OpenAI envelope instead of axum's plain text.
#[derive(Debug)]
pub(crate) struct ApiJson<T>(pub T);

impl<T, S> FromRequest<S> for ApiJson<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, ApiError> {
        let result: Result<Json<T>, JsonRejection> = Json::from_request(request, state).await;
        result
            .map(|Json(value)| ApiJson(value))
            .map_err(ApiError::from)
    }
}

/// One span per request. The route is the matched pattern, not the path, so that nothing
/// the client wrote reaches the logs.
async fn trace_request(request: Request, next: Next) -> Response {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched", |p| p.as_str())
        .to_string();
    let span = info_span!(
        "http_request",
        method = %request.method(),
        route,
        model = field::Empty,
        request_id = field::Empty,
    );
    async move {
        let start = Instant::now();
        let response = next.run(request).await;
        let elapsed_ms = u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX);
        ::metrics::counter!(
            crate::metrics::API_REQUESTS,
            "route" => route,
            "status" => response.status().as_u16().to_string(),
        )
        .increment(1);
        debug!(
            status = response.status().as_u16(),
            elapsed_ms, "request done"
        );
        response
    }
    .instrument(span)
    .await
}

async fn health(State(state): State<Arc<ApiState>>) -> Response {
    match state.engine.live() {
        Ok(()) => Json(json!({"status": "ok"})).into_response(),
        Err(reason) => {
            let body = json!({"status": "failed", "reason": reason});
            (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response()
        }
    }
}

#[derive(Serialize)]
struct Readiness<'a> {
    status: &'static str,
    models: Vec<ModelReadiness<'a>>,
}

#[derive(Serialize)]
struct ModelReadiness<'a> {
    id: &'a str,
    ready: bool,
}

async fn ready(State(state): State<Arc<ApiState>>) -> Response {
    let served = state.models.all();
    let models: Vec<ModelReadiness<'_>> = served
        .iter()
        .map(|m| ModelReadiness {
            id: &m.name,
            ready: state.engine.ready(&m.name),
        })
        .collect();
    // A model an applied topology added does not hold the peer back while it loads.
    let all_ready = (models.iter()).all(|m| state.models.lets_ready(m.id, m.ready));
    let (status, word) = if all_ready {
        (StatusCode::OK, "ready")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not_ready")
    };
    let body = Readiness {
        status: word,
        models,
    };
    (status, Json(body)).into_response()
}

fn model_card(model: &ServedModel) -> ModelCard {
    ModelCard {
        id: model.name.clone(),
        object: "model",
        created: model.created,
        owned_by: "tessera",
        max_model_len: model.context_tokens,
    }
}

async fn list_models(State(state): State<Arc<ApiState>>) -> Json<ModelList> {
    Json(ModelList {
        object: "list",
        data: state.models.all().iter().map(model_card).collect(),
    })
}

async fn retrieve_model(
    State(state): State<Arc<ApiState>>,
    name: Result<Path<String>, PathRejection>,
) -> Result<Json<ModelCard>, ApiError> {
    let Path(name) =
        name.map_err(|e| ApiError::new(ApiErrorKind::InvalidRequest, e.body_text()))?;
    state.model(&name).map(|m| Json(model_card(&m)))
}

async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::new(
        ApiErrorKind::NotFound,
        format!("invalid URL ({method} {})", uri.path()),
    )
}

async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::new(
        ApiErrorKind::MethodNotAllowed,
        format!("method {method} is not allowed for {}", uri.path()),
    )
}
