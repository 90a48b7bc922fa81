//! [`ApiError`]: every failure of the HTTP API, answered in the OpenAI error envelope
//! `{"error": {"message", "type", "param", "code"}}`.
//!
//! The [`ApiErrorKind`] decides the HTTP status and the envelope's `type`, once:
//!
//! | kind                | status | `type`                      | from                                |
//! |---------------------|--------|-----------------------------|-------------------------------------|
//! | `InvalidRequest`    | 400    | `invalid_request_error`     | validation, bad JSON, wrong types   |
//! | `Unauthorized`      | 401    | `invalid_request_error`     | missing or wrong API key (`code: invalid_api_key`) |
//! | `Forbidden`         | 403    | `permission_error`          | an inference key on an admin route  |
//! | `NotFound`          | 404    | `invalid_request_error`     | unknown model (`code: model_not_found`) or route |
//! | `MethodNotAllowed`  | 405    | `invalid_request_error`     | a known route with another method   |
//! | `RequestTimeout`    | 408    | `invalid_request_error`     | the body did not arrive in time     |
//! | `PayloadTooLarge`   | 413    | `invalid_request_error`     | body over [`super::MAX_BODY_BYTES`] |
//! | `CapacityExhausted` | 429    | `overloaded_error`          | engine queues full, a queue wait too long, the API's limits ([`super::limits`]); `Retry-After` |
//! | `Cancelled`         | 499    | `cancelled_error`           | engine cancelled the sequence       |
//! | `Internal`          | 500    | `server_error`              | bugs, tokenizer failures            |
//! | `Unavailable`       | 503    | `service_unavailable_error` | no ready group, shard lost, no leader, journal full, a request interrupted by a leader change (`code: request_interrupted`); `Retry-After: 1` |
//! | `DeadlineExceeded`  | 504    | `timeout_error`             | a step or collective missed its deadline |
//!
//! The 4xx types and `server_error` are OpenAI's own; OpenAI has no names for the others, so
//! they follow its `<what>_error` pattern. OpenAI clients pick their exception class from the
//! status, not the type. 499 is nginx's "client closed request": a cancelled sequence usually
//! means the client has gone, and the status then only shows in access logs.

use axum::Json;
use axum::extract::rejection::JsonRejection;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use tessera_comm::proto::{ErrorClass, WireError};
use tracing::{debug, warn};

/// What went wrong, at the granularity of an HTTP status.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ApiErrorKind {
    InvalidRequest,
    Unauthorized,
    Forbidden,
    NotFound,
    MethodNotAllowed,
    RequestTimeout,
    PayloadTooLarge,
    CapacityExhausted,
    Cancelled,
    Internal,
    Unavailable,
    DeadlineExceeded,
}

impl ApiErrorKind {
    pub fn status(self) -> StatusCode {
        match self {
            ApiErrorKind::InvalidRequest => StatusCode::BAD_REQUEST,
            ApiErrorKind::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiErrorKind::Forbidden => StatusCode::FORBIDDEN,
            ApiErrorKind::NotFound => StatusCode::NOT_FOUND,
            ApiErrorKind::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ApiErrorKind::RequestTimeout => StatusCode::REQUEST_TIMEOUT,
            ApiErrorKind::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ApiErrorKind::CapacityExhausted => StatusCode::TOO_MANY_REQUESTS,
            ApiErrorKind::Cancelled => CLIENT_CLOSED_REQUEST,
            ApiErrorKind::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            ApiErrorKind::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            ApiErrorKind::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        }
    }

    /// The envelope's `type`.
    pub fn error_type(self) -> &'static str {
        match self {
            ApiErrorKind::InvalidRequest
            | ApiErrorKind::Unauthorized
            | ApiErrorKind::NotFound
            | ApiErrorKind::MethodNotAllowed
            | ApiErrorKind::RequestTimeout
            | ApiErrorKind::PayloadTooLarge => "invalid_request_error",
            ApiErrorKind::Forbidden => "permission_error",
            ApiErrorKind::CapacityExhausted => "overloaded_error",
            ApiErrorKind::Cancelled => "cancelled_error",
            ApiErrorKind::Internal => "server_error",
            ApiErrorKind::Unavailable => "service_unavailable_error",
            ApiErrorKind::DeadlineExceeded => "timeout_error",
        }
    }
}

impl From<ErrorClass> for ApiErrorKind {
    fn from(class: ErrorClass) -> ApiErrorKind {
        match class {
            ErrorClass::InvalidRequest => ApiErrorKind::InvalidRequest,
            ErrorClass::Unavailable => ApiErrorKind::Unavailable,
            ErrorClass::CapacityExhausted => ApiErrorKind::CapacityExhausted,
            ErrorClass::DeadlineExceeded => ApiErrorKind::DeadlineExceeded,
            ErrorClass::Cancelled => ApiErrorKind::Cancelled,
            ErrorClass::Internal => ApiErrorKind::Internal,
        }
    }
}

/// nginx's non-standard "client closed request".
const CLIENT_CLOSED_REQUEST: StatusCode = match StatusCode::from_u16(499) {
    Ok(status) => status,
    Err(_) => StatusCode::BAD_REQUEST,
};

/// Seconds a client should wait before retrying a 429 or a 503, unless the error says
/// otherwise (a key's rate limit knows when its next request fits): the scheduler's queues
/// drain in steps of tens of milliseconds and an election takes about a second, so one
/// second is long enough to find room or a leader and short enough not to idle a freed
/// slot.
const RETRY_AFTER_SECONDS: u64 = 1;

/// A failed API request; its response is the OpenAI error envelope.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    pub kind: ApiErrorKind,
    /// Shown to the client as is.
    pub message: String,
    /// The request field at fault, when one is.
    pub param: Option<&'static str>,
    /// A stable machine-readable code (`model_not_found`, `context_length_exceeded`).
    pub code: Option<&'static str>,
    /// `Retry-After` seconds of a 429 or 503, when not the default.
    pub retry_after_s: Option<u64>,
}

impl ApiError {
    pub fn new(kind: ApiErrorKind, message: impl Into<String>) -> ApiError {
        ApiError {
            kind,
            message: message.into(),
            param: None,
            code: None,
            retry_after_s: None,
        }
    }

    /// A 400 blaming the request field `param`.
    pub fn invalid(param: &'static str, message: impl Into<String>) -> ApiError {
        ApiError::new(ApiErrorKind::InvalidRequest, message).with_param(param)
    }

    /// A 400 for a field this server knows but does not implement yet.
    pub fn unsupported(param: &'static str) -> ApiError {
        ApiError::invalid(param, format!("`{param}` is not supported yet"))
    }

    /// OpenAI's 404 for a model that is not served.
    pub fn model_not_found(model: &str) -> ApiError {
        ApiError::new(
            ApiErrorKind::NotFound,
            format!("the model `{model}` does not exist"),
        )
        .with_param("model")
        .with_code("model_not_found")
    }

    /// The 503 of request `id` (`…/N` for choice N) whose stream ended without a finish:
    /// the coordinator peer running it stopped leading. The journal keeps it open, and the
    /// next leader runs it on, so the client fetches it rather than submitting it again.
    pub fn interrupted(id: &str) -> ApiError {
        ApiError::new(
            ApiErrorKind::Unavailable,
            format!(
                "request {id} was interrupted: the coordinator peer running it stopped leading. \
                 The cluster goes on with it; fetch it with GET /v1/streams/{id} (with \
                 Last-Event-ID to continue a stream, or ?stream=false for the whole body) \
                 rather than submitting it again"
            ),
        )
        .with_code("request_interrupted")
    }

    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(ApiErrorKind::Internal, message)
    }

    pub fn with_param(mut self, param: &'static str) -> ApiError {
        self.param = Some(param);
        self
    }

    pub fn with_code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

    /// A 429 or 503 whose client should wait `seconds` (at least 1) before retrying.
    pub fn with_retry_after(mut self, seconds: u64) -> ApiError {
        self.retry_after_s = Some(seconds.max(1));
        self
    }
}

/// An engine failure keeps its message: it names the group and rank of a shard failure.
impl From<WireError> for ApiError {
    fn from(error: WireError) -> ApiError {
        ApiError::new(error.class.into(), error.message)
    }
}

/// axum's JSON rejections, which it would answer in plain text.
impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> ApiError {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            return body_too_large();
        }
        // Missing content type, bad syntax, not the expected JSON shape, unreadable body:
        // axum's text says which, and where.
        ApiError::new(ApiErrorKind::InvalidRequest, rejection.body_text())
    }
}

/// The 413 of a body over [`super::MAX_BODY_BYTES`].
pub(crate) fn body_too_large() -> ApiError {
    ApiError::new(
        ApiErrorKind::PayloadTooLarge,
        format!(
            "the request body is larger than the limit of {} bytes",
            super::MAX_BODY_BYTES
        ),
    )
}

#[derive(Serialize)]
struct Envelope<'a> {
    error: Body<'a>,
}

#[derive(Serialize)]
struct Body<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    error_type: &'static str,
    param: Option<&'static str>,
    code: Option<&'static str>,
}

impl ApiError {
    /// The OpenAI envelope as JSON, for an error event in a stream.
    pub(crate) fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self.envelope()).unwrap_or(serde_json::Value::Null)
    }

    fn envelope(&self) -> Envelope<'_> {
        Envelope {
            error: Body {
                message: &self.message,
                error_type: self.kind.error_type(),
                param: self.param,
                code: self.code,
            },
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.kind.status();
        let error_type = self.kind.error_type();
        if status.is_server_error() {
            // Engine and internal messages carry no request text; they name groups and ranks.
            warn!(status = status.as_u16(), error_type, message = %self.message, "request failed");
        } else {
            // Client errors may quote the request: only their type is logged.
            debug!(
                status = status.as_u16(),
                error_type,
                param = self.param,
                "request rejected"
            );
        }
        let mut response = (status, Json(self.envelope())).into_response();
        if matches!(
            self.kind,
            ApiErrorKind::CapacityExhausted | ApiErrorKind::Unavailable
        ) {
            let seconds = self.retry_after_s.unwrap_or(RETRY_AFTER_SECONDS);
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}
