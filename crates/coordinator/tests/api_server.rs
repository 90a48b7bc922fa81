//! The API as a server: API keys, `/v1/cluster` and the status page, metrics, and client
//! disconnects over a real socket (the dropped connection must drop the token stream).

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use common::*;
use serde_json::json;
use tessera_coordinator::api::ApiKeys;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn keys() -> ApiKeys {
    ApiKeys::new(["k-one".to_string(), "k-two".to_string()])
}

fn with_auth(path: &str, auth: Option<&str>) -> Request<Body> {
    let mut builder = Request::post(path).header(header::CONTENT_TYPE, "application/json");
    if let Some(auth) = auth {
        builder = builder.header(header::AUTHORIZATION, auth);
    }
    let body = json!({"model": IDS_MODEL, "prompt": [1], "max_tokens": 1});
    builder.body(Body::from(body.to_string())).unwrap()
}

#[tokio::test]
async fn keys_are_required_except_on_probes() {
    let engine = MockEngine::new(Reply::EchoPrompt(1));
    let app = || app_with_keys(engine.clone(), keys());
    for auth in [
        None,
        Some("Bearer wrong"),
        Some("Basic k-one"),
        Some("Bearer k-on"),
    ] {
        let reply = send(app(), with_auth("/v1/completions", auth)).await;
        assert_error(&reply, 401, "invalid_request_error", None);
        assert_eq!(reply.body["error"]["code"], "invalid_api_key");
    }
    assert!(engine.requests().is_empty());
    for auth in ["Bearer k-one", "bearer k-two"] {
        let reply = send(app(), with_auth("/v1/completions", Some(auth))).await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    }
    for path in ["/v1/models", "/v1/cluster"] {
        let reply = get(app(), path).await;
        assert_eq!(reply.status, StatusCode::UNAUTHORIZED, "{path}");
    }
    for path in ["/health", "/ready"] {
        let reply = get(app(), path).await;
        assert_eq!(reply.status, StatusCode::OK, "{path}");
    }
    let (status, _, _) = send_text(app(), Request::get("/").body(Body::empty()).unwrap()).await;
    assert_eq!(
        status,
        StatusCode::OK,
        "the status page asks for a key itself"
    );
}

#[tokio::test]
async fn cluster_status_is_the_engines() {
    let engine = MockEngine::new(Reply::EchoPrompt(1));
    let reply = get(app(engine), "/v1/cluster").await;
    assert_eq!(reply.status, StatusCode::OK);
    let group = &reply.body["groups"][0];
    assert_eq!(group["name"], "g0");
    assert_eq!(group["kv_blocks_used"], 25);
    assert_eq!(group["shards"][0]["pid"], 42);
    assert_eq!(group["shards"][0]["kv_blocks_free"], 75);
}

#[tokio::test]
async fn status_page_is_self_contained() {
    let (status, headers, page) = send_text(
        app(MockEngine::new(Reply::EchoPrompt(1))),
        Request::get("/").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        headers
            .get(header::CONTENT_TYPE)
            .unwrap()
            .to_str()
            .unwrap()
            .starts_with("text/html")
    );
    assert!(page.contains("/v1/cluster"));
    assert!(page.contains("localStorage"));
    assert!(page.contains("2000"));
    for external in ["http://", "https://", "src=", "<link"] {
        assert!(!page.contains(external), "the page loads {external}");
    }
}

#[tokio::test]
async fn metrics_are_recorded() {
    let Some(handle) = tessera_coordinator::metrics::install() else {
        panic!("this test binary installs the only recorder");
    };
    let engine = MockEngine::new(Reply::EchoPrompt(3));
    let reply = complete(
        app(engine),
        json!({"model": IDS_MODEL, "prompt": [1, 2, 3]}),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK);
    let text = handle.render();
    for name in [
        tessera_coordinator::metrics::API_TIME_TO_FIRST_TOKEN_SECONDS,
        tessera_coordinator::metrics::API_INTER_TOKEN_LATENCY_SECONDS,
        tessera_coordinator::metrics::API_REQUEST_DURATION_SECONDS,
        tessera_coordinator::metrics::API_PROMPT_TOKENS,
        tessera_coordinator::metrics::API_GENERATED_TOKENS,
        tessera_coordinator::metrics::API_REQUESTS,
    ] {
        assert!(text.contains(name), "{name} missing from:\n{text}");
    }
    assert!(text.contains("status=\"200\""), "{text}");
}

/// Serves `engine` on a local port.
async fn serve(engine: std::sync::Arc<MockEngine>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = app(engine);
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    addr
}

/// Sends a completion request over a raw connection and returns the connection.
async fn raw_request(addr: SocketAddr, stream: bool) -> TcpStream {
    let body = json!({"model": IDS_MODEL, "prompt": [1, 2], "max_tokens": 50,
                      "stream": stream})
    .to_string();
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut socket = TcpStream::connect(addr).await.unwrap();
    socket.write_all(request.as_bytes()).await.unwrap();
    socket
}

#[tokio::test]
async fn disconnect_cancels_a_streaming_request() {
    let engine = MockEngine::new(Reply::Script(vec![5, 6], None));
    let addr = serve(engine.clone()).await;
    let mut socket = raw_request(addr, true).await;
    // Wait for the first event: the sequence runs.
    let mut buf = vec![0u8; 4096];
    let read = tokio::time::timeout(Duration::from_secs(5), socket.read(&mut buf))
        .await
        .expect("the first event comes")
        .unwrap();
    let head = String::from_utf8_lossy(&buf[..read]);
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert_eq!(
        engine.cancelled.load(std::sync::atomic::Ordering::SeqCst),
        0
    );
    drop(socket);
    engine.wait_cancelled(1).await;
}

#[tokio::test]
async fn disconnect_cancels_a_waiting_request() {
    let engine = MockEngine::new(Reply::Script(vec![5, 6], None));
    let addr = serve(engine.clone()).await;
    let socket = raw_request(addr, false).await;
    tokio::time::timeout(Duration::from_secs(5), async {
        while engine.requests().is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the request reaches the engine");
    assert_eq!(
        engine.cancelled.load(std::sync::atomic::Ordering::SeqCst),
        0
    );
    drop(socket);
    engine.wait_cancelled(1).await;
}
