//! `Idempotency-Key`: a retried submission is the same request.
//!
//! A completion request with the header gets a response id derived from the key instead
//! of a random one: `{prefix}-{h}`, where `h` is the first 128 bits (hex) of SHA-256 over
//! the caller's bearer token, the endpoint's prefix and the key. Every coordinator peer
//! derives the same id, so after a failover too, and two API keys never share one.
//!
//! [`super::respond`] then looks the id up in the request journal: a request it holds is
//! answered from there (live while it runs, streamed or not, as the retry asks) instead of
//! being started again. A journaled request whose model, prompt or `max_tokens` differ
//! from the retry's is refused: the key was used for another request. Keys are for
//! requests of one choice (`n` = 1); the answer replayed from the journal carries
//! `token_ids`, and no logprobs (the journal holds tokens, as for `GET /v1/streams/{id}`).
//! A key is remembered as long as the journal holds its request (`--journal-retention`).

use std::fmt::Write as _;

use axum::http::{HeaderMap, header};

use super::error::{ApiError, ApiErrorKind};
use crate::engine::GenerateRequest;

/// The request header.
pub(crate) const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// The longest key accepted, in bytes.
pub const MAX_KEY_BYTES: usize = 255;

/// A response's id, whether an `Idempotency-Key` chose it, and whether the client asked
/// for it at once, the result to be fetched later ([`super::detach`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ResponseId {
    pub id: String,
    pub keyed: bool,
    pub detached: bool,
}

/// The id of a response of endpoint `prefix` (`cmpl`, `chatcmpl`): from the request's
/// `Idempotency-Key`, or random without one; and its `Prefer: respond-async`.
pub(crate) fn response_id(headers: &HeaderMap, prefix: &str) -> Result<ResponseId, ApiError> {
    let detached = super::detach::prefers_async(headers);
    Ok(match keyed_id(headers, prefix)? {
        Some(id) => ResponseId {
            id,
            keyed: true,
            detached,
        },
        None => ResponseId {
            id: format!("{prefix}-{}", super::ids::random_hex()?),
            keyed: false,
            detached,
        },
    })
}

/// The response id of a request with an `Idempotency-Key`, or `None` without one.
fn keyed_id(headers: &HeaderMap, prefix: &str) -> Result<Option<String>, ApiError> {
    let Some(value) = headers.get(IDEMPOTENCY_KEY) else {
        return Ok(None);
    };
    let key = value.as_bytes();
    if key.is_empty() || key.len() > MAX_KEY_BYTES || !key.iter().all(u8::is_ascii_graphic) {
        return Err(ApiError::new(
            ApiErrorKind::InvalidRequest,
            format!(
                "the Idempotency-Key header must be 1 to {MAX_KEY_BYTES} visible ASCII \
                 characters"
            ),
        ));
    }
    let token = headers
        .get(header::AUTHORIZATION)
        .map_or(&b""[..], |v| v.as_bytes());
    let mut context = ring::digest::Context::new(&ring::digest::SHA256);
    // Lengths first: no two different (token, prefix, key) share the hashed bytes.
    for part in [token, prefix.as_bytes(), key] {
        context.update(&(part.len() as u64).to_be_bytes());
        context.update(part);
    }
    let digest = context.finish();
    let mut id = format!("{prefix}-");
    for b in &digest.as_ref()[..16] {
        let _ = write!(id, "{b:02x}");
    }
    Ok(Some(id))
}

/// Refuses a retry whose journaled request is another one.
pub(crate) fn check_same(
    journaled: &GenerateRequest,
    retry: &GenerateRequest,
) -> Result<(), ApiError> {
    let same = journaled.model == retry.model
        && journaled.prompt == retry.prompt
        && journaled.max_tokens == retry.max_tokens;
    if same {
        return Ok(());
    }
    Err(ApiError::new(
        ApiErrorKind::InvalidRequest,
        "this Idempotency-Key was used for another request (model, prompt or max_tokens \
         differ); use a new key for a new request",
    )
    .with_code("idempotency_key_reused"))
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;

    use super::*;

    fn headers(key: &str, token: Option<&str>) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(IDEMPOTENCY_KEY, HeaderValue::from_str(key).unwrap());
        if let Some(token) = token {
            let value = HeaderValue::from_str(&format!("Bearer {token}")).unwrap();
            headers.insert(header::AUTHORIZATION, value);
        }
        headers
    }

    #[test]
    fn a_key_maps_to_one_id_per_caller_and_endpoint() {
        let id = |key, token, prefix| keyed_id(&headers(key, token), prefix).unwrap().unwrap();
        let a = id("k1", Some("alice"), "cmpl");
        assert_eq!(a, id("k1", Some("alice"), "cmpl"));
        assert!(a.starts_with("cmpl-") && a.len() == 5 + 32, "{a}");
        assert_ne!(a, id("k2", Some("alice"), "cmpl"));
        assert_ne!(a, id("k1", Some("bob"), "cmpl"));
        assert_ne!(a, id("k1", None, "cmpl"));
        let chat = id("k1", Some("alice"), "chatcmpl");
        assert!(chat.starts_with("chatcmpl-"));
        assert_ne!(chat[9..], a[5..]);
        assert_eq!(keyed_id(&HeaderMap::new(), "cmpl").unwrap(), None);
        let random = response_id(&HeaderMap::new(), "cmpl").unwrap();
        assert!(!random.keyed && random.id.starts_with("cmpl-"));
    }

    #[test]
    fn bad_keys_are_refused() {
        for key in ["", "with space", &"x".repeat(MAX_KEY_BYTES + 1)] {
            let error = keyed_id(&headers(key, None), "cmpl").unwrap_err();
            assert_eq!(error.kind, ApiErrorKind::InvalidRequest, "{key:?}");
        }
        assert!(keyed_id(&headers(&"x".repeat(MAX_KEY_BYTES), None), "cmpl").is_ok());
    }
}
