//! `Idempotency-Key` (issue 17, item 8): a retried submission maps to the same request,
//! streamed or not, and is answered from the journal instead of running again.

mod common;

use std::sync::Arc;

use axum::body::Body;
use axum::http::Request;
use common::*;
use serde_json::{Value, json};

/// A completion POST, with an Idempotency-Key when `key` is given.
fn post(path: &str, key: Option<&str>, body: &Value) -> Request<Body> {
    let key: Vec<_> = key.map(|k| ("idempotency-key", k)).into_iter().collect();
    post_json(path, &key, body)
}

#[tokio::test]
async fn a_retried_submission_is_answered_from_the_journal_not_run_again() {
    let engine = MockEngine::new(Reply::Script(
        vec![11, 12, 13],
        Some(tessera_comm::proto::FinishReason::Length),
    ));
    let app = app(Arc::clone(&engine));
    let first = send(
        app.clone(),
        post("/v1/completions", Some("k-1"), &short_completion(false)),
    )
    .await;
    assert_eq!(first.status, 200, "{}", first.body);
    let id = first.body["id"].as_str().unwrap().to_string();
    assert_eq!(first.headers["x-request-id"], id.as_str());
    // The retry: same id, same tokens, and the engine ran one request only.
    let retry = send(
        app.clone(),
        post("/v1/completions", Some("k-1"), &short_completion(false)),
    )
    .await;
    assert_eq!(retry.status, 200, "{}", retry.body);
    assert_eq!(retry.body["id"], id.as_str());
    assert_eq!(retry.headers["x-request-id"], id.as_str());
    assert_eq!(retry.body["choices"][0]["token_ids"], json!([11, 12, 13]));
    assert_eq!(retry.body["choices"][0]["finish_reason"], "length");
    assert_eq!(engine.requests().len(), 1);
    // A streamed retry of it streams the same tokens.
    let (_, events) = stream(app.clone(), "/v1/completions", short_completion(true)).await;
    assert!(!events.is_empty());
    let request = post("/v1/completions", Some("k-1"), &short_completion(true));
    let (status, headers, text) = send_text(app.clone(), request).await;
    assert_eq!(status, 200);
    assert_eq!(headers["x-request-id"], id.as_str());
    let ids: Vec<Value> = parse_sse(&text)
        .iter()
        .filter(|e| e.data != "[DONE]")
        .flat_map(|e| {
            e.json()["choices"][0]["token_ids"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .collect();
    assert_eq!(ids, [json!(11), json!(12), json!(13)]);
    // Another key, or none, is another request.
    let other = send(
        app.clone(),
        post("/v1/completions", Some("k-2"), &short_completion(false)),
    )
    .await;
    assert_ne!(other.body["id"], id.as_str());
    assert_eq!(engine.requests().len(), 3, "k-2 and the unkeyed stream ran");
}

#[tokio::test]
async fn a_key_reused_for_another_request_or_several_choices_is_refused() {
    let engine = MockEngine::new(Reply::EchoPrompt(2));
    let app = app(Arc::clone(&engine));
    let first = send(
        app.clone(),
        post("/v1/completions", Some("k"), &short_completion(false)),
    )
    .await;
    assert_eq!(first.status, 200);
    let other = json!({"model": IDS_MODEL, "prompt": [9], "max_tokens": 3});
    let refused = send(app.clone(), post("/v1/completions", Some("k"), &other)).await;
    let message = assert_error(&refused, 400, "invalid_request_error", None);
    assert!(message.contains("used for another request"), "{message}");
    let several = json!({"model": IDS_MODEL, "prompt": [9], "max_tokens": 3, "n": 2});
    let refused = send(app.clone(), post("/v1/completions", Some("k2"), &several)).await;
    assert_error(&refused, 400, "invalid_request_error", Some("n"));
    let bad = send(
        app,
        post(
            "/v1/completions",
            Some("no spaces"),
            &short_completion(false),
        ),
    )
    .await;
    assert_error(&bad, 400, "invalid_request_error", None);
    assert_eq!(engine.requests().len(), 1);
}
