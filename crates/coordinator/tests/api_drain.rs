//! A peer's drain at the HTTP layer: the drain middleware in front of the API, as a
//! coordinator peer serves it, over the mock engine.

mod common;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, header};
use common::*;
use serde_json::{Value, json};
use tessera_coordinator::api::drain::{self, Drain};
use tessera_coordinator::api::{self, ApiKeys, ApiLimits, ApiState, ServedModels};
use tower::ServiceExt;

fn draining_app(engine: Arc<MockEngine>, keys: ApiKeys) -> (Router, Arc<Drain>) {
    let drain = Drain::new(Duration::from_secs(30));
    let app = api::router(ApiState {
        models: Arc::new(ServedModels::new(models())),
        engine,
        api_keys: keys,
        limits: ApiLimits::default(),
        drain: Arc::clone(&drain),
    })
    .layer(axum::middleware::from_fn_with_state(
        Arc::clone(&drain),
        drain::admit,
    ));
    (app, drain)
}

/// A stream that stays open until its response is dropped.
fn endless() -> Value {
    json!({"model": IDS_MODEL, "prompt": [5], "max_tokens": 8, "stream": true})
}

fn admin_drain(key: &str) -> Request<Body> {
    Request::post("/v1/admin/drain")
        .header(header::AUTHORIZATION, format!("Bearer {key}"))
        .body(Body::empty())
        .unwrap()
}

#[tokio::test]
async fn a_drain_refuses_new_requests_and_counts_the_stream_in_flight_until_it_ends() {
    let engine = MockEngine::new(Reply::Script(vec![7], None));
    let keys = ApiKeys::new(["user".to_string()]).with_admin(["root".to_string()]);
    let (app, drain) = draining_app(Arc::clone(&engine), keys);
    let bearer = [("authorization", "Bearer user")];
    let held = app
        .clone()
        .oneshot(post_json("/v1/completions", &bearer, &endless()))
        .await
        .unwrap();
    assert_eq!(held.status(), 200);
    assert_eq!(drain.state().in_flight, 1);
    assert_eq!(get(app.clone(), "/ready").await.status, 200);

    // Only an admin key starts it.
    let refused = send(app.clone(), admin_drain("user")).await;
    assert_error(&refused, 403, "permission_error", None);
    assert!(!drain.state().draining);
    let started = send(app.clone(), admin_drain("root")).await;
    assert_eq!(started.status, 202);
    assert_eq!(
        started.body,
        json!({"draining": true, "in_flight": 1, "timeout_s": 30.0})
    );

    // New requests: 503, with when to come back.
    let refused = tokio::time::timeout(
        Duration::from_secs(5),
        send(
            app.clone(),
            post_json("/v1/completions", &bearer, &endless()),
        ),
    )
    .await
    .expect("a draining peer admitted a request");
    let message = assert_error(&refused, 503, "service_unavailable_error", None);
    assert!(message.contains("draining"), "{message}");
    assert_eq!(refused.body["error"]["code"], "draining");
    assert_eq!(refused.headers[header::RETRY_AFTER], "2");
    assert_eq!(
        refused.headers[header::CONNECTION],
        "close",
        "no retry down this connection"
    );
    let ready = get(app.clone(), "/ready").await;
    assert_eq!(ready.status, 503);
    assert_eq!(ready.headers[header::CONNECTION], "close");
    assert_eq!(ready.body, json!({"status": "draining", "in_flight": 1}));
    // The process is alive.
    assert_eq!(get(app.clone(), "/health").await.status, 200);

    // The stream in flight was not cut; it counts until its body ends.
    let mut watch = drain.watch();
    drop(held);
    engine.wait_cancelled(1).await;
    tokio::time::timeout(Duration::from_secs(5), watch.wait_for(|s| s.in_flight == 0))
        .await
        .expect("the count drops when the stream ends")
        .unwrap();
    let status = send(
        app,
        Request::get("/v1/admin/drain")
            .header(header::AUTHORIZATION, "Bearer root")
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(
        status.body,
        json!({"draining": true, "in_flight": 0, "timeout_s": 30.0})
    );
}

#[tokio::test]
async fn a_second_drain_request_changes_nothing() {
    let engine = MockEngine::new(Reply::EchoPrompt(1));
    let (app, drain) = draining_app(engine, ApiKeys::default());
    assert!(drain.start());
    assert!(!drain.start());
    let again = send(app, admin_drain("any")).await;
    assert_eq!(again.status, 202);
    assert_eq!(again.body["draining"], true);
}
