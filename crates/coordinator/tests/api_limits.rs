//! The API's overload shedding (issue 17, item 5): in-flight limits in all and per key, a
//! per-key rate, priority rights, a body read timeout, and a connection closed under a
//! client that stops reading (which cancels its stream's sequence).

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, header};
use common::*;
use serde_json::{Value, json};
use tessera_coordinator::api::drain::Drain;
use tessera_coordinator::api::listen::{self, ConnLimits};
use tessera_coordinator::api::{self, ApiKeys, ApiLimits, ApiState, ServedModels};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket};
use tower::ServiceExt;

/// The answer to a request that must be refused at once (an admitted stream here would
/// never end).
async fn refused(app: axum::Router, request: Request<Body>) -> Answer {
    tokio::time::timeout(Duration::from_secs(5), send(app, request))
        .await
        .expect("the request was admitted: its stream never ends")
}

fn no_limits() -> ApiLimits {
    ApiLimits {
        max_in_flight: 0,
        ..ApiLimits::default()
    }
}

fn post(key: Option<&str>, body: &Value) -> Request<Body> {
    let mut request =
        Request::post("/v1/completions").header(header::CONTENT_TYPE, "application/json");
    if let Some(key) = key {
        request = request.header(header::AUTHORIZATION, format!("Bearer {key}"));
    }
    request.body(Body::from(body.to_string())).unwrap()
}

/// A stream that stays open until its response is dropped.
fn endless(stream: bool) -> Value {
    json!({"model": IDS_MODEL, "prompt": [5], "max_tokens": 8, "stream": stream})
}

#[tokio::test]
async fn past_the_in_flight_limit_requests_get_429_until_a_stream_ends() {
    let engine = MockEngine::new(Reply::Script(vec![7], None));
    let limits = ApiLimits {
        max_in_flight: 1,
        ..no_limits()
    };
    let app = app_with_limits(Arc::clone(&engine), ApiKeys::default(), limits);
    let held = app
        .clone()
        .oneshot(post(None, &endless(true)))
        .await
        .unwrap();
    assert_eq!(held.status(), 200);
    let refused = refused(app.clone(), post(None, &endless(true))).await;
    let message = assert_error(&refused, 429, "overloaded_error", None);
    assert!(message.contains("limit of 1 requests"), "{message}");
    assert_eq!(refused.headers[header::RETRY_AFTER], "1");
    assert_eq!(refused.body["error"]["code"], "rate_limit_exceeded");
    // Routes other than inference are not counted.
    assert_eq!(get(app.clone(), "/v1/models").await.status, 200);
    // The stream's place is held by its body: dropping it frees it.
    drop(held);
    engine.wait_cancelled(1).await;
    let again = app.oneshot(post(None, &endless(true))).await.unwrap();
    assert_eq!(again.status(), 200);
}

#[tokio::test]
async fn the_per_key_limit_leaves_other_keys_alone() {
    let engine = MockEngine::new(Reply::Script(vec![7], None));
    let keys = ApiKeys::new(["alice".to_string(), "bob".to_string()]);
    let limits = ApiLimits {
        max_in_flight_per_key: 1,
        ..no_limits()
    };
    let app = app_with_limits(engine, keys, limits);
    let held = app
        .clone()
        .oneshot(post(Some("alice"), &endless(true)))
        .await
        .unwrap();
    assert_eq!(held.status(), 200);
    let refused = refused(app.clone(), post(Some("alice"), &endless(true))).await;
    let message = assert_error(&refused, 429, "overloaded_error", None);
    assert!(message.contains("this API key"), "{message}");
    let other = app
        .oneshot(post(Some("bob"), &endless(true)))
        .await
        .unwrap();
    assert_eq!(other.status(), 200);
}

#[tokio::test]
async fn a_key_past_its_rate_is_told_when_to_retry() {
    let engine = MockEngine::new(Reply::EchoPrompt(1));
    let limits = ApiLimits {
        rate_per_key: 0.2,
        rate_burst: 1.0,
        ..no_limits()
    };
    let app = app_with_limits(engine, ApiKeys::default(), limits);
    let body = endless(false);
    assert_eq!(send(app.clone(), post(None, &body)).await.status, 200);
    let refused = send(app, post(None, &body)).await;
    let message = assert_error(&refused, 429, "overloaded_error", None);
    assert!(message.contains("0.2 requests per second"), "{message}");
    // One request per 5 s: the next fits in 5 s, less the moment since the first.
    let wait: u64 = refused.headers[header::RETRY_AFTER]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((4..=5).contains(&wait), "Retry-After {wait}");
}

#[tokio::test]
async fn only_priority_keys_run_ahead_of_the_default() {
    let engine = MockEngine::new(Reply::EchoPrompt(1));
    let keys = ApiKeys::new(["user".to_string()]).with_priority(["vip".to_string()]);
    let app = app_with_limits(Arc::clone(&engine), keys, no_limits());
    let ahead = json!({"model": IDS_MODEL, "prompt": [5], "max_tokens": 1, "priority": -1});
    let refused = send(app.clone(), post(Some("user"), &ahead)).await;
    let message = assert_error(&refused, 403, "permission_error", Some("priority"));
    assert!(message.contains("--priority-key"), "{message}");
    assert!(
        engine.requests().is_empty(),
        "a refused request reached the engine"
    );
    assert_eq!(
        send(app.clone(), post(Some("vip"), &ahead)).await.status,
        200
    );
    assert_eq!(engine.last().priority, -1);
    let behind = json!({"model": IDS_MODEL, "prompt": [5], "max_tokens": 1, "priority": 3});
    assert_eq!(send(app, post(Some("user"), &behind)).await.status, 200);
    assert_eq!(engine.last().priority, 3);
}

/// Serves the API over a socket: the ids-only model with a context long enough for a
/// stream far larger than any socket buffer.
async fn serve(engine: Arc<MockEngine>, limits: ApiLimits, conn: ConnLimits) -> SocketAddr {
    let mut models = models();
    for model in &mut models {
        model.context_tokens = 1 << 20;
    }
    let app = api::router(ApiState {
        models: Arc::new(ServedModels::new(models)),
        engine,
        api_keys: ApiKeys::default(),
        limits,
        drain: Drain::new(Duration::from_secs(30)),
    });
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(listen::serve(listener, app, conn, std::future::pending()));
    addr
}

fn raw_post(body: &str, content_length: usize) -> String {
    format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         content-length: {content_length}\r\n\r\n{body}"
    )
}

#[tokio::test]
async fn a_body_that_does_not_arrive_in_time_gets_408() {
    let engine = MockEngine::new(Reply::EchoPrompt(1));
    let limits = ApiLimits {
        body_timeout: Duration::from_millis(300),
        ..no_limits()
    };
    let addr = serve(Arc::clone(&engine), limits, ConnLimits::default()).await;
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    // 100 bytes announced, 9 sent.
    let request = raw_post("{\"model\":", 100);
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut answer))
        .await
        .expect("an answer before the client's own timeout")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer[..n]);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("did not arrive within 0.3 s"), "{answer}");
    assert!(engine.requests().is_empty());
}

#[tokio::test]
async fn a_client_that_stops_reading_loses_its_connection_and_its_sequence() {
    // Far more events than the socket buffers of both ends hold.
    let tokens: Vec<u32> = (0..200_000).map(|i| 3 + i % 90).collect();
    let engine = MockEngine::new(Reply::Script(tokens, None));
    let conn = ConnLimits {
        write_timeout: Duration::from_millis(500),
        ..ConnLimits::default()
    };
    let addr = serve(Arc::clone(&engine), no_limits(), conn).await;
    let socket = TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stream = socket.connect(addr).await.unwrap();
    let body = json!({
        "model": IDS_MODEL, "prompt": [5], "max_tokens": 300_000, "stream": true,
        "return_token_ids": true,
    })
    .to_string();
    stream
        .write_all(raw_post(&body, body.len()).as_bytes())
        .await
        .unwrap();
    let mut head = vec![0u8; 1024];
    let n = stream.read(&mut head).await.unwrap();
    assert!(String::from_utf8_lossy(&head[..n]).starts_with("HTTP/1.1 200"));
    // Now the client reads nothing more, and keeps its connection open: the server's
    // writes stall, and after the write timeout it closes, dropping the stream.
    engine.wait_cancelled(1).await;
    drop(stream);
}
