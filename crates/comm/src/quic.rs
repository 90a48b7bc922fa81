//! QUIC endpoints of the control plane (quinn), with mutual TLS ([`crate::tls`]) and
//! explicit transport limits ([`transport_config`]).
//!
//! A coordinator opens a [`server_endpoint`] on its `quic` address and accepts
//! connections; a shard opens a [`client_endpoint`] and [`connect`]s to a coordinator by
//! address and expected [`Identity`]. After the handshake each side learns who the other is
//! with [`peer_identity`] (the identity URI of the peer's certificate); the coordinator
//! refuses a peer with the wrong role ([`expect_shard`]) or an id the topology does not
//! have. Messages travel as frames ([`crate::wire`]) on one bidirectional stream.
//!
//! Under TLS 1.3 the server verifies the client's certificate after the client considers
//! the handshake done: a client with a certificate from another CA sees `connect` succeed
//! and the refusal on its first read of a stream (the connection is closed with a TLS
//! alert).

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{IdleTimeout, TransportConfig, VarInt};
use rustls::pki_types::CertificateDer;
use tessera_topology::{PeerId, Rank};

use crate::CommError;
use crate::certs::{Credentials, Identity, identity_of_cert};
use crate::tls::{client_config, server_config};
use crate::wire::MAX_FRAME_BYTES;

/// A keep-alive every second keeps an idle control connection (a shard between requests)
/// from timing out, and gives the idle timer fresh acknowledgements to watch.
pub const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(1);

/// A peer silent for this long is dead: three missed keep-alives. A killed shard is noticed
/// by the coordinator within about 3 s (the fault tests require well under 5 s), while one
/// lost packet or a short scheduling stall does not drop a healthy connection.
pub const MAX_IDLE_TIMEOUT: Duration = Duration::from_secs(3);

/// Bytes a peer may have in flight on one stream: two frames of the largest size
/// ([`MAX_FRAME_BYTES`]), so a full-size step plan never stalls on flow control, and a
/// bound on what one stream can make the receiver buffer.
pub const STREAM_RECEIVE_WINDOW_BYTES: u32 = 2 * MAX_FRAME_BYTES as u32;

/// Bytes a peer may have in flight on the whole connection: two busy streams' worth. A
/// coordinator with hundreds of shards holds at most this much per connection.
pub const CONNECTION_RECEIVE_WINDOW_BYTES: u32 = 2 * STREAM_RECEIVE_WINDOW_BYTES;

/// Bidirectional streams a peer may open at once. The protocol uses one per connection;
/// the rest leave room for a reconnecting stream or a one-off query, and a misbehaving
/// peer cannot open thousands.
pub const MAX_CONCURRENT_BIDI_STREAMS: u32 = 8;

/// Unidirectional streams are not used by the protocol: a peer may open none.
pub const MAX_CONCURRENT_UNI_STREAMS: u32 = 0;

/// The transport settings of every control connection, server and client alike.
pub fn transport_config() -> Arc<TransportConfig> {
    let mut config = TransportConfig::default();
    config
        .keep_alive_interval(Some(KEEP_ALIVE_INTERVAL))
        .max_idle_timeout(Some(IdleTimeout::from(VarInt::from_u32(
            MAX_IDLE_TIMEOUT.as_millis() as u32,
        ))))
        .stream_receive_window(VarInt::from_u32(STREAM_RECEIVE_WINDOW_BYTES))
        .receive_window(VarInt::from_u32(CONNECTION_RECEIVE_WINDOW_BYTES))
        .send_window(u64::from(CONNECTION_RECEIVE_WINDOW_BYTES))
        .max_concurrent_bidi_streams(VarInt::from_u32(MAX_CONCURRENT_BIDI_STREAMS))
        .max_concurrent_uni_streams(VarInt::from_u32(MAX_CONCURRENT_UNI_STREAMS));
    Arc::new(config)
}

/// A server endpoint on `bind` (a coordinator's `quic` address) that requires clients of
/// the cluster CA. It also dials out: it can [`connect`] to other coordinator peers.
pub fn server_endpoint(
    bind: SocketAddr,
    creds: &Credentials,
) -> Result<quinn::Endpoint, CommError> {
    let crypto = QuicServerConfig::try_from(server_config(creds)?).map_err(|e| CommError::Tls {
        identity: creds.identity().to_string(),
        message: e.to_string(),
    })?;
    let mut config = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    config.transport_config(transport_config());
    let mut endpoint = quinn::Endpoint::server(config, bind)
        .map_err(|source| CommError::Endpoint { addr: bind, source })?;
    endpoint.set_default_client_config(quinn_client_config(creds)?);
    Ok(endpoint)
}

/// A client-only endpoint on an ephemeral IPv4 port (`0.0.0.0:0`). For an IPv6
/// coordinator use [`client_endpoint_for`].
pub fn client_endpoint(creds: &Credentials) -> Result<quinn::Endpoint, CommError> {
    client_endpoint_on(SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0)), creds)
}

/// A client-only endpoint on an ephemeral port of `target`'s address family
/// (`0.0.0.0:0` or `[::]:0`).
pub fn client_endpoint_for(
    target: SocketAddr,
    creds: &Credentials,
) -> Result<quinn::Endpoint, CommError> {
    let bind = match target {
        SocketAddr::V4(_) => SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0)),
        SocketAddr::V6(_) => SocketAddr::from((Ipv6Addr::UNSPECIFIED, 0)),
    };
    client_endpoint_on(bind, creds)
}

fn client_endpoint_on(bind: SocketAddr, creds: &Credentials) -> Result<quinn::Endpoint, CommError> {
    let mut endpoint = quinn::Endpoint::client(bind)
        .map_err(|source| CommError::Endpoint { addr: bind, source })?;
    endpoint.set_default_client_config(quinn_client_config(creds)?);
    Ok(endpoint)
}

fn quinn_client_config(creds: &Credentials) -> Result<quinn::ClientConfig, CommError> {
    let crypto = QuicClientConfig::try_from(client_config(creds)?).map_err(|e| CommError::Tls {
        identity: creds.identity().to_string(),
        message: e.to_string(),
    })?;
    let mut config = quinn::ClientConfig::new(Arc::new(crypto));
    config.transport_config(transport_config());
    Ok(config)
}

/// Connects to the peer `server` at `addr`, verifying its certificate against the cluster
/// CA and its name ([`Identity::dns_name`]), and checks that the certificate's identity is
/// `server`. The handshake is bounded by [`MAX_IDLE_TIMEOUT`].
pub async fn connect(
    endpoint: &quinn::Endpoint,
    addr: SocketAddr,
    server: &Identity,
) -> Result<quinn::Connection, CommError> {
    let connecting =
        endpoint
            .connect(addr, &server.dns_name())
            .map_err(|e| CommError::Connect {
                addr,
                message: e.to_string(),
            })?;
    let connection = connecting
        .await
        .map_err(|source| CommError::Connection { addr, source })?;
    let found = peer_identity(&connection)?;
    if found != *server {
        connection.close(VarInt::from_u32(1), b"wrong peer");
        return Err(CommError::WrongPeer {
            expected: server.to_string(),
            found: found.to_string(),
        });
    }
    Ok(connection)
}

/// The identity in the peer's certificate (its `tessera://` URI). The certificate was
/// verified against the cluster CA during the handshake.
pub fn peer_identity(conn: &quinn::Connection) -> Result<Identity, CommError> {
    let addr = conn.remote_address();
    let certs = conn
        .peer_identity()
        .and_then(|any| any.downcast::<Vec<CertificateDer<'static>>>().ok())
        .ok_or(CommError::NoPeerCertificate { addr })?;
    let leaf = certs.first().ok_or(CommError::NoPeerCertificate { addr })?;
    identity_of_cert(leaf)
}

/// The group and rank of a shard identity; any other role is [`CommError::WrongRole`].
pub fn expect_shard(identity: &Identity) -> Result<(String, Rank), CommError> {
    match identity {
        Identity::Shard { group, rank } => Ok((group.clone(), *rank)),
        Identity::Coordinator(_) => Err(CommError::WrongRole {
            identity: identity.to_string(),
            expected: "shard",
        }),
    }
}

/// The peer id of a coordinator identity; any other role is [`CommError::WrongRole`].
pub fn expect_coordinator(identity: &Identity) -> Result<PeerId, CommError> {
    match identity {
        Identity::Coordinator(id) => Ok(*id),
        Identity::Shard { .. } => Err(CommError::WrongRole {
            identity: identity.to_string(),
            expected: "coordinator",
        }),
    }
}
