//! A follower's call to the leader crosses the peers' QUIC connections, under mutual TLS
//! with the cluster's certificates (`forward::tunnel`): three peers over QUIC as
//! `tessera-coordinator` runs them, peer 1 serving a small API on its forwarded streams,
//! and a follower's link dialing it with peer 2's certificate.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Extension, Request};
use axum::http::{HeaderMap, StatusCode, header};
use axum::routing::{get, post};
use http_body_util::BodyExt as _;
use tessera_comm::certs::{Credentials, Identity};
use tessera_comm::quic;
use tessera_coordinator::error::CoordinatorError;
use tessera_coordinator::forward::tunnel::{self, ForwardedBy, LeaderLink};
use tessera_topology::PeerId;
use tokio::sync::Barrier;

mod support;
use support::peers::Peers;

const TIMEOUT: Duration = Duration::from_secs(20);

/// Calls held open at once in the concurrency test: more than a QUIC connection's
/// default stream limit.
const AT_ONCE: usize = 3 * quic::MAX_CONCURRENT_BIDI_STREAMS as usize;

/// Says who forwarded the call, with what key, and what it carried.
async fn echo(
    Extension(ForwardedBy(by)): Extension<ForwardedBy>,
    headers: HeaderMap,
    body: String,
) -> String {
    let key = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("none");
    format!("forwarded by peer {} with {key}: {body}", by.0)
}

/// Peer 1's API, and the flag its endless stream sets when it is dropped.
fn app(dropped: Arc<AtomicBool>, barrier: Arc<Barrier>) -> Router {
    Router::new()
        .route("/v1/completions", post(echo))
        .route(
            "/endless",
            get(move || {
                let guard = SetOnDrop(Arc::clone(&dropped));
                let ticks = futures_util::stream::unfold(guard, |guard| async move {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    Some((Ok::<_, std::io::Error>("data: tick\n\n"), guard))
                });
                std::future::ready(Body::from_stream(ticks))
            }),
        )
        .route(
            "/together",
            get(move || {
                let barrier = Arc::clone(&barrier);
                async move {
                    barrier.wait().await;
                    "all here"
                }
            }),
        )
}

struct SetOnDrop(Arc<AtomicBool>);

impl Drop for SetOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// Three peers (a topology has an odd number); peer 1 serves [`app`] to the calls forwarded to it.
fn peers(dir: &std::path::Path, dropped: &Arc<AtomicBool>) -> Peers {
    let barrier = Arc::new(Barrier::new(AT_ONCE));
    let forwarded = tunnel::serve(app(Arc::clone(dropped), barrier));
    Peers::serving(3, dir, forwarded)
}

/// A follower's link, holding peer `id`'s certificate.
fn link(peers: &Peers, id: Identity) -> LeaderLink {
    let creds = Credentials::load(&peers.certs(), &id).expect("credentials");
    LeaderLink::new(quic::client_endpoint(&creds).expect("endpoint"))
}

fn request(method: &str, path: &str, body: &str) -> Request {
    Request::builder()
        .method(method)
        .uri(path)
        .header(header::AUTHORIZATION, "Bearer sk-client")
        .body(Body::from(body.to_string()))
        .expect("request")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forwarded_call_reaches_the_leader_over_mutual_tls_marked_with_the_peer_that_sent_it() {
    let dir = tempfile::tempdir().expect("dir");
    let dropped = Arc::new(AtomicBool::new(false));
    let mut peers = peers(dir.path(), &dropped);
    let leader_quic = peers.quic(1).to_string();
    let link = link(&peers, Identity::Coordinator(PeerId(2)));

    let call = link.send(
        PeerId(1),
        &leader_quic,
        request("POST", "/v1/completions", "{\"prompt\":\"hi\"}"),
    );
    let response = tokio::time::timeout(TIMEOUT, call)
        .await
        .expect("in time")
        .expect("forwarded");
    assert_eq!(response.status(), StatusCode::OK);
    let body = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    assert_eq!(
        body,
        "forwarded by peer 2 with Bearer sk-client: {\"prompt\":\"hi\"}"
    );
    peers.stop_all().await;
}

/// A follower never hands a client's call to a peer that is not the leader it expects:
/// the leader's certificate must name it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_is_not_forwarded_to_a_peer_whose_certificate_names_another() {
    let dir = tempfile::tempdir().expect("dir");
    let dropped = Arc::new(AtomicBool::new(false));
    let mut peers = peers(dir.path(), &dropped);
    let link = link(&peers, Identity::Coordinator(PeerId(2)));
    // Peer 1 answers at the address where the follower believes peer 3 leads.
    let impostor = peers.quic(1).to_string();
    let refused = link
        .send(
            PeerId(3),
            &impostor,
            request("POST", "/v1/completions", "{}"),
        )
        .await
        .expect_err("refused");
    let CoordinatorError::ForwardFailed { leader, reason, .. } = &refused else {
        panic!("{refused}");
    };
    assert_eq!(*leader, PeerId(3));
    assert!(reason.contains("not valid for name"), "{refused}");
    eprintln!("refused as it should be: {refused}");
    peers.stop_all().await;
}

/// A client that goes away drops the leader's side of its call: a stream's sequences
/// are cancelled there and their KV blocks freed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_ends_the_call_on_the_leader() {
    let dir = tempfile::tempdir().expect("dir");
    let dropped = Arc::new(AtomicBool::new(false));
    let mut peers = peers(dir.path(), &dropped);
    let link = link(&peers, Identity::Coordinator(PeerId(2)));
    let response = link
        .send(
            PeerId(1),
            &peers.quic(1).to_string(),
            request("GET", "/endless", ""),
        )
        .await
        .expect("forwarded");
    let mut body = response.into_body();
    let first = tokio::time::timeout(TIMEOUT, body.frame())
        .await
        .expect("in time")
        .expect("a frame")
        .expect("data");
    assert_eq!(first.into_data().expect("data"), "data: tick\n\n");
    assert!(!dropped.load(Ordering::SeqCst), "the stream ended early");
    drop(body);
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    while !dropped.load(Ordering::SeqCst) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the leader still streams to a client that left"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    peers.stop_all().await;
}

/// A follower forwards many calls at once, each on a stream of its own: more than the
/// few streams a control connection allows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_calls_cross_at_once() {
    let dir = tempfile::tempdir().expect("dir");
    let dropped = Arc::new(AtomicBool::new(false));
    let mut peers = peers(dir.path(), &dropped);
    let link = Arc::new(link(&peers, Identity::Coordinator(PeerId(2))));
    let leader_quic = peers.quic(1).to_string();
    let calls: Vec<_> = (0..AT_ONCE)
        .map(|_| {
            let link = Arc::clone(&link);
            let quic = leader_quic.clone();
            tokio::spawn(async move {
                let response = link
                    .send(PeerId(1), &quic, request("GET", "/together", ""))
                    .await?;
                let body = response.into_body().collect().await;
                Ok::<_, CoordinatorError>(body.map(|b| b.to_bytes()))
            })
        })
        .collect();
    for call in calls {
        let body = tokio::time::timeout(TIMEOUT, call)
            .await
            .expect("every call is in flight at once")
            .expect("joined")
            .expect("forwarded")
            .expect("body");
        assert_eq!(body, "all here");
    }
    peers.stop_all().await;
}
