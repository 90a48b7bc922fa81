//! Followers forward API calls to the leader. A coordinator peer that does not lead sends
//! generation requests, `/ready` and `/v1/cluster` (the groups live on the leader; add
//! `?local=true` for this peer's own view) to the leader's HTTP address as they are, and
//! streams the answer back, so a client may use any peer. While an election is under way
//! it waits for a leader for up to [`crate::leader::ELECTION_WAIT`]; a call that was forwarded once is
//! never forwarded again (it is answered here: 503 naming the leader).
//!
//! A leader that cannot be reached fails the call within [`CONNECT_TIMEOUT`] (503), and TCP
//! keep-alive probes find a leader that vanished under a forwarded stream. The call crosses
//! in plain HTTP, as the client sent it: keep the peers' HTTP addresses on a private
//! network, or give clients the leader's address.

use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderName, HeaderValue, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tessera_comm::proto::WireError;
use tracing::debug;

use crate::api::ApiError;
use crate::error::CoordinatorError;
use crate::leader::{Leader, Leadership};

/// A leader that does not accept the connection within this is treated as unreachable.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Idle time before TCP keep-alive probes start on a forwarding connection.
const KEEPALIVE: Duration = Duration::from_secs(10);

/// Set on a forwarded call: the id of the peer that forwarded it.
pub const FORWARDED_BY: HeaderName = HeaderName::from_static("x-tessera-forwarded-by");

/// Calls that only the leader can answer.
fn leader_only(path: &str, query: Option<&str>) -> bool {
    match path {
        "/ready" | "/v1/completions" | "/v1/chat/completions" => true,
        "/v1/cluster" => !query.is_some_and(|q| q.split('&').any(|kv| kv == "local=true")),
        _ => path.starts_with("/v1/streams/") || path.starts_with("/v1/cluster/peers"),
    }
}

/// The forwarding middleware's state.
#[derive(Clone, Debug)]
pub struct Forwarder {
    leadership: Leadership,
    client: Client<HttpConnector, Body>,
}

impl Forwarder {
    pub fn new(leadership: Leadership) -> Forwarder {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(CONNECT_TIMEOUT));
        connector.set_keepalive(Some(KEEPALIVE));
        connector.set_nodelay(true);
        Forwarder {
            leadership,
            client: Client::builder(TokioExecutor::new()).build(connector),
        }
    }

    /// The leader's HTTP address when another peer leads; `None` to answer here. Waits
    /// for an election under way.
    async fn target(&self) -> Option<String> {
        match self.leadership.leader_soon().await {
            Leader::Other { http, .. } => Some(http),
            Leader::This(_) | Leader::Unknown => None,
        }
    }
}

/// The middleware: forwards leader-only calls when another peer leads.
pub async fn forward(State(f): State<Forwarder>, request: Request, next: Next) -> Response {
    let uri = request.uri();
    if !leader_only(uri.path(), uri.query()) || request.headers().contains_key(&FORWARDED_BY) {
        return next.run(request).await;
    }
    let Some(target) = f.target().await else {
        return next.run(request).await;
    };
    match proxy(&f, request, &target).await {
        Ok(response) => response,
        Err(error) => ApiError::from(WireError::from(error)).into_response(),
    }
}

async fn proxy(
    f: &Forwarder,
    mut request: Request,
    target: &str,
) -> Result<Response, CoordinatorError> {
    let path = request
        .uri()
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_string();
    let uri: Uri = format!("http://{target}{path}").parse().map_err(|source| {
        CoordinatorError::LeaderAddress {
            target: target.to_string(),
            source,
        }
    })?;
    debug!(%uri, "forwarding to the leader");
    *request.uri_mut() = uri;
    let headers = request.headers_mut();
    headers.remove(axum::http::header::HOST);
    headers.insert(FORWARDED_BY, HeaderValue::from(f.leadership.id().0));
    let response =
        f.client
            .request(request)
            .await
            .map_err(|source| CoordinatorError::ForwardFailed {
                target: target.to_string(),
                source,
            })?;
    Ok(response.map(Body::new))
}

#[cfg(test)]
mod tests {
    use super::leader_only;

    #[test]
    fn only_calls_that_need_the_groups_are_forwarded() {
        for path in [
            "/ready",
            "/v1/completions",
            "/v1/chat/completions",
            "/v1/streams/cmpl-1",
            "/v1/cluster",
            "/v1/cluster/peers",
            "/v1/cluster/peers/4",
        ] {
            assert!(leader_only(path, None), "{path}");
        }
        for path in ["/health", "/v1/models", "/metrics", "/"] {
            assert!(!leader_only(path, None), "{path}");
        }
        assert!(!leader_only("/v1/cluster", Some("local=true")));
        assert!(leader_only("/v1/cluster", Some("local=false")));
    }
}
