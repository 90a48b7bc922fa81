//! Issue 17, item 8: a client can always find its request again by id. An interrupted
//! request (its leader stopped leading) is told as a 503 naming the request, not as a
//! server error; `Prefer: respond-async` gives a non-streamed request's id before its body.

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, header};
use common::*;
use serde_json::{Value, json};
use tessera_comm::proto::FinishReason;

fn post(body: &Value, prefer: Option<&str>) -> Request<Body> {
    let prefer: Vec<_> = prefer.map(|p| ("prefer", p)).into_iter().collect();
    post_json("/v1/completions", &prefer, body)
}

#[tokio::test]
async fn an_interrupted_stream_ends_with_a_503_event_naming_the_request() {
    let engine = MockEngine::new(Reply::Interrupt(vec![11, 12]));
    let (status, headers, text) = send_text(app(engine), post(&short_completion(true), None)).await;
    assert_eq!(status, 200);
    let id = headers["x-request-id"].to_str().unwrap().to_string();
    let events = parse_sse(&text);
    let n = events.len();
    assert_eq!(events[n - 1].data, "[DONE]");
    let error = events[n - 2].json();
    assert_eq!(
        error["error"]["type"], "service_unavailable_error",
        "{error}"
    );
    assert_eq!(error["error"]["code"], "request_interrupted", "{error}");
    let message = error["error"]["message"].as_str().unwrap();
    assert!(
        message.contains(&format!("GET /v1/streams/{id}")),
        "{message}"
    );
}

#[tokio::test]
async fn an_interrupted_answer_is_a_503_with_its_request_id() {
    let engine = MockEngine::new(Reply::Interrupt(vec![11]));
    let reply = send(app(engine), post(&short_completion(false), None)).await;
    let message = assert_error(&reply, 503, "service_unavailable_error", None);
    assert_eq!(reply.body["error"]["code"], "request_interrupted");
    assert_eq!(reply.headers[header::RETRY_AFTER], "1");
    let id = reply.headers["x-request-id"].to_str().unwrap();
    assert!(id.starts_with("cmpl-"), "{id}");
    assert!(
        message.contains(&format!("GET /v1/streams/{id}")),
        "{message}"
    );
}

#[tokio::test]
async fn respond_async_answers_202_with_the_id_and_runs_on_without_the_client() {
    // A sequence that never finishes: it is cancelled only if its stream is dropped.
    let engine = MockEngine::new(Reply::Script(vec![11], None));
    let request = post(&short_completion(false), Some("respond-async"));
    let answer = send(app(Arc::clone(&engine)), request);
    let reply = tokio::time::timeout(Duration::from_secs(5), answer)
        .await
        .expect("the answer came before the run's end");
    assert_eq!(reply.status, 202, "{}", reply.body);
    let id = reply.headers["x-request-id"].to_str().unwrap();
    assert_eq!(reply.body["id"], id);
    assert_eq!(reply.body["status"], "in_progress");
    let location = format!("/v1/streams/{id}?stream=false");
    assert_eq!(reply.headers[header::LOCATION], location.as_str());
    assert_eq!(reply.headers["preference-applied"], "respond-async");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        engine.cancelled.load(Ordering::SeqCst),
        0,
        "the run was cancelled"
    );
}

#[tokio::test]
async fn respond_async_result_is_fetched_at_its_location() {
    let engine = MockEngine::new(Reply::Script(vec![11, 12, 13], Some(FinishReason::Length)));
    let app = app(engine);
    let reply = send(
        app.clone(),
        post(&short_completion(false), Some("respond-async")),
    )
    .await;
    assert_eq!(reply.status, 202, "{}", reply.body);
    let location = reply.headers[header::LOCATION].to_str().unwrap();
    let result = get(app, location).await;
    assert_eq!(result.status, 200, "{}", result.body);
    assert_eq!(result.body["id"], reply.body["id"]);
    assert_eq!(result.body["choices"][0]["token_ids"], json!([11, 12, 13]));
    assert_eq!(result.body["choices"][0]["finish_reason"], "length");
}

#[tokio::test]
async fn respond_async_is_for_one_choice_and_streams_ignore_it() {
    let engine = || MockEngine::new(Reply::Script(vec![11], Some(FinishReason::Length)));
    let mut two = short_completion(false);
    two["n"] = json!(2);
    let reply = send(app(engine()), post(&two, Some("respond-async"))).await;
    let message = assert_error(&reply, 400, "invalid_request_error", Some("n"));
    assert!(message.contains("respond-async"), "{message}");

    let (status, headers, text) = send_text(
        app(engine()),
        post(&short_completion(true), Some("respond-async")),
    )
    .await;
    assert_eq!(status, 200);
    assert!(headers.get("preference-applied").is_none());
    assert!(text.contains("[DONE]"), "{text}");
}
