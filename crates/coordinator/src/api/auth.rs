//! API keys: `Authorization: Bearer <key>` on every route but the probes (`/health`,
//! `/ready`, `/metrics`) and the status page's HTML (`/`, which holds no data and asks for a
//! key itself; the data it shows comes from `/v1/cluster`, which needs one).
//!
//! Keys are compared in constant time: the time taken depends on the lengths only, never
//! on how many leading bytes of a guess are right. Every configured key is compared, with
//! no early exit. With no key configured every request passes; [`check_exposure`] keeps a
//! coordinator without keys on loopback addresses.

use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderValue, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::error::{ApiError, ApiErrorKind};

/// Paths served without a key.
const OPEN_PATHS: [&str; 4] = ["/health", "/ready", "/metrics", "/"];

/// The accepted keys. `Debug` never shows them.
#[derive(Clone, Default)]
pub struct ApiKeys(Arc<[Vec<u8>]>);

impl fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ApiKeys({} keys)", self.0.len())
    }
}

impl ApiKeys {
    /// Keys as given; surrounding white space is trimmed and empty ones are dropped.
    pub fn new(keys: impl IntoIterator<Item = String>) -> ApiKeys {
        ApiKeys(
            keys.into_iter()
                .map(|k| k.trim().as_bytes().to_vec())
                .filter(|k| !k.is_empty())
                .collect(),
        )
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether `presented` is one of the keys.
    fn accepts(&self, presented: &[u8]) -> bool {
        self.0
            .iter()
            .fold(false, |found, key| constant_time_eq(key, presented) | found)
    }
}

/// Equality whose time depends on the longer length only.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = u8::from(a.len() != b.len());
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= x ^ y;
    }
    std::hint::black_box(diff) == 0
}

/// Why a coordinator must not start: it would serve a non-loopback address to anyone.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "the HTTP API would listen on {addr}, which is not a loopback address, with no API key: \
     set --api-key (or TESSERA_API_KEYS), or bind the API to 127.0.0.1"
)]
pub struct ExposureError {
    pub addr: SocketAddr,
}

/// Refuses an API reachable from other hosts without a key.
pub fn check_exposure(addr: SocketAddr, keys: &ApiKeys) -> Result<(), ExposureError> {
    if keys.is_empty() && !addr.ip().is_loopback() {
        return Err(ExposureError { addr });
    }
    Ok(())
}

/// The middleware: 401 in the OpenAI envelope unless the key is right.
pub(crate) async fn require_key(
    State(keys): State<ApiKeys>,
    request: Request,
    next: Next,
) -> Response {
    if keys.is_empty() || OPEN_PATHS.contains(&request.uri().path()) {
        return next.run(request).await;
    }
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .map(HeaderValue::as_bytes)
        .and_then(bearer_token);
    match presented {
        Some(token) if keys.accepts(token) => next.run(request).await,
        Some(_) => unauthorized("the API key is not valid"),
        None => unauthorized("an API key is required: send it as `Authorization: Bearer <key>`"),
    }
}

/// The token of `Bearer <token>` (the scheme in any case).
fn bearer_token(value: &[u8]) -> Option<&[u8]> {
    const SCHEME: &[u8] = b"bearer ";
    if value.len() <= SCHEME.len() || !value[..SCHEME.len()].eq_ignore_ascii_case(SCHEME) {
        return None;
    }
    Some(value[SCHEME.len()..].trim_ascii())
}

fn unauthorized(message: &str) -> Response {
    let mut response = ApiError::new(ApiErrorKind::Unauthorized, message)
        .with_code("invalid_api_key")
        .into_response();
    response
        .headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_match_exactly() {
        let keys = ApiKeys::new(["abc".to_string(), " def ".to_string(), String::new()]);
        assert_eq!(keys.0.len(), 2);
        assert!(keys.accepts(b"abc"));
        assert!(keys.accepts(b"def"));
        assert!(!keys.accepts(b"ab"));
        assert!(!keys.accepts(b"abcd"));
        assert!(!keys.accepts(b""));
        assert!(!ApiKeys::default().accepts(b""));
        assert_eq!(format!("{keys:?}"), "ApiKeys(2 keys)");
    }

    #[test]
    fn bearer_parsing() {
        assert_eq!(bearer_token(b"Bearer k1"), Some(&b"k1"[..]));
        assert_eq!(bearer_token(b"bearer  k1 "), Some(&b"k1"[..]));
        assert_eq!(bearer_token(b"Basic k1"), None);
        assert_eq!(bearer_token(b"Bearer "), None);
    }

    #[test]
    fn exposure_needs_a_key_off_loopback() {
        let open: SocketAddr = "0.0.0.0:8000".parse().unwrap();
        let local: SocketAddr = "127.0.0.1:8000".parse().unwrap();
        let local6: SocketAddr = "[::1]:8000".parse().unwrap();
        let none = ApiKeys::default();
        let some = ApiKeys::new(["k".to_string()]);
        assert!(check_exposure(open, &none).is_err());
        assert!(check_exposure(open, &some).is_ok());
        assert!(check_exposure(local, &none).is_ok());
        assert!(check_exposure(local6, &none).is_ok());
        let message = check_exposure(open, &none).unwrap_err().to_string();
        assert!(message.contains("--api-key"), "{message}");
    }
}
