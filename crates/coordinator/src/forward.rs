//! Followers forward API calls to the leader. A coordinator peer that does not lead sends
//! generation requests, `/ready` and `/v1/cluster` (the groups live on the leader; add
//! `?local=true` for this peer's own view) to the leader as they are, and streams the
//! answer back, so a client may use any peer. While an election is under way it waits for
//! a leader for up to [`crate::leader::ELECTION_WAIT`]; a call that was forwarded once is
//! never forwarded again (it is answered here: 503 naming the leader).
//!
//! Calls cross over the peers' QUIC connections, under mutual TLS with the cluster's
//! certificates ([`tunnel`]): a client's API key never crosses between peers in
//! plaintext, and only a peer of the cluster can forward. A leader that cannot be reached
//! fails the call within [`tunnel::CONNECT_TIMEOUT`] (503).

pub mod tunnel;

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::Uri;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tessera_comm::proto::WireError;
use tessera_topology::PeerId;
use tracing::debug;

use crate::api::ApiError;
use crate::error::CoordinatorError;
use crate::leader::{Leader, Leadership};
use tunnel::{ForwardedBy, LeaderLink};

/// Calls that only the leader can answer.
fn leader_only(path: &str, query: Option<&str>) -> bool {
    match path {
        "/ready" | "/v1/completions" | "/v1/chat/completions" => true,
        "/v1/cluster" => !query.is_some_and(|q| q.split('&').any(|kv| kv == "local=true")),
        _ => {
            path.starts_with("/v1/streams/")
                || path.starts_with("/v1/cluster/peers")
                || path.starts_with("/v1/cluster/groups/")
                || path.starts_with("/v1/cluster/models/")
                || path == "/v1/cluster/topology"
        }
    }
}

/// The forwarding middleware's state.
#[derive(Clone, Debug)]
pub struct Forwarder {
    leadership: Leadership,
    link: Arc<LeaderLink>,
}

impl Forwarder {
    /// Forwards over `endpoint`, this peer's QUIC endpoint.
    pub fn new(leadership: Leadership, endpoint: quinn::Endpoint) -> Forwarder {
        Forwarder {
            leadership,
            link: Arc::new(LeaderLink::new(endpoint)),
        }
    }

    /// The leader's id and QUIC address when another peer leads; `None` to answer here.
    /// Waits for an election under way.
    async fn target(&self) -> Option<(PeerId, String)> {
        match self.leadership.leader_soon().await {
            Leader::Other { id, quic, .. } => Some((id, quic)),
            Leader::This(_) | Leader::Unknown => None,
        }
    }
}

/// The middleware: forwards leader-only calls when another peer leads.
pub async fn forward(State(f): State<Forwarder>, request: Request, next: Next) -> Response {
    let uri = request.uri();
    if !leader_only(uri.path(), uri.query()) || request.extensions().get::<ForwardedBy>().is_some()
    {
        return next.run(request).await;
    }
    let Some((leader, quic)) = f.target().await else {
        return next.run(request).await;
    };
    match proxy(&f, request, leader, &quic).await {
        Ok(response) => response,
        Err(error) => ApiError::from(WireError::from(error)).into_response(),
    }
}

async fn proxy(
    f: &Forwarder,
    mut request: Request,
    leader: PeerId,
    quic: &str,
) -> Result<Response, CoordinatorError> {
    // The tunnel leads to the leader itself: the target is the path alone.
    let mut parts = request.uri().clone().into_parts();
    parts.scheme = None;
    parts.authority = None;
    if let Ok(uri) = Uri::from_parts(parts) {
        *request.uri_mut() = uri;
    }
    debug!(leader = leader.0, uri = %request.uri(), "forwarding to the leader");
    let response = f.link.send(leader, quic, request).await?;
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
            "/v1/cluster/groups/g/drain",
            "/v1/cluster/models/m",
            "/v1/cluster/models/m/deploy",
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
