//! HTTP/1.1 over the coordinator peers' QUIC connections, which run mutual TLS with the
//! cluster's certificates: how a follower's call reaches the leader, encrypted, and only
//! a peer of the cluster. Each call takes a bidirectional stream of its own that starts
//! with a [`PeerMsg::Http`] frame and then carries one request and its response. The
//! connection to the leader stays open for the next call, and QUIC's keep-alives find a
//! leader that vanished under a stream within [`quic::MAX_IDLE_TIMEOUT`].

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use axum::http::Response;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tessera_comm::certs::Identity;
use tessera_comm::{quic, wire};
use tessera_topology::PeerId;
use tokio::sync::Mutex;
use tower::ServiceExt as _;
use tracing::debug;

use crate::error::CoordinatorError;
use crate::replication::transport::{HttpStreams, PeerMsg};

/// A leader that does not accept the connection, or a stream on it, within this is
/// treated as unreachable. A leader takes up to
/// [`crate::replication::transport::HTTP_STREAMS_AT_ONCE`] calls from one peer at once.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// The request headers of a forwarded call must arrive within this.
const HEADER_TIMEOUT: Duration = Duration::from_secs(30);

/// Set on a request that another peer forwarded here: that peer's id, as its certificate
/// names it. A forwarded call is never forwarded again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ForwardedBy(pub PeerId);

/// The follower's side: its connection to the leader, opened on first use.
#[derive(Debug)]
pub struct LeaderLink {
    endpoint: quinn::Endpoint,
    open: Mutex<Option<(PeerId, quinn::Connection)>>,
}

impl LeaderLink {
    /// Dials from `endpoint`, the peer's own QUIC endpoint and certificate.
    pub fn new(endpoint: quinn::Endpoint) -> LeaderLink {
        LeaderLink {
            endpoint,
            open: Mutex::new(None),
        }
    }

    /// Sends `request` to peer `leader` at QUIC address `quic`, and returns its response
    /// as it starts: the body streams on.
    pub async fn send(
        &self,
        leader: PeerId,
        quic: &str,
        request: Request,
    ) -> Result<Response<Incoming>, CoordinatorError> {
        let failed = |reason: String| CoordinatorError::ForwardFailed {
            leader,
            quic: quic.to_string(),
            reason,
        };
        let connection = self.connection(leader, quic).await.map_err(failed)?;
        let (mut send, recv) = tokio::time::timeout(CONNECT_TIMEOUT, connection.open_bi())
            .await
            .map_err(|_| failed(format!("no stream within {CONNECT_TIMEOUT:?}")))?
            .map_err(|e| failed(e.to_string()))?;
        wire::write_frame(&mut send, &PeerMsg::Http)
            .await
            .map_err(|e| failed(e.to_string()))?;
        let io = TokioIo::new(tokio::io::join(recv, send));
        let (mut sender, exchange) = hyper::client::conn::http1::handshake(io)
            .await
            .map_err(|e| failed(e.to_string()))?;
        tokio::spawn(async move {
            if let Err(error) = exchange.await {
                debug!(leader = leader.0, %error, "forwarded exchange ended with an error");
            }
        });
        sender
            .send_request(request)
            .await
            .map_err(|e| failed(e.to_string()))
    }

    /// The open connection to `leader`, or a new one; the reason when there is none.
    async fn connection(&self, leader: PeerId, quic: &str) -> Result<quinn::Connection, String> {
        let mut open = self.open.lock().await;
        if let Some((id, connection)) = open.as_ref()
            && *id == leader
            && connection.close_reason().is_none()
        {
            return Ok(connection.clone());
        }
        let addr = tokio::net::lookup_host(quic)
            .await
            .map_err(|e| e.to_string())?
            .next()
            .ok_or("the address resolves to nothing")?;
        let identity = Identity::Coordinator(leader);
        let connecting = quic::connect(&self.endpoint, addr, &identity);
        let connection = tokio::time::timeout(CONNECT_TIMEOUT, connecting)
            .await
            .map_err(|_| format!("no connection within {CONNECT_TIMEOUT:?}"))?
            .map_err(|e| e.to_string())?;
        *open = Some((leader, connection.clone()));
        Ok(connection)
    }
}

/// The leader's side: serves each forwarded call on `app`, marked [`ForwardedBy`] the
/// peer whose connection it came on.
pub fn serve(app: Router) -> HttpStreams {
    let mut builder = http1::Builder::new();
    builder
        .keep_alive(false)
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT);
    Arc::new(move |from, send, recv| {
        let service = app
            .clone()
            .map_request(move |mut request: axum::http::Request<Incoming>| {
                request.extensions_mut().insert(ForwardedBy(from));
                request.map(Body::new)
            });
        let io = TokioIo::new(tokio::io::join(recv, send));
        let exchange = builder.serve_connection(io, TowerToHyperService::new(service));
        tokio::spawn(async move {
            if let Err(error) = exchange.await {
                debug!(from = from.0, %error, "forwarded call ended with an error");
            }
        });
    })
}
