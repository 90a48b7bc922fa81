//! `Prefer: respond-async` (RFC 7240): a non-streamed request answered at once with its
//! id, its result fetched when it is done.
//!
//! A non-streamed answer's headers come with its body, once the whole completion is done,
//! so a client whose connection breaks before then (a leader killed, a proxy's timeout)
//! has no id to fetch the result by. With `Prefer: respond-async`, the request is
//! admitted and journaled as any other, and the answer comes right away: `202 Accepted`
//! with `X-Request-Id`, `Location: /v1/streams/{id}?stream=false` (the whole body once the
//! request has finished, from any coordinator peer, across failovers) and
//! `Preference-Applied: respond-async`. The run goes on without its client; how many do is
//! bounded by the scheduler's queue, as for any request.
//!
//! Streams ignore the preference: their headers, `X-Request-Id` included, come before the
//! first event. It is for requests of one choice (`n` = 1), like `Idempotency-Key`, with
//! which it combines: a retry answers 202 again, for the same request.

use axum::Json;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::engine::TokenStream;

/// The request header, and the preference.
const PREFER: &str = "prefer";
const RESPOND_ASYNC: &str = "respond-async";

/// The response header saying the preference was followed.
const PREFERENCE_APPLIED: &str = "preference-applied";

/// Whether the request's `Prefer` headers hold `respond-async` (names are case-insensitive;
/// a preference may carry parameters after `;`, and several come comma-separated).
pub(crate) fn prefers_async(headers: &HeaderMap) -> bool {
    headers
        .get_all(PREFER)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .filter_map(|preference| preference.split(';').next())
        .any(|name| name.trim().eq_ignore_ascii_case(RESPOND_ASYNC))
}

/// The `202 Accepted` of request `id`, whose `tokens` are read to the end here, so that
/// the run is not taken for a client that went away.
pub(crate) fn accepted(id: &str, mut tokens: TokenStream) -> Response {
    tokio::spawn(async move {
        while let Some(Ok(event)) = tokens.recv().await {
            if event.finish.is_some() {
                break;
            }
        }
    });
    let location = format!("/v1/streams/{id}?stream=false");
    let body = json!({
        "id": id,
        "object": "request",
        "status": "in_progress",
        "result": location,
    });
    let mut response = (StatusCode::ACCEPTED, Json(body)).into_response();
    let headers = response.headers_mut();
    if let Ok(value) = HeaderValue::from_str(&location) {
        headers.insert(header::LOCATION, value);
    }
    headers.insert(PREFERENCE_APPLIED, HeaderValue::from_static(RESPOND_ASYNC));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prefer(values: &[&str]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for value in values {
            headers.append(PREFER, HeaderValue::from_str(value).unwrap());
        }
        headers
    }

    #[test]
    fn the_preference_is_found_among_others() {
        assert!(prefers_async(&prefer(&["respond-async"])));
        assert!(prefers_async(&prefer(&["Respond-Async; wait=10"])));
        assert!(prefers_async(&prefer(&["return=minimal, respond-async"])));
        assert!(prefers_async(&prefer(&["return=minimal", "respond-async"])));
        assert!(!prefers_async(&prefer(&["return=minimal"])));
        assert!(!prefers_async(&prefer(&["respond-asynchronously"])));
        assert!(!prefers_async(&HeaderMap::new()));
    }
}
